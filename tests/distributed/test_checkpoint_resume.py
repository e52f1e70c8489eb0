"""Resume through pretrain_gpt.py: exact (bit-for-bit) in the same layout, 1e-5 in another layout,
SIGTERM to a torchrun job (every rank saves and exits 0), and a save killed mid-write.

The one-rank runs are in-process (pretrain_gpt.main(argv)); the two-rank runs use torchrun with this
file as the entry point (see __main__ at the bottom: it runs main and then leaves a marker per rank).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_sp.testing import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERS = 8
TINY = ("--mock-data --vocab-size 300 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
        "--num-query-groups 2 --swiglu --position-embedding-type rope --normalization RMSNorm "
        "--disable-bias-linear --untie-embeddings-and-output-weights "
        "--seq-length 32 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --lr-warmup-iters 2 "
        f"--lr-decay-iters {ITERS} --lr-decay-style cosine --min-lr 1e-4 --log-interval 1 "
        "--eval-iters 0 --attention-backend sdpa --seed 5 --attention-dropout 0 --hidden-dropout 0").split()


def _main(argv):
    sys.path.insert(0, ROOT)
    import pretrain_gpt
    pretrain_gpt.main(argv)


def _losses(path):
    with open(path) as f:
        return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in map(json.loads, f)
                if "lm_loss" in r}


def _torchrun(args, tmp, name):
    env = dict(os.environ, CKPT_TEST_MARKERS=str(tmp / f"{name}-markers"), OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "--log-dir", str(tmp / f"{name}-logs"), "--redirects", "3",
           os.path.abspath(__file__)] + args
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """8 iterations in one go on one rank: the reference losses."""
    tmp = tmp_path_factory.mktemp("straight")
    _main(TINY + ["--train-iters", str(ITERS), "--metrics-jsonl", str(tmp / "m.jsonl")])
    return _losses(tmp / "m.jsonl")


def test_exact_resume_and_other_layout(straight, tmp_path):
    # 3 iterations, exit (--exit-interval saves), resume to 8: identical bit for bit.
    jsonl = str(tmp_path / "resumed.jsonl")
    _main(TINY + ["--train-iters", str(ITERS), "--exit-interval", "3", "--save", str(tmp_path / "a"),
                  "--metrics-jsonl", jsonl])
    assert open(tmp_path / "a" / "latest_checkpointed_iteration.txt").read() == "3"
    _main(TINY + ["--train-iters", str(ITERS), "--load", str(tmp_path / "a"),
                  "--save", str(tmp_path / "b"), "--save-interval", "4", "--metrics-jsonl", jsonl])
    resumed = _losses(jsonl)
    assert sorted(resumed) == list(range(1, ITERS + 1))
    assert resumed == straight, "resumed losses differ from the uninterrupted run"
    assert sorted(os.listdir(tmp_path / "b")) == ["iter_0000004", "iter_0000008",
                                                  "latest_checkpointed_iteration.txt"]
    # The 1-rank checkpoint at iteration 3 resumed with tp=2 (vocab re-padded 384 -> 512) to 6.
    proc = _torchrun(TINY + ["--tensor-model-parallel-size", "2", "--train-iters", "6",
                             "--load", str(tmp_path / "a"), "--metrics-jsonl",
                             str(tmp_path / "tp2.jsonl")], tmp_path, "tp2")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    tp2 = _losses(tmp_path / "tp2.jsonl")
    assert sorted(tp2) == [4, 5, 6], tp2
    for it, (loss, norm) in tp2.items():
        assert abs(loss - straight[it][0]) <= 1e-5 * abs(straight[it][0]), (it, loss, straight[it])
        assert abs(norm - straight[it][1]) <= 1e-4 * max(1.0, straight[it][1]), (it, norm)


def test_sigterm_torchrun_saves_and_every_rank_exits(straight, tmp_path):
    """SIGTERM to torchrun (forwarded to the ranks, as a scheduler's pre-emption): the ranks agree,
    save at the end of the iteration and exit 0; the sp=2 checkpoint (asynchronous saves every 2
    iterations, the last one published before exit) then resumes on one rank."""
    jsonl = tmp_path / "m.jsonl"
    proc = _torchrun(TINY + ["--sequence-parallel-size", "2", "--train-iters", "100000",
                             "--async-save", "--save-interval", "2", "--exit-signal-handler", "--save", str(tmp_path / "ck"),
                             "--metrics-jsonl", str(jsonl)], tmp_path, "sigterm")
    deadline = time.time() + 90
    while time.time() < deadline and not (jsonl.exists() and len(jsonl.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    markers = tmp_path / "sigterm-markers"
    assert sorted(os.listdir(markers)) == ["rank0.exit0", "rank1.exit0"], out
    k = int(open(tmp_path / "ck" / "latest_checkpointed_iteration.txt").read())
    assert k == max(_losses(jsonl)) and 2 <= k <= ITERS - 2, (k, out)
    assert os.path.isdir(tmp_path / "ck" / f"iter_{k:07d}")
    # Resume that sp=2 checkpoint on one rank for two iterations: the uninterrupted losses.
    _main(TINY + ["--train-iters", str(k + 2), "--load", str(tmp_path / "ck"),
                  "--metrics-jsonl", str(tmp_path / "one.jsonl")])
    one = _losses(tmp_path / "one.jsonl")
    assert sorted(one) == [k + 1, k + 2]
    for it, (loss, _) in one.items():
        assert abs(loss - straight[it][0]) <= 1e-5 * abs(straight[it][0]), (it, loss, straight[it])


KILL_SCRIPT = textwrap.dedent("""
    import sys, torch
    from megatron_sp import checkpointing as ck
    from megatron_sp.mesh import ParallelMesh
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.full((1024, 1024), float(i)))
                                    for i in range(16)])   # 64 MiB
    mesh = ParallelMesh.single()
    ck.save_checkpoint(sys.argv[1], 1, [model], mesh)
    print("saved 1", flush=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    for it in range(2, 100):
        ck.save_checkpoint(sys.argv[1], it, [model], mesh)
""")


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    import torch
    from megatron_sp import checkpointing as ck
    from megatron_sp.mesh import ParallelMesh
    root = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(root)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (root / "iter_0000002.tmp").exists():
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.002)
    time.sleep(0.005)   # into the save of iteration 2
    proc.kill()
    proc.communicate()
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert not (root / "iter_0000002").exists()
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(1024, 1024)) for _ in range(16)])
    meta = ck.load_checkpoint(str(root), [model], ParallelMesh.single())
    assert meta["iteration"] == 1
    for i, p in enumerate(model.parameters()):
        assert torch.equal(p, torch.full((1024, 1024), float(i))), i
    # The next save cleans the leftover and publishes normally.
    ck.save_checkpoint(str(root), 2, [model], ParallelMesh.single())
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002",
                                        "latest_checkpointed_iteration.txt"]


if __name__ == "__main__":   # torchrun entry: one rank of pretrain_gpt, then a marker if it returned
    _main(sys.argv[1:])
    markers = os.environ.get("CKPT_TEST_MARKERS")
    if markers:
        os.makedirs(markers, exist_ok=True)
        open(os.path.join(markers, f"rank{os.environ.get('RANK', '0')}.exit0"), "w").close()
    from megatron_sp.reporting import exit_process
    exit_process(0)      # as pretrain_gpt's entry: no interpreter finalization to race with gloo
