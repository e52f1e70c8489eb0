"""Damaged checkpoints and schedule changes on resume (docs/design.md §12).

Every damage case (truncated shard, deleted shard, truncated .metadata, broken megatron_sp.json,
64 flipped bytes inside a shard) ends in one CheckpointError sentence naming the file, the iteration
and the --ckpt-step to fall back to; nothing is read into the model and nothing on disk changes.
--ckpt-step loads an older iteration, --no-verify-checkpoint skips the check, and a changed
learning-rate schedule is refused / overridden / taken from the checkpoint (Megatron's flags).

The one-rank cases are in-process (no spawn); one torchrun pair checks the collective verdict: a
shard only rank 1 finds damaged stops both ranks with the sentence printed once and no traceback.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_sp.checkpointing import CheckpointError
from megatron_sp.testing import free_port

from library_helpers import read_full_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ("--mock-data --vocab-size 300 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
        "--seq-length 32 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --lr-warmup-iters 1 "
        "--lr-decay-style cosine --min-lr 1e-4 --log-interval 1 --eval-iters 0 "
        "--attention-backend sdpa --seed 5 --attention-dropout 0 --hidden-dropout 0").split()


def _snapshot(root) -> dict[str, str]:
    """sha1 of every file under `root` by relative path: 'nothing written or lost'."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = hashlib.sha1(open(path, "rb").read()).hexdigest()
    return out


def _truncate(path, keep=None):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2 if keep is None else keep])


def _flip(path, n=64):
    """Invert `n` bytes in the middle of the largest tensor stored in the DCP file `path` (its data,
    not a header: unverified, the load then succeeds with wrong weights)."""
    from torch.distributed.checkpoint import FileSystemReader
    folder, name = os.path.split(path)
    items = [s for s in FileSystemReader(folder).read_metadata().storage_data.values()
             if s.relative_path == name]
    item = max(items, key=lambda s: s.length)
    data = bytearray(open(path, "rb").read())
    start = item.offset + item.length // 2
    data[start:start + n] = bytes(b ^ 0xFF for b in data[start:start + n])
    open(path, "wb").write(bytes(data))


DAMAGE = {   # case -> (file damaged, how)
    "truncated shard": ("__0_0.distcp", _truncate),
    "deleted shard": ("__0_0.distcp", os.remove),
    "truncated .metadata": (".metadata", _truncate),
    "broken megatron_sp.json": ("megatron_sp.json", lambda p: _truncate(p, 100)),
    "64 flipped bytes": ("__0_0.distcp", _flip),
}


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.ParameterList([torch.nn.Parameter(torch.randn(64, 64, generator=g))
                                   for _ in range(4)])


@pytest.mark.parametrize("seed", [11])
def test_damaged_checkpoint_one_sentence_and_ckpt_step(tmp_path, seed):
    from megatron_sp import checkpointing as ck
    from megatron_sp.checkpointing import integrity
    from megatron_sp.mesh import ParallelMesh
    mesh, root = ParallelMesh.single(), str(tmp_path / "ck")
    saved = {}
    for it in (2, 4):
        model = _params(seed + it)
        ck.save_checkpoint(root, it, [model], mesh)
        saved[it] = [p.detach().clone() for p in model]
    meta = json.load(open(os.path.join(root, "iter_0000004", "megatron_sp.json")))
    assert meta["checksums"]["algorithm"] == integrity.algorithm()   # xxh3 where xxhash is
    assert sorted(meta["checksums"]["files"]) == [".metadata", "__0_0.distcp"]
    folder = os.path.join(root, "iter_0000004")
    pristine = str(tmp_path / "pristine")
    shutil.copytree(folder, pristine)
    for case, (name, damage) in DAMAGE.items():
        for verify in (True, False):
            shutil.rmtree(folder)
            shutil.copytree(pristine, folder)
            damage(os.path.join(folder, name))
            before = _snapshot(root)
            target = _params(99)
            untouched = [p.detach().clone() for p in target]
            try:
                ck.load_checkpoint(root, [target], mesh, verify=verify)
            except ck.CheckpointError as err:
                msg = str(err)
            else:
                # Only flipped bytes can load at all, and only unverified: silently wrong weights.
                assert case == "64 flipped bytes" and not verify, f"{case}: loaded"
                assert any(not torch.equal(p, q) for p, q in zip(target, saved[4])), case
                continue
            assert "\n" not in msg and msg.endswith("with --ckpt-step 2."), (case, msg)
            assert "iteration 4 is damaged" in msg, (case, msg)
            if verify or name == "megatron_sp.json":   # the exact file is named
                assert f"checkpoint file {os.path.join(folder, name)} " in msg, (case, msg)
            else:                                     # DCP's own failure, named by folder
                assert f"checkpoint {folder} could not be read" in msg, (case, msg)
            assert _snapshot(root) == before, f"{case}: the load changed files"
            if verify:   # refused before any byte was read into the model
                assert all(torch.equal(p, q) for p, q in zip(target, untouched)), case
    expected = {"truncated shard": "is truncated", "deleted shard": "is missing",
                "truncated .metadata": "is truncated", "64 flipped bytes": "has changed since"}
    for case, words in expected.items():   # the verified messages, one by one
        name, damage = DAMAGE[case]
        shutil.rmtree(folder)
        shutil.copytree(pristine, folder)
        damage(os.path.join(folder, name))
        with pytest.raises(ck.CheckpointError, match=words):
            ck.load_checkpoint(root, [_params(99)], mesh)
    # --ckpt-step: iteration 2 whatever the tracker says; a missing step lists what exists.
    target = _params(99)
    assert ck.load_checkpoint(root, [target], mesh, step=2)["iteration"] == 2
    assert all(torch.equal(p, q) for p, q in zip(target, saved[2]))
    with pytest.raises(ck.CheckpointError, match=r"--ckpt-step 3: .*iter_0000003 is missing or "
                                                 r"incomplete; the complete iterations under .* are 2, 4"):
        ck.load_checkpoint(root, [target], mesh, step=3)
    # The oldest iteration damaged: no fallback to name.
    _flip(os.path.join(root, "iter_0000002", "__0_0.distcp"))
    with pytest.raises(ck.CheckpointError, match="holds no earlier complete checkpoint; restore"):
        ck.load_checkpoint(root, [target], mesh, step=2)


def _no_xxhash(monkeypatch):
    """Make `import xxhash` fail, as on a machine installed without it (pip --no-deps)."""
    monkeypatch.setitem(sys.modules, "xxhash", None)


@pytest.mark.parametrize("seed", [23])
def test_digest_recorded_and_crc32_fallback(tmp_path, monkeypatch, seed):
    """The save records its digest (xxh3 with xxhash, crc32 without) and the load verifies with the
    recorded one: a CRC-32 checkpoint verifies either way, an XXH3 one without xxhash stops with
    one sentence (pip install xxhash, or skip verification), and flipped bytes are caught by both."""
    from megatron_sp import checkpointing as ck
    from megatron_sp.checkpointing import integrity
    from megatron_sp.mesh import ParallelMesh
    mesh, root = ParallelMesh.single(), str(tmp_path / "ck")
    have_xxhash = integrity._digest_function("xxh3") is not None
    saved = {}

    def save(it):
        model = _params(seed + it)
        ck.save_checkpoint(root, it, [model], mesh)
        saved[it] = [p.detach().clone() for p in model]
        return json.load(open(os.path.join(root, ck.iteration_dirname(it), "megatron_sp.json")))

    def loads(it, **kw):
        target = _params(99)
        ck.load_checkpoint(root, [target], mesh, step=it, **kw)
        return all(torch.equal(p, q) for p, q in zip(target, saved[it]))

    if have_xxhash:
        meta = save(2)
        assert meta["checksums"]["algorithm"] == "xxh3"
        assert all(set(r) == {"size", "ends", "xxh3"} for r in meta["checksums"]["files"].values())
        assert loads(2)
    with monkeypatch.context() as m:
        _no_xxhash(m)
        assert integrity.algorithm() == "crc32"
        meta = save(4)
        assert meta["checksums"]["algorithm"] == "crc32"
        assert all(set(r) == {"size", "ends", "crc32"} for r in meta["checksums"]["files"].values())
        assert loads(4)                                  # the fallback verifies its own checkpoints
        if have_xxhash:                                  # an xxh3 one needs xxhash: one sentence
            with pytest.raises(ck.CheckpointError) as err:
                loads(2)
            assert str(err.value) == (
                f"checkpoint {os.path.join(root, 'iter_0000002')} records xxh3 checksums, but the "
                f"xxhash package is not installed: pip install xxhash to verify them, or pass "
                f"--no-verify-checkpoint to load it unverified.")
            with pytest.raises(ck.CheckpointError, match=r"pip install xxhash .*, or pass "
                                                         r"verify=False to load it unverified\.$"):
                read_full_tensors(os.path.join(root, "iter_0000002"))
            assert loads(2, verify=False)
    assert loads(4)                                      # CRC-32 verifies with xxhash present too
    if have_xxhash:   # ranks whose installs differ: each file is verified with its own digest
        folder = os.path.join(root, "iter_0000002")
        mixed = {**integrity.checksum_files(folder, [".metadata"], digest="crc32"),
                 **integrity.checksum_files(folder, ["__0_0.distcp"], digest="xxh3")}
        assert integrity.algorithms_of(mixed) == ["crc32", "xxh3"]
        integrity.verify_files(folder, sorted(mixed), mixed, "advice")
    for it, name in ((4, "CRC-32"),) + (((2, "XXH3-64"),) if have_xxhash else ()):
        _flip(os.path.join(root, ck.iteration_dirname(it), "__0_0.distcp"))
        with pytest.raises(ck.CheckpointError, match=f"has changed since it was saved \\(the "
                                                     f"{name} of bytes"):
            loads(it)


def _tiny_gpt_checkpoint(root, seed):
    """Iterations 2 and 4 of a one-layer GPT (config recorded) under `root`."""
    from megatron_sp import checkpointing as ck
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import GPTConfig, GPTModel
    torch.manual_seed(seed)
    config = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=50)
    for it in (2, 4):
        ck.save_checkpoint(root, it, [GPTModel(config, ParallelMesh.single())],
                           ParallelMesh.single(), config=config)


@pytest.mark.parametrize("seed", [31])
def test_damaged_checkpoint_outside_training(tmp_path, seed):
    """read_full_tensors / load_pretrained (no training flags): a damaged .metadata of an old
    checkpoint (no checksums recorded) is one sentence naming the file, and the advice names an
    earlier iteration folder, never --ckpt-step or --load."""
    import megatron_sp
    from megatron_sp import checkpointing as ck
    root = str(tmp_path / "ck")
    _tiny_gpt_checkpoint(root, seed)
    folder = os.path.join(root, "iter_0000004")
    pristine = str(tmp_path / "pristine")
    shutil.copytree(folder, pristine)
    earlier = (f"iteration 4 is damaged; load an earlier iteration folder instead, e.g. "
               f"{os.path.join(root, 'iter_0000002')}, the newest complete one.")

    def refusal(fn):
        with pytest.raises(ck.CheckpointError) as err:
            fn(root)
        msg = str(err.value)
        assert "\n" not in msg and "--ckpt-step" not in msg and "--load" not in msg, msg
        return msg

    # An old checkpoint (no checksums) with a truncated .metadata: DCP's unpickling error, named.
    meta_path = os.path.join(folder, ck.META_FILENAME)
    meta = json.load(open(meta_path))
    meta.pop("checksums")
    json.dump(meta, open(meta_path, "w"))
    _truncate(os.path.join(folder, ".metadata"))
    for fn in (read_full_tensors, megatron_sp.load_pretrained):
        msg = refusal(fn)
        assert msg.startswith(f"checkpoint file {os.path.join(folder, '.metadata')} could not be "
                              f"read (UnpicklingError"), msg
        assert msg.endswith(earlier), msg
    # With checksums: a damaged shard, verified; the same advice.
    shutil.rmtree(folder)
    shutil.copytree(pristine, folder)
    _flip(os.path.join(folder, "__0_0.distcp"))
    for fn in (read_full_tensors, megatron_sp.load_pretrained):
        assert refusal(fn).endswith(earlier)
    # The oldest iteration damaged: nothing earlier to name.
    _truncate(os.path.join(root, "iter_0000002", "__0_0.distcp"))
    with pytest.raises(ck.CheckpointError, match=r"holds no earlier complete checkpoint; restore "
                                                 r"the file from a copy\.$"):
        megatron_sp.load_pretrained(os.path.join(root, "iter_0000002"))


def test_schedule_change_refused_overridden_or_taken_from_checkpoint(tmp_path):
    from megatron_sp import checkpointing as ck
    from megatron_sp.config import CheckpointConfig
    from megatron_sp.errors import ConfigError
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.training.optimizer import LRScheduler
    mesh, root = ParallelMesh.single(), str(tmp_path / "ck")

    def build(decay_iters, max_lr=1e-3):
        model = _params(3)
        opt = torch.optim.AdamW(model.parameters(), lr=max_lr)
        return model, opt, LRScheduler(opt, max_lr, 1e-4, 2, decay_iters, "cosine")

    model, opt, sched = build(10)
    sum(p.sum() for p in model).backward()
    opt.step()   # AdamW state to save
    sched.step(6)
    ck.save_checkpoint(root, 6, [model], mesh, optimizer=opt, scheduler=sched)
    # Same schedule: loads without a flag.
    model, opt, same = build(10)
    ck.load_checkpoint(root, [model], mesh, optimizer=opt, scheduler=same)
    assert same.num_steps == 6 and opt.param_groups[0]["lr"] == sched.lr
    # --train-iters 20 (so --lr-decay-iters 20) and another --lr: refused, naming both flags.
    model, opt, longer = build(20, max_lr=2e-3)
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(root, [model], mesh, optimizer=opt, scheduler=longer)
    msg = str(err.value)
    assert "--lr-decay-iters (or --train-iters, its default) 20 now but 10 in the checkpoint" in msg
    assert "--lr 0.002 now but 0.001 in the checkpoint" in msg
    assert "--override-opt_param-scheduler" in msg and "--use-checkpoint-opt_param-scheduler" in msg
    assert longer.num_steps == 0
    # --override-opt_param-scheduler: the command line's schedule at the checkpoint's step.
    ck.load_checkpoint(root, [model], mesh, optimizer=opt, scheduler=longer, schedule="override")
    assert (longer.num_steps, longer.decay_iters, longer.max_lr) == (6, 20, 2e-3)
    assert opt.param_groups[0]["lr"] == longer.lr_at(6) != sched.lr
    # --use-checkpoint-opt_param-scheduler: the checkpoint's schedule, the same learning rate.
    model, opt, longer = build(20, max_lr=2e-3)
    ck.load_checkpoint(root, [model], mesh, optimizer=opt, scheduler=longer, schedule="checkpoint")
    assert (longer.num_steps, longer.decay_iters, longer.max_lr) == (6, 10, 1e-3)
    assert opt.param_groups[0]["lr"] == sched.lr
    # Both flags at once contradict each other (Megatron asserts the same).
    with pytest.raises(ConfigError, match="contradict each other: pass one of them"):
        CheckpointConfig(load=root, override_opt_param_scheduler=True,
                         use_checkpoint_opt_param_scheduler=True)


def _main(argv):
    sys.path.insert(0, ROOT)
    import pretrain_gpt
    pretrain_gpt.main(argv)


def _iterations(path):
    with open(path) as f:
        return [r["iteration"] for r in map(json.loads, f) if "lm_loss" in r]


def test_torchrun_damaged_shard_said_once_then_cli_flags(tmp_path):
    """2 ranks (tp=2) save iterations 2 and 4; bytes flipped in rank 1's shard of iteration 4. The
    resumed torchrun job stops on both ranks, the sentence once, no traceback, files unchanged. Then
    one-rank runs: --ckpt-step 2 resumes at 3, --no-verify-checkpoint loads the damaged 4, a longer
    --train-iters is refused until --override-opt_param-scheduler or
    --use-checkpoint-opt_param-scheduler."""
    save = tmp_path / "ck"

    def torchrun(args, name):
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               "--log-dir", str(tmp_path / name), "--redirects", "3",
               os.path.join(ROOT, "pretrain_gpt.py")] + TINY + ["--tensor-model-parallel-size", "2"] + args
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=180)
        logs = "".join(open(f).read() for f in sorted(glob.glob(str(tmp_path / name / "**" / "*.log"),
                                                                recursive=True)))
        return proc.returncode, logs, proc.stdout   # the ranks' output, torchrun's own

    rc, logs, out = torchrun(["--train-iters", "4", "--save-interval", "2", "--save", str(save)],
                             "save")
    assert rc == 0, logs + out
    shard = save / "iter_0000004" / "__1_0.distcp"
    _flip(str(shard))
    before = _snapshot(save)
    rc, logs, out = torchrun(["--train-iters", "6", "--lr-decay-iters", "4", "--load", str(save),
                         "--save", str(save)], "resume")
    sentence = (re.escape(f"error: checkpoint file {shard} has changed since it was saved (the ") +
                r"(XXH3-64|CRC-32) of bytes \d+-\d+" +
                re.escape(" differs from the one recorded at save): iteration 4 is damaged; "
                          "resume from iteration 2, the newest earlier complete checkpoint, with "
                          "--ckpt-step 2."))
    assert rc != 0 and len(re.findall(sentence, logs)) == 1, logs + out
    assert "Traceback" not in logs, logs
    assert _snapshot(save) == before, "the refused resume changed the checkpoint folder"
    # One rank (any layout loads): --ckpt-step 2 resumes at iteration 3.
    jsonl = str(tmp_path / "step.jsonl")
    _main(TINY + ["--train-iters", "3", "--lr-decay-iters", "4", "--load", str(save),
                  "--ckpt-step", "2", "--metrics-jsonl", jsonl])
    assert _iterations(jsonl) == [3]
    # --no-verify-checkpoint: the damaged iteration 4 loads (the user asked for it).
    jsonl = str(tmp_path / "noverify.jsonl")
    _main(TINY + ["--train-iters", "5", "--lr-decay-iters", "4", "--load", str(save),
                  "--no-verify-checkpoint", "--metrics-jsonl", jsonl])
    assert _iterations(jsonl) == [5]
    # A longer run changes the decay (--lr-decay-iters defaults to --train-iters): refused.
    with pytest.raises(CheckpointError) as err:      # (run_main says it, once)
        _main(TINY + ["--train-iters", "3", "--load", str(save), "--ckpt-step", "2"])
    assert str(err.value) == (
        f"the learning-rate schedule differs from the one of checkpoint "
        f"{save / 'iter_0000002'} (--lr-decay-iters (or --train-iters, its default) 3 now but 4 in "
        f"the checkpoint): pass --override-opt_param-scheduler to follow the command line or "
        f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule.")
    for flag in ("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"):
        jsonl = str(tmp_path / f"{flag}.jsonl")
        _main(TINY + ["--train-iters", "3", "--load", str(save), "--ckpt-step", "2", flag,
                      "--metrics-jsonl", jsonl])
        assert _iterations(jsonl) == [3], flag
    assert _snapshot(save) == before, "runs without --save changed the checkpoint folder"
