"""pretrain_gpt.py on gloo reproduces the one-rank loss curve of its metrics file: tensor
parallelism (tp=2, with and without --sequence-parallel) and Ulysses (sp=4, under torchrun); and a
mixture-of-experts checkpoint saved at ep 2 resumes at ep 4.
Tolerance: 1e-5 relative on every logged training and validation loss.

One run (sp4) goes through torchrun as a user launches it; the others are the same script's ranks
forked with the launcher's environment set by hand (megatron_sp.testing.run_script: what they
compute is the same, without ~3.5 s of imports per process)."""
import os
import subprocess
import sys

from megatron_sp.testing import free_port, metrics_losses, run_script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
          "--num-attention-heads", "8", "--num-query-groups", "4", "--swiglu",
          "--position-embedding-type", "rope", "--normalization", "RMSNorm",
          "--disable-bias-linear", "--seq-length", "32", "--micro-batch-size", "2",
          "--global-batch-size", "4", "--train-iters", "4", "--log-interval", "1",
          "--eval-iters", "1", "--eval-interval", "4", "--lr", "1e-3", "--distributed-backend", "gloo",
          "--attention-dropout", "0", "--hidden-dropout", "0"]


def _launch(nproc, extra, metrics):
    """sp4's run under torchrun, in the background."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), "pretrain_gpt.py"]
    return subprocess.Popen(cmd + COMMON + extra + ["--metrics-jsonl", str(metrics)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run(nproc, extra, metrics, name) -> str:
    """A run's ranks forked (run_script); every rank must exit 0. Returns their output."""
    rcs, out = run_script("pretrain_gpt.py", COMMON + extra + ["--metrics-jsonl", str(metrics)],
                          world=nproc, timeout_s=300)
    assert rcs == [0] * nproc, f"{name}: exit {rcs}\n{out[-4000:]}"
    return out


def test_tp2_tp2_sequence_parallel_and_sp4_match_one_rank(tmp_path):
    runs = {"one": (1, []),
            "tp2": (2, ["--tensor-model-parallel-size", "2"]),
            "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
            "sp4": (4, ["--sequence-parallel-size", "4"])}
    sp4 = _launch(*runs["sp4"], tmp_path / "sp4.jsonl")      # torchrun, while the others run
    for name in ("one", "tp2", "tp2-sp"):
        _run(*runs[name], tmp_path / f"{name}.jsonl", name)
    out, _ = sp4.communicate(timeout=300)
    assert sp4.returncode == 0, f"sp4:\n{out[-4000:]}"
    train1, valid1 = metrics_losses(tmp_path / "one.jsonl")
    assert len(train1) == 4 and len(valid1) == 1
    for name in ("tp2", "tp2-sp", "sp4"):
        train, valid = metrics_losses(tmp_path / f"{name}.jsonl")
        assert len(train) == 4 and len(valid) == 1, name
        for a, b in zip(train1 + valid1, train + valid):
            assert abs(a - b) <= 1e-5 * abs(a), (name, train1 + valid1, train + valid)
    # sp4 at dp1: the gradient sum runs over dp x sp and the log names that group.
    import json
    records = [json.loads(line) for line in open(tmp_path / "sp4.jsonl") if '"lm_loss"' in line]
    assert all(r.get("bytes/dp_sp/all_reduce", 0) > 0 for r in records), records[0].keys()
    assert not any(key.startswith("bytes/dp/") for r in records for key in r)


def test_moe_saved_at_ep2_resumes_at_ep4(tmp_path):
    """A mixture-of-experts run at dp 2 x sp 2 with --expert-model-parallel-size 2 saves at
    iteration 2; resumed from it with --expert-model-parallel-size 4 (other experts per rank, the
    same full expert stacks in the checkpoint), iterations 3-4 log the same lm loss, router loss
    and grad norm as the uninterrupted run (1e-5 relative); so does the resume at ep 4 under
    --use-torch-fsdp2 (each ep rank's experts sharded over its edp group)."""
    import json
    moe = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
           "--moe-aux-loss-coeff", "1e-2", "--moe-router-load-balancing-type", "seq_aux_loss",
           "--sequence-parallel-size", "2", "--eval-iters", "0"]
    ckpt = str(tmp_path / "ckpt")
    runs = (("ep2", moe + ["--expert-model-parallel-size", "2", "--save", ckpt,
                           "--save-interval", "2"]),
            ("ep4", moe + ["--expert-model-parallel-size", "4", "--load", ckpt, "--ckpt-step", "2"]),
            ("ep4-fsdp2", moe + ["--expert-model-parallel-size", "4", "--load", ckpt,
                                 "--ckpt-step", "2", "--use-torch-fsdp2"]))
    for name, extra in runs:
        _run(4, extra, tmp_path / f"{name}.jsonl", name)

    def logged(name):
        keys = ("lm_loss", "load_balancing_loss", "grad_norm")
        records = map(json.loads, open(tmp_path / f"{name}.jsonl"))
        return {r["iteration"]: [r[k] for k in keys] for r in records if "lm_loss" in r}

    straight = logged("ep2")
    assert sorted(straight) == [1, 2, 3, 4], straight
    for name in ("ep4", "ep4-fsdp2"):
        resumed = logged(name)
        assert sorted(resumed) == [3, 4], (name, resumed)
        for it in (3, 4):
            for a, b in zip(straight[it], resumed[it]):
                assert abs(a - b) <= 1e-5 * abs(a), (name, it, straight[it], resumed[it])
