"""One run per --save folder (megatron_sp/checkpointing/lock.py, docs/checkpoints.md).

- two concurrent runs on one --save: the second (2 ranks under torchrun, resubmitted with
  --load of the same folder) is refused at start-up by both ranks, naming the holder (host, pid,
  since); the first trains on, saves on SIGTERM and exits 0, and every checkpoint there is its own;
- a fresh run into a folder with another run's checkpoints is refused (--overwrite-save allows it);
- a stale lock (its process dead, this host) is taken over with one note; a record of another host
  is refused unless --force-unlock; without flock (some network file systems) the record decides;
- a lock file that names no holder (empty, garbage, `{}`, no host or pid) is taken over with one
  note; a symbolic or hard link (or a folder) at the lock's path is refused, its target untouched,
  and the save's temporary-then-rename writes do not follow links either (issue 34).
"""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from megatron_sp.checkpointing import CheckpointError
from megatron_sp.checkpointing.lock import LOCK_FILENAME, SaveLock, SaveLockError, describe
from megatron_sp.testing import finish_process, free_port, load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--eval-iters", "0", "--log-interval", "1"]


def _env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_SP_")
         and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")
         and not k.startswith("SLURM_")}
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{k: str(v) for k, v in extra.items()})
    return e


def _popen(cmd, **env) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)



def test_second_run_refused_naming_the_holder_and_first_keeps_its_checkpoints(tmp_path):
    save = tmp_path / "ck"
    first = _popen([sys.executable, "pretrain_gpt.py", *TINY, "--seed", "11", "--train-iters",
                    "100000", "--save-interval", "10", "--exit-signal-handler", "--save", str(save)],
                   MEGATRON_SP_INJECT_SLEEP_MS="200")       # a slow run: still going below
    lock = save / LOCK_FILENAME
    deadline = time.monotonic() + 180
    while not (lock.is_file() and lock.read_text().strip()):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
        time.sleep(0.1)
    record = json.loads(lock.read_text())
    assert record["pid"] == first.pid and record["host"] == socket.gethostname()

    # The same job resubmitted while the first still runs: 2 ranks, --load of the same folder.
    second = _popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                     "--master-port", str(free_port()), "pretrain_gpt.py", *TINY, "--seed", "22",
                     "--train-iters", "4", "--save-interval", "2", "--save", str(save),
                     "--load", str(save)])
    rc, out = finish_process(second)
    assert first.poll() is None, "the first run ended before the second was refused"
    os.kill(first.pid, signal.SIGTERM)                       # the first saves and exits
    rc_first, out_first = finish_process(first)

    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert rc != 0 and len(errors) == 1, out[-3000:]
    assert errors[0] == (f"error: --save {save} is locked by another run ({describe(record)}; "
                         f"lock file {lock}): wait for that run to end or choose another --save.")
    assert "Traceback" not in out[:out.find("failed (exitcode")], out[-3000:]
    assert not re.search(r"^ iteration ", out, re.M), "the second run trained"

    assert rc_first == 0, out_first[-3000:]
    iterations = sorted(int(n[5:]) for n in os.listdir(save) if re.fullmatch(r"iter_\d{7}", n))
    assert iterations and all(it % 10 == 0 or it == iterations[-1] for it in iterations)
    for it in iterations:   # every checkpoint is the first run's (its seed)
        meta = json.loads((save / f"iter_{it:07d}" / "megatron_sp.json").read_text())
        assert meta["args"]["seed"] == 11, (it, meta["args"]["seed"])
    assert (save / "latest_checkpointed_iteration.txt").read_text() == str(iterations[-1])
    assert not lock.exists() and not [n for n in os.listdir(save) if n.endswith(".tmp")]

    # A fresh run (no --load) into that folder: refused before it trains; --overwrite-save allows.
    pretrain_gpt = load_script("pretrain_gpt.py")
    with pytest.raises(CheckpointError) as err:
        pretrain_gpt.main(TINY + ["--train-iters", "1", "--save", str(save)])
    assert str(err.value) == (
        f"--save {save} already holds checkpoints of another run (newest: iteration "
        f"{iterations[-1]}) and there is no --load: pass --load {save} to resume that run "
        f"(Megatron's way), choose an empty --save, or pass --overwrite-save to save a new run "
        f"over them.")
    assert not lock.exists()
    other = tmp_path / "other"
    with pytest.raises(CheckpointError, match=re.escape(f"and --load {other} is another folder")):
        pretrain_gpt.main(TINY + ["--train-iters", "1", "--save", str(save), "--load", str(other)])
    pretrain_gpt.main(TINY + ["--train-iters", "1", "--save", str(save), "--overwrite-save"])
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert not lock.exists()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_record(folder, **record):
    folder.mkdir(parents=True, exist_ok=True)
    base = {"host": socket.gethostname(), "pid": 1, "job": None, "since": "2026-01-01 00:00:00 UTC"}
    (folder / LOCK_FILENAME).write_text(json.dumps({**base, **record}))
    return {**base, **record}


def test_stale_lock_taken_over_other_host_needs_force(tmp_path, monkeypatch):
    # A run killed with SIGKILL left its file behind; its flock died with it.
    stale = _write_record(tmp_path / "a", pid=_dead_pid(), job="4242")
    lock = SaveLock(str(tmp_path / "a"))
    assert lock.acquire() == (f"> taking over the stale lock {tmp_path}/a/{LOCK_FILENAME} of "
                              f"{describe(stale)}: that process is no longer running.")
    assert "job 4242" in describe(stale)
    assert json.loads((tmp_path / "a" / LOCK_FILENAME).read_text())["pid"] == os.getpid()
    # Held (flock) by this lock: a second lock on the folder is refused, naming us.
    with pytest.raises(SaveLockError, match=re.escape(f"pid {os.getpid()}")):
        SaveLock(str(tmp_path / "a")).acquire()
    lock.release()
    assert not (tmp_path / "a" / LOCK_FILENAME).exists()
    lock.release()                                            # idempotent

    # Another host's record: trusted (its flock may be invisible from here) unless forced.
    far = _write_record(tmp_path / "b", host="node-that-is-not-here", pid=12345)
    with pytest.raises(SaveLockError) as err:
        SaveLock(str(tmp_path / "b")).acquire()
    assert str(err.value) == (f"--save {tmp_path}/b is locked by another run ({describe(far)}; "
                              f"lock file {tmp_path}/b/{LOCK_FILENAME}): wait for that run to end "
                              f"or choose another --save; if it is certainly gone, pass "
                              f"--force-unlock.")
    forced = SaveLock(str(tmp_path / "b"), force=True)
    assert forced.acquire() == (f"> --force-unlock: taking over the lock "
                                f"{tmp_path}/b/{LOCK_FILENAME} of {describe(far)}.")
    forced.release()

    # No flock on this file system: a live pid of this host holds, a dead one is stale.
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_flock)
    live = _write_record(tmp_path / "c", pid=os.getppid())
    with pytest.raises(SaveLockError, match=re.escape(f"({describe(live)};")):
        SaveLock(str(tmp_path / "c")).acquire()
    _write_record(tmp_path / "c", pid=_dead_pid())
    taken = SaveLock(str(tmp_path / "c"))
    assert "that process is no longer running" in taken.acquire()
    taken.release()


def test_lock_never_follows_a_link(tmp_path):
    """Issue 34: `ln -s /outside/file <save>/.megatron_sp.lock` made a run truncate the outside
    file and write its lock record there. A link (or a hard link, a folder) at the lock's path is
    refused in one sentence; its target is untouched."""
    outside = tmp_path / "outside"
    outside.write_text("precious")
    save = tmp_path / "ck"
    save.mkdir()
    lock = save / LOCK_FILENAME
    empty = tmp_path / "empty"                               # the probe's: an empty outside file
    empty.write_bytes(b"")
    lock.symlink_to(empty)
    with pytest.raises(SaveLockError, match=re.escape(f"is a symbolic link (to {empty})")):
        SaveLock(str(save)).acquire()
    assert empty.read_bytes() == b""
    lock.unlink()
    lock.symlink_to(outside)
    with pytest.raises(SaveLockError) as err:
        SaveLock(str(save)).acquire()
    assert str(err.value) == (f"the lock file {lock} of --save {save} is a symbolic link (to "
                              f"{outside}), and the lock never writes into anything but a regular "
                              f"file of its own: remove the link (rm {lock}; its target is "
                              f"untouched) and run again.")
    assert outside.read_text() == "precious" and lock.is_symlink()
    lock.unlink()
    lock.symlink_to(tmp_path / "nowhere")                    # a dangling link: nothing created
    with pytest.raises(SaveLockError, match="is a symbolic link"):
        SaveLock(str(save)).acquire()
    assert not (tmp_path / "nowhere").exists()
    lock.unlink()
    os.link(outside, lock)                                   # a second name of the outside file
    with pytest.raises(SaveLockError, match=re.escape(f"is a hard link (one of 2 names of one "
                                                      f"file), and the lock never writes")):
        SaveLock(str(save)).acquire()
    assert outside.read_text() == "precious"
    lock.unlink()
    lock.mkdir()
    with pytest.raises(SaveLockError, match=re.escape(f"{lock} of --save {save} is a folder, ")):
        SaveLock(str(save)).acquire()
    lock.rmdir()

    # The probe itself: a run refuses before it trains, the outside file intact, the link kept.
    lock.symlink_to(outside)
    pretrain_gpt = load_script("pretrain_gpt.py")
    with pytest.raises(CheckpointError, match=re.escape(f"the lock file {lock} of --save {save} "
                                                        f"is a symbolic link")):
        pretrain_gpt.main(TINY + ["--train-iters", "1", "--save", str(save)])
    assert outside.read_text() == "precious" and lock.is_symlink()
    assert sorted(os.listdir(save)) == [LOCK_FILENAME]
    lock.unlink()

    # The save's temporary-then-rename writes (metadata, tracker) do not follow links either.
    import torch
    from megatron_sp import checkpointing as ck
    from megatron_sp.mesh import ParallelMesh
    (save / "latest_checkpointed_iteration.txt.tmp").symlink_to(outside)
    (save / "iter_0000001.tmp").symlink_to(tmp_path, target_is_directory=True)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(4, 4))])
    ck.save_checkpoint(str(save), 1, [model], ParallelMesh.single())
    assert outside.read_text() == "precious"
    assert sorted(os.listdir(tmp_path)) == ["ck", "empty", "outside"]
    assert ck.read_tracker(str(save)) == 1
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


@pytest.mark.parametrize("content, problem", [
    (b"", "it is empty"),
    (b"{}", "its record names no host and no pid"),
    (b"\x00garbage\xff", "its 9 bytes are not a lock record"),
    (b"[1, 2]", "its 6 bytes are not a lock record"),
    (json.dumps({"host": "HERE", "since": "x"}).encode(), "its record names no pid"),
    (json.dumps({"pid": "?", "host": "?"}).encode(), "its record names no pid"),
    (json.dumps({"pid": 12345}).encode(), "its record names no host"),
], ids=["empty", "{}", "garbage", "not an object", "no pid", "'?' pid", "no host"])
def test_lock_naming_no_holder_is_taken_over_with_a_note(tmp_path, monkeypatch, content, problem):
    """Issue 34: a garbage or `{}` lock file was refused as "locked by another run (host ?, pid ?)"
    and needed --force-unlock. A lock that names no holder has no run to wait for: taken over
    with one note (also where flock is unsupported); a live flock holder is still refused."""
    save = tmp_path / "ck"
    save.mkdir()
    path = save / LOCK_FILENAME
    content = content.replace(b"HERE", socket.gethostname().encode())
    path.write_bytes(content)
    lock = SaveLock(str(save))
    assert lock.acquire() == (f"> taking over the lock {path}: {problem}, so it names no run to "
                              f"wait for and no process holds it.")
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()

    # Held by a live run whose record is damaged: still refused (the flock says it is alive).
    holder = SaveLock(str(save))
    assert holder.acquire() is None                          # a fresh file: no note
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(content)
    wait = SaveLock._wait_for_record                         # (2 s for a record: 0.1 here)
    monkeypatch.setattr(SaveLock, "_wait_for_record", lambda self, fd: wait(self, fd, wait_s=0.1))
    with pytest.raises(SaveLockError, match=re.escape(f"--save {save} is locked by another run (")):
        SaveLock(str(save)).acquire()
    holder.release()

    # No flock on this file system: the record alone decides, and it names no one.
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_flock)
    path.write_bytes(content)
    taken = SaveLock(str(save))
    assert taken.acquire() == (f"> taking over the lock {path}: {problem}, so it names no run to "
                               f"wait for.")
    taken.release()
