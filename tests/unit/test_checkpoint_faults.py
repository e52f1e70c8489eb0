"""Checkpoint faults end in one sentence, lose nothing earlier and leave nothing behind
(docs/checkpoints.md "Failures"; issue 26).

- a full disk during a save, synchronous (in-process, a fault-injecting writer, and a real
  size-limited tmpfs where root allows a mount) and asynchronous on 2 ranks under torchrun (said at
  the next step, not the next save): the sentence names the folder, the bytes needed and free and
  the previous checkpoint; the .tmp folder is gone; the earlier checkpoint is still the latest and
  loads;
- a full disk on a rank whose failure DCP pickles to the others (issue 34: torch's zip writer
  error lost its OSError and came out as tracebacks), sync and async, in-process on a one-rank
  gloo group (fault writer, and a real tmpfs) and on rank 1 of 2 under torchrun;
- --ckpt-step naming an iteration that is not there (a missing --load folder too): refused, listing
  the complete ones;
- Ctrl-C during a save: one line, the .tmp folder removed;
- an unwritable --save (a path under a regular file, a read-only mount, a chmod 555 folder) and an
  unwritable --metrics-jsonl are refused before iteration 1; too little free space too;
- a non-UTF-8 tracker file, a truncated model.safetensors, a safetensors index naming a missing
  shard and a blocked pickle in pytorch_model.bin: one sentence naming the file; --debug keeps the
  traceback.

The pretrain_gpt.py runs are subprocesses started together (tests/unit/fault_writer.py installs the
faulty writer in them); the rest is in-process.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import fault_writer
from megatron_sp import checkpointing as ck
from megatron_sp.comm_stats import format_bytes
from megatron_sp.mesh import ParallelMesh
from megatron_sp.testing import finish_process, free_port, load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WRAPPER = os.path.join(ROOT, "tests", "unit", "fault_writer.py")
TINY = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--eval-iters", "0", "--log-interval", "1"]
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
# Root ignores file permissions: without CAP_DAC_OVERRIDE (setpriv) a chmod 555 folder binds it too.
NO_DAC = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps",
          "-dac_override,-dac_read_search"] if IS_ROOT and shutil.which("setpriv") else []


def _env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_SP_", "FAULT_WRITE_"))
         and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("SLURM_")}
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{k: str(v) for k, v in extra.items()})
    return e


def _start(args, prefix=(), torchrun=False, **env) -> subprocess.Popen:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--master-port", str(free_port())] if torchrun else [sys.executable])
    return subprocess.Popen([*prefix, *launcher, WRAPPER, *TINY, *args], cwd=ROOT,
                            env=_env(**{"FAULT_WRITE_MATCH": "no-such-path", **env}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)



def _one_error(rc: int, out: str) -> str:
    """Exit 1, exactly one `error:` line, no traceback from the ranks (torchrun's own report of a
    failed child, after its "failed (exitcode" line, aside); the sentence without 'error: '."""
    assert rc == 1, (rc, out[-3000:])
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, out[-3000:]
    ranks = out[:out.find("failed (exitcode:")] if "failed (exitcode:" in out else out
    assert "Traceback" not in ranks, out[-3000:]
    return lines[0][len("error: "):]


def _iterations(out: str) -> list[int]:
    return [int(m) for m in re.findall(r"^ iteration\s+(\d+)/", out, re.M)]


# In-process: the synchronous save ------------------------------------------------------------------

def _model(value: float, n: int = 4, size: int = 64) -> torch.nn.ParameterList:
    return torch.nn.ParameterList([torch.nn.Parameter(torch.full((size, size), value + i))
                                   for i in range(n)])


def _assert_iteration_1_is_latest_and_loads(root, n: int = 4, size: int = 64):
    assert ck.read_tracker(str(root)) == 1
    model = _model(0.0, n, size)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert ck.load_checkpoint(str(root), [model], ParallelMesh.single())["iteration"] == 1
    for i, p in enumerate(model.parameters()):
        assert torch.equal(p, torch.full((size, size), 1.0 + i)), i


def test_disk_full_during_a_synchronous_save(tmp_path):
    root = tmp_path / "ck"
    mesh = ParallelMesh.single()
    ck.save_checkpoint(str(root), 1, [_model(1.0)], mesh)
    undo = fault_writer.install("iter_0000002", errno.ENOSPC, after=100)
    try:
        with pytest.raises(ck.CheckpointError) as err:
            ck.save_checkpoint(str(root), 2, [_model(5.0)], mesh)
    finally:
        undo()
    free = shutil.disk_usage(root).free
    expected = (f"saving checkpoint {root}/iter_0000002 failed: no space left on the file system "
                f"of {root} (the checkpoint needs about {format_bytes(4 * 64 * 64 * 4)}, "
                f"{format_bytes(free)} are free); {root}/iter_0000002.tmp was removed and the "
                f"previous checkpoint {root}/iter_0000001 is intact (still the latest); free space "
                f"or choose another --save, then resume with --load {root}.")
    assert str(err.value).split(", ")[0] == expected.split(", ")[0]   # free space moves a little
    assert re.sub(r"[\d.]+ GiB are free", "", str(err.value)) == \
        re.sub(r"[\d.]+ GiB are free", "", expected)
    assert sorted(os.listdir(root)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    _assert_iteration_1_is_latest_and_loads(root)
    # Another OS error (the folder made read-only under the writer): named as such.
    undo = fault_writer.install("iter_0000002", errno.EROFS, after=0)
    try:
        with pytest.raises(ck.CheckpointError, match=re.escape(
                f"saving checkpoint {root}/iter_0000002 failed (Read-only file system); "
                f"{root}/iter_0000002.tmp was removed and the previous checkpoint "
                f"{root}/iter_0000001 is intact (still the latest); check the folder")):
            ck.save_checkpoint(str(root), 2, [_model(5.0)], mesh)
    finally:
        undo()
    assert sorted(os.listdir(root)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


def test_disk_full_while_publishing(tmp_path, monkeypatch):
    """Rank 0's own writes (the metadata, the tracker) fail after DCP's: the renamed folder that
    the tracker could not name is removed too; the tracker still names iteration 1."""
    from megatron_sp.checkpointing import io
    root = tmp_path / "ck"
    mesh = ParallelMesh.single()
    ck.save_checkpoint(str(root), 1, [_model(1.0)], mesh)
    write = io.write_text_atomic

    def full_at_tracker(path, text):
        if path.endswith("latest_checkpointed_iteration.txt"):
            open(path + ".tmp", "w").close()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path + ".tmp")
        write(path, text)
    monkeypatch.setattr(io, "write_text_atomic", full_at_tracker)
    with pytest.raises(ck.CheckpointError, match=re.escape(
            f"saving checkpoint {root}/iter_0000002 failed: no space left on the file system of "
            f"{root} (the checkpoint needs about 64.0 KiB, ")):
        ck.save_checkpoint(str(root), 2, [_model(5.0)], mesh)
    assert sorted(os.listdir(root)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    _assert_iteration_1_is_latest_and_loads(root)


@contextlib.contextmanager
def _tmpfs(path, size: str, read_only: bool = False):
    """A tmpfs of `size` mounted at `path` (root only); pytest.skip where mounting is refused."""
    os.makedirs(path, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_real_full_disk_on_a_small_tmpfs(tmp_path):
    """A real ENOSPC (torch's zip writer: 'unexpected pos ...' with the OSError as its context)."""
    with _tmpfs(tmp_path / "small", "1m") as small:
        root = small / "ck"
        mesh = ParallelMesh.single()
        ck.save_checkpoint(str(root), 1, [_model(1.0, 2, 128)], mesh)     # 128 KiB of tensors
        left = shutil.disk_usage(small).free
        with open(small / "filler", "wb") as f:       # leave ~40 KiB: the next save cannot fit
            f.write(b"\0" * (left - 40 * 1024))
        with pytest.raises(ck.CheckpointError) as err:
            ck.save_checkpoint(str(root), 2, [_model(5.0, 2, 128)], mesh)
        message = str(err.value)
        assert message.startswith(f"saving checkpoint {root}/iter_0000002 failed: no space left on "
                                  f"the file system of {root} (the checkpoint needs about "
                                  f"128.0 KiB, "), message
        free = re.search(r"KiB, ([\d.]+) KiB are free\)", message)
        assert free and 30 <= float(free.group(1)) <= 64, message   # the .tmp's bytes returned
        assert f"{root}/iter_0000002.tmp was removed and the previous checkpoint " \
               f"{root}/iter_0000001 is intact (still the latest)" in message
        assert sorted(os.listdir(root)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
        _assert_iteration_1_is_latest_and_loads(root, 2, 128)


@contextlib.contextmanager
def _one_rank_group(tmp_path):
    """A gloo process group of one rank in this process: DCP then gathers and broadcasts every
    write failure as a pickle (as between ranks), and --async-save writes in the background."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        yield ParallelMesh.from_sizes()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("disk", ["fault writer", "tmpfs"])
@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_disk_full_through_dcp_collectives_is_one_sentence(tmp_path, capfd, disk, async_save):
    """Issue 34: DCP pickles a rank's write failure to gather it, which drops torch's zip writer
    RuntimeError's cause (the OSError): a full disk came out as '[enforce fail at
    inline_container.cc:672] . unexpected pos 704 vs 598' with a traceback per rank. Now the
    writer keeps the errno: one sentence naming the folder, the .tmp removed, the tracker kept."""
    with contextlib.ExitStack() as stack:
        if disk == "tmpfs":
            root = stack.enter_context(_tmpfs(tmp_path / "small", "1m")) / "ck"
            size = 128
        else:
            root, size = tmp_path / "ck", 64
        mesh = stack.enter_context(_one_rank_group(tmp_path))
        ck.save_checkpoint(str(root), 1, [_model(1.0, 2, size)], mesh)
        if disk == "tmpfs":               # leave ~40 KiB: the next save cannot fit
            left = shutil.disk_usage(root).free
            with open(root.parent / "filler", "wb") as f:
                f.write(b"\0" * (left - 40 * 1024))
        else:
            stack.callback(fault_writer.install("iter_0000002.tmp/__0_", errno.ENOSPC, after=100))
        capfd.readouterr()
        with pytest.raises(ck.CheckpointError) as err:
            ck.save_checkpoint(str(root), 2, [_model(5.0, 2, size)], mesh, async_save=async_save)
            ck.finalize_async_save()
        message = str(err.value)
        background = " in the background" if async_save else ""
        assert message.startswith(f"saving checkpoint {root}/iter_0000002{background} failed: no "
                                  f"space left on the file system of {root} (the checkpoint "
                                  f"needs about {format_bytes(2 * size * size * 4)}, "), message
        assert message.endswith(f" are free); {root}/iter_0000002.tmp was removed and the previous "
                                f"checkpoint {root}/iter_0000001 is intact (still the latest); "
                                f"free space or choose another --save, then resume with --load "
                                f"{root}."), message
        assert "Traceback" not in capfd.readouterr().err
        assert sorted(os.listdir(root)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
        assert not ck.io.async_save_in_flight()
        _assert_iteration_1_is_latest_and_loads(root, 2, size)


def test_torch_writer_failure_without_its_cause_is_still_a_write_failure(tmp_path):
    """The sentence's fallback when only torch's bare RuntimeError arrives (a writer that DCP runs
    in threads): a failed write, said as a full disk when the checkpoint does not fit."""
    from torch.distributed.checkpoint.api import CheckpointException
    from megatron_sp.checkpointing import io
    bare = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    kind = io._save_error_kind(CheckpointException("write", {1: (bare, None)}))
    assert kind == {"kind": "os", "text": "a file write failed: unexpected pos 704 vs 598"}
    final, tmp = f"{tmp_path}/iter_0000002", f"{tmp_path}/iter_0000002.tmp"
    assert io._save_failure(kind, str(tmp_path), final, tmp, 2048, 1024, True).startswith(
        f"saving checkpoint {final} in the background failed: no space left on the file system "
        f"of {tmp_path} (the checkpoint needs about 2.0 KiB, 1.0 KiB are free); ")
    assert io._save_failure(kind, str(tmp_path), final, tmp, 1024, 2048).startswith(
        f"saving checkpoint {final} failed (a file write failed: unexpected pos 704 vs 598); ")


# --ckpt-step names an iteration that is not there ------------------------------------------------

def test_explicit_ckpt_step_that_does_not_exist_is_refused(tmp_path, capsys):
    """Issue 34: `--load <missing folder> --ckpt-step 3` said "no checkpoint found ... starting
    from scratch" and trained; an explicit step is a promise that it exists."""
    mesh = ParallelMesh.single()
    missing = tmp_path / "missing"
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(str(missing), [_model(0.0)], mesh, step=3)
    assert str(err.value) == (f"--ckpt-step 3: --load {missing} does not exist, so it holds no "
                              f"iteration 3; check the --load path, or leave out --ckpt-step to "
                              f"start from scratch.")
    assert ck.load_checkpoint(str(missing), [_model(0.0)], mesh) is None   # Megatron's way
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(str(empty), [_model(0.0)], mesh, step=3)
    assert str(err.value) == (f"--ckpt-step 3: {empty}/iter_0000003 is missing or incomplete, and "
                              f"{empty} holds no complete iteration; check the --load path, or "
                              f"leave out --ckpt-step.")
    root = tmp_path / "ck"
    for it in (2, 4):
        ck.save_checkpoint(str(root), it, [_model(float(it))], mesh)
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(str(root), [_model(0.0)], mesh, step=3)
    assert str(err.value) == (f"--ckpt-step 3: {root}/iter_0000003 is missing or incomplete; the "
                              f"complete iterations under {root} are 2, 4: pass one of them to "
                              f"--ckpt-step, or leave --ckpt-step out to load the latest.")
    assert ck.load_checkpoint(str(root), [_model(0.0)], mesh, step=2)["iteration"] == 2
    shutil.rmtree(root / "iter_0000004")
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(str(root), [_model(0.0)], mesh, step=3)
    assert str(err.value) == (f"--ckpt-step 3: {root}/iter_0000003 is missing or incomplete; the "
                              f"only complete iteration under {root} is 2: pass --ckpt-step 2, or "
                              f"leave --ckpt-step out to load the latest.")
    # The probe itself, in-process: refused before the first step.
    pretrain_gpt = load_script("pretrain_gpt.py")
    capsys.readouterr()
    with pytest.raises(ck.CheckpointError) as err:   # (run_main says it, once)
        pretrain_gpt.main(TINY + ["--train-iters", "2", "--load", str(missing), "--ckpt-step",
                                  "3"])
    assert str(err.value).startswith(f"--ckpt-step 3: --load {missing} does not exist")
    out = capsys.readouterr().out
    assert "starting from scratch" not in out and "iteration        1/" not in out, out


# Subprocesses started together: async disk full (torchrun), sync, Ctrl-C, start-up checks ----------

def test_save_faults_and_start_up_checks_end_in_one_sentence(tmp_path):
    runs = {}
    # Asynchronous, 2 ranks: iteration 4's background write fails on rank 1 only, inside a tensor
    # (torch's zip writer: a RuntimeError whose OSError DCP's pickle to rank 0 and back dropped,
    # issue 34); the next save would be at 8.
    runs["async"] = _start(["--train-iters", "12", "--save-interval", "4", "--async-save",
                            "--save", str(tmp_path / "async")], torchrun=True,
                           FAULT_WRITE_MATCH="iter_0000004.tmp/__1_", FAULT_WRITE_AFTER="200000")
    # Alone: its two ranks say one sentence only if rank 0 agrees within reporting.GRACE_S, which a
    # machine starved by the seven runs below cannot promise (seen under load).
    async_result = finish_process(runs.pop("async"))
    # Synchronous, 1 rank: iteration 2 saved, iteration 4's save fails.
    runs["sync"] = _start(["--train-iters", "6", "--save-interval", "2",
                           "--save", str(tmp_path / "sync")], FAULT_WRITE_MATCH="iter_0000004")
    # Ctrl-C while iteration 2 is being written (the writer sleeps in its first write).
    runs["ctrl-c"] = _start(["--train-iters", "4", "--save-interval", "2",
                             "--save", str(tmp_path / "intr")],
                            FAULT_WRITE_MATCH="iter_0000002", FAULT_WRITE_SLEEP_S="120")
    # Unwritable outputs, refused before iteration 1.
    (tmp_path / "plain").write_text("a regular file")
    runs["under a file"] = _start(["--train-iters", "2", "--save", str(tmp_path / "plain" / "ck")])
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o555)
    if not IS_ROOT or NO_DAC:     # root without setpriv: chmod binds no one here
        runs["chmod 555"] = _start(["--train-iters", "2", "--save", str(locked / "ck")],
                                   prefix=NO_DAC)
    runs["metrics"] = _start(["--train-iters", "2", "--metrics-jsonl",
                              str(tmp_path / "plain" / "m.jsonl")])
    # A non-UTF-8 tracker (with --debug: the traceback and the same sentence).
    bad = tmp_path / "badtracker"
    bad.mkdir()
    (bad / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe\x00\x01")
    runs["tracker"] = _start(["--train-iters", "2", "--load", str(bad)])
    runs["tracker --debug"] = _start(["--train-iters", "2", "--load", str(bad), "--debug"])

    # Ctrl-C: interrupt once the writer is inside the save.
    proc, seen, deadline = runs["ctrl-c"], "", time.monotonic() + 180
    while "[fault writer] slow write" not in seen and time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, seen[-3000:]
        seen += line
    os.kill(proc.pid, signal.SIGINT)
    rc, rest = finish_process(proc)
    sentence = _one_error(rc, seen + rest)
    root = tmp_path / "intr"
    assert sentence == (f"interrupted (Ctrl-C) while saving checkpoint {root}/iter_0000002: "
                        f"{root}/iter_0000002.tmp was removed and {root} holds no earlier "
                        f"checkpoint."), sentence
    assert os.listdir(root) == []

    results = {name: finish_process(p) for name, p in runs.items() if name != "ctrl-c"}
    results["async"] = async_result

    for name, folder, last in (("async", tmp_path / "async", None),
                               ("sync", tmp_path / "sync", 2)):
        rc, out = results[name]
        sentence = _one_error(rc, out)
        background = " in the background" if name == "async" else ""
        assert sentence.startswith(f"saving checkpoint {folder}/iter_0000004{background} failed: "
                                   f"no space left on the file system of {folder} (the "
                                   f"checkpoint needs about 1.5 MiB, "), sentence
        previous = (f"the previous checkpoint {folder}/iter_0000002 is intact (still the latest)"
                    if last else f"{folder} holds no earlier checkpoint")
        assert sentence.endswith(f" are free); {folder}/iter_0000004.tmp was removed and "
                                 f"{previous}; free space or choose another --save, then resume "
                                 f"with --load {folder}."), sentence
        assert not [n for n in os.listdir(folder) if n.endswith(".tmp") or n.startswith(".")]
        if name == "async":   # said at a step after the failure, before the next save (8)
            assert os.listdir(folder) == [] and 4 < max(_iterations(out)) < 8, out[-3000:]
        else:
            assert max(_iterations(out)) == 4 and ck.read_tracker(str(folder)) == 2
            assert sorted(os.listdir(folder)) == ["iter_0000002",
                                                  "latest_checkpointed_iteration.txt"]

    refusals = {
        "under a file": f"--save {tmp_path}/plain/ck cannot be created: {tmp_path}/plain is a "
                        f"regular file, not a folder; choose another path.",
        "chmod 555": f"--save {locked}/ck is not writable (permission denied); fix its "
                     f"permissions (chmod u+w) or choose another folder.",
        "metrics": f"--metrics-jsonl {tmp_path}/plain/m.jsonl: its folder {tmp_path}/plain cannot "
                   f"be created: {tmp_path}/plain is a regular file, not a folder; choose another "
                   f"path.",
    }
    for name, expected in refusals.items():
        if name in results:
            rc, out = results[name]
            assert _one_error(rc, out) == expected and _iterations(out) == [], out[-3000:]
    assert os.listdir(locked) == []

    tracker = bad / "latest_checkpointed_iteration.txt"
    expected = (f"{tracker} is not a text file (its 4 bytes are not UTF-8); it should hold an "
                f"iteration number or 'release': write the iteration to resume from into it, or "
                f"pass --ckpt-step N.")
    rc, out = results["tracker"]
    assert _one_error(rc, out) == expected and _iterations(out) == []
    rc, out = results["tracker --debug"]
    assert rc == 1 and "Traceback (most recent call last)" in out, out[-3000:]
    assert out.strip().splitlines()[-1] == "error: " + expected


def test_free_space_and_read_only_mount_refused_before_the_first_step(tmp_path, capsys):
    """In-process (the mounts need root): a read-only tmpfs as --save, and a 1 MiB tmpfs against
    a model whose checkpoint needs more (refused; --skip-free-space-check starts anyway)."""
    pretrain_gpt = load_script("pretrain_gpt.py")
    args = TINY + ["--train-iters", "1"]
    with _tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        with pytest.raises(ck.CheckpointError) as err:
            pretrain_gpt.main(args + ["--save", str(ro / "ck")])
        assert str(err.value) == (f"--save {ro}/ck is on a read-only file system; choose a "
                                  f"writable folder.")
    with _tmpfs(tmp_path / "small", "1m") as small:
        with pytest.raises(ck.CheckpointError) as err:
            pretrain_gpt.main(args + ["--save", str(small / "ck")])
        assert re.fullmatch(re.escape(f"--save {small}/ck has ") + r"10\d\d\.\d KiB" + re.escape(
            " free but one checkpoint of this model needs about 1.5 MiB; free space, choose "
            "another --save, or pass --skip-free-space-check to start anyway."), str(err.value)), \
            str(err.value)                                 # (the lock file holds a block)
        assert "iteration        1/" not in capsys.readouterr().out
        assert sorted(os.listdir(small / "ck")) == []          # nothing left: no probe, no lock
        with pytest.raises(ck.CheckpointError) as err:   # the flag starts it; the save fails
            pretrain_gpt.main(args + ["--save", str(small / "ck"), "--skip-free-space-check"])
        assert "iteration        1/" in capsys.readouterr().out
        assert str(err.value).startswith(f"saving checkpoint {small}/ck/iter_0000001 failed: no "
                                         f"space left on the file system of {small}/ck (the "
                                         f"checkpoint needs about 1.5 MiB, ")
        assert os.listdir(small / "ck") == []


# Hugging Face weight files (convert.py --loader hf, load_pretrained) ------------------------------

def _hf_folder(path, shards: bool = False):
    import transformers
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path, max_shard_size="20KB" if shards else "10GB")
    return path


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo owned",))


def test_hf_weight_files_are_named_in_one_sentence(tmp_path):
    convert = load_script("tools/checkpoint/convert.py")

    def refusal(folder) -> str:
        with pytest.raises(SystemExit) as err:
            convert.main(["--loader", "hf", "--saver", "megatron_sp", "--load-dir", str(folder),
                          "--save-dir", str(tmp_path / "out")])
        return str(err.value)

    single = _hf_folder(tmp_path / "single")
    file = single / "model.safetensors"
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(size // 2)
    assert refusal(single) == (f"error: weight file {file} ({size // 2} bytes) cannot be read "
                               f"(SafetensorError: Error while deserializing header: incomplete "
                               f"metadata, file not fully covered): it is truncated or damaged; "
                               f"download or copy it again.")

    sharded = _hf_folder(tmp_path / "sharded", shards=True)
    shards = sorted(n for n in os.listdir(sharded) if n.endswith(".safetensors"))
    assert len(shards) >= 2
    os.unlink(sharded / shards[1])
    assert refusal(sharded) == (f"error: {sharded}/model.safetensors.index.json names 1 shard(s) "
                                f"missing from {sharded} ({shards[1]}); download the missing "
                                f"shard(s) into that folder.")

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(single / "config.json", pickled / "config.json")
    torch.save({"model.embed_tokens.weight": torch.zeros(64, 32), "x": _Evil()},
               pickled / "pytorch_model.bin")
    message = refusal(pickled)
    assert message == (f"error: weight file {pickled}/pytorch_model.bin is refused: its pickle "
                       f"asks for more than tensors (Trying to load unsupported GLOBAL "
                       f"posix.system whose module posix is blocked), and .bin weights are read "
                       f"with torch.load(weights_only=True) only; convert it to model.safetensors "
                       f"with a tool you trust (save_pretrained(..., safe_serialization=True)).")
    with pytest.raises(ck.CheckpointError, match="is refused: its pickle asks for more"):
        ck.load_pretrained(str(pickled))
