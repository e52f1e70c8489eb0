"""One run per save folder: an exclusive advisory lock on --save, and the refusal of a fresh run
into a folder that holds another run's checkpoints.

The lock is the file <save>/.megatron_sp.lock, taken by rank 0 before the first step and removed
at exit. Rank 0 holds an exclusive `fcntl.flock` on it for the whole run (the kernel drops it when
the process dies, even by SIGKILL) and writes the holder's record into it: host, pid, job id
(SLURM_JOB_ID or TORCHELASTIC_RUN_ID) and start time. A second run finds the flock taken and is
refused with the record. A lock file left behind by a process that died is recognised as stale
and taken over with one note when its record names this host and the flock is free (or, on a file
system without flock, when its pid is not running). A record of another host is trusted (its flock
may not be visible from here, e.g. Lustre without -o flock) unless the operator passes
--force-unlock. A file that names no holder (empty, not a JSON record, no host or pid: a run
killed while writing it, or a hand-made file) has no one to wait for: taken over with one note
when its flock is free. The lock file is opened with O_NOFOLLOW and must be a regular file with
one name: a symbolic link (or a hard link, a folder, a pipe) there is refused, never written
through.

A fresh run (no --load, or --load another folder) into a --save that already holds complete
checkpoints would mix two runs' iterations under one tracker: it is refused unless
--overwrite-save says so; `--load <save>` resumes the run there (Megatron's way to continue).

A conversion (tools/checkpoint/convert.py) takes the same lock on its --save-dir while it writes,
and never writes into a folder that holds a training run's checkpoints (iter_* folders, or a
tracker naming an iteration): a converted checkpoint rewrites the tracker to 'release', and the
run's next resume would load the converted weights and save over its own iterations.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import re
import socket
import stat
import time

from megatron_sp.checkpointing.format import TRACKER_FILENAME, CheckpointError
from megatron_sp.fileutil import pid_running

LOCK_FILENAME = ".megatron_sp.lock"


class SaveLockError(CheckpointError):
    """--save is in use by another run (or holds another run's checkpoints)."""


def job_id(environ=os.environ) -> str | None:
    """The launcher's job id: SLURM_JOB_ID, else TORCHELASTIC_RUN_ID (torchrun), else None."""
    run = environ.get("TORCHELASTIC_RUN_ID")
    return environ.get("SLURM_JOB_ID") or (run if run and run != "none" else None)


def holder_record(environ=os.environ) -> dict:
    """This process as a lock holder: host, pid, job id, start time."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(environ),
            "since": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")}


def describe(record: dict | None) -> str:
    """'host H, pid P, job J, since T' of a lock record (what is known of it)."""
    if not record:
        return "a process that has not written its record yet"
    parts = [f"host {record.get('host', '?')}", f"pid {record.get('pid', '?')}"]
    if record.get("job"):
        parts.append(f"job {record['job']}")
    parts.append(f"since {record.get('since', '?')}")
    return ", ".join(parts)


def _read_record(fd: int) -> tuple[dict | None, str | None]:
    """(the lock record, None), or (what could be read, why it names no holder): the file is empty,
    not a JSON object, or its record lacks a host or a pid (a record of ours always has both)."""
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    if not raw.strip():
        return None, "it is empty"
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None, f"its {len(raw)} bytes are not a lock record"
    if not isinstance(record, dict):
        return None, f"its {len(raw)} bytes are not a lock record"
    host, pid = record.get("host"), record.get("pid")
    missing = [name for name, ok in (("host", isinstance(host, str) and host),
                                     ("pid", isinstance(pid, int) and not isinstance(pid, bool)
                                      and pid > 0)) if not ok]
    if missing:
        return record, f"its record names no {' and no '.join(missing)}"
    return record, None


def _kind(mode: int) -> str:
    """'a folder', 'a named pipe', ... of an lstat mode that is not a regular file."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


class SaveLock:
    """The exclusive lock of a save folder (see the module docstring). Rank 0 only:

        lock = SaveLock(save, force=job.checkpoint.force_unlock)
        note = lock.acquire()     # SaveLockError naming the holder; a note when it took over
        ...
        lock.release()            # at exit (normal, error, signal); idempotent
    """

    def __init__(self, folder: str, force: bool = False, flag: str = "--save"):
        self.folder, self.force, self.flag = folder, force, flag
        self.path = os.path.join(folder, LOCK_FILENAME)
        self.fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; returns a one-line note when a stale or forced lock was taken over."""
        os.makedirs(self.folder, exist_ok=True)
        for _ in range(5):     # the holder may remove the file between our open and our flock
            opened = self._open()
            if opened is None:
                continue
            fd, created = opened
            try:
                note = self._lock(fd, created)
            except BaseException:
                os.close(fd)
                raise
            if self._same_file(fd):
                self.fd = fd
                self._write_record()
                return note
            os.close(fd)       # we locked a file that was unlinked meanwhile: again
        raise SaveLockError(f"cannot take the lock {self.path}: it keeps being replaced; is "
                            f"another run starting into {self.flag} {self.folder}?")

    def _open(self) -> tuple[int, bool] | None:
        """(fd, created) of the lock file, never through a symbolic link (O_NOFOLLOW, O_EXCL);
        None when it vanished between two tries. SaveLockError for a link, or anything that is not
        a regular file with one name (its record would be written into someone else's file)."""
        nofollow = getattr(os, "O_NOFOLLOW", 0)
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | nofollow, 0o644), True
        except FileExistsError:
            pass
        try:
            fd = os.open(self.path, os.O_RDWR | nofollow | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            return None
        except OSError as err:
            if os.path.islink(self.path):            # ELOOP (EMLINK on some BSDs)
                raise SaveLockError(self._not_a_file(
                    f"a symbolic link (to {os.readlink(self.path)})")) from None
            if err.errno in (errno.EISDIR, errno.ENXIO, errno.EOPNOTSUPP):
                raise SaveLockError(self._not_a_file(_kind(os.lstat(self.path).st_mode))) \
                    from None
            raise
        info = os.fstat(fd)
        if info.st_nlink == 0 and stat.S_ISREG(info.st_mode):   # released meanwhile: again
            os.close(fd)
            return None
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            raise SaveLockError(self._not_a_file(
                _kind(info.st_mode) if not stat.S_ISREG(info.st_mode)
                else f"a hard link (one of {info.st_nlink} names of one file)"))
        if nofollow == 0 and os.path.islink(self.path):   # (no O_NOFOLLOW on this platform)
            os.close(fd)
            raise SaveLockError(self._not_a_file("a symbolic link"))
        return fd, False

    def _not_a_file(self, what: str) -> str:
        remove = (f"remove the link (rm {self.path}; its target is untouched)"
                  if what.startswith("a symbolic link") else f"remove {self.path}")
        return (f"the lock file {self.path} of {self.flag} {self.folder} is {what}, and the lock "
                f"never writes into anything but a regular file of its own: {remove} and run again.")

    def _same_file(self, fd: int) -> bool:
        try:
            return os.fstat(fd).st_ino == os.lstat(self.path).st_ino
        except FileNotFoundError:
            return False

    def _lock(self, fd: int, created: bool = False) -> str | None:
        """flock `fd` (or judge the record where flock is unsupported); the takeover note.
        `created`: this process has just created the (empty) file."""
        import fcntl
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flocked = True
        except BlockingIOError:
            record = self._wait_for_record(fd)
            if not self.force:
                raise SaveLockError(self._refusal(record)) from None
            return (f"> --force-unlock: taking over the lock {self.path} held by "
                    f"{describe(record)}; that run must not save any more.")
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            flocked = False   # no flock on this file system: the record alone decides
        record, problem = _read_record(fd)
        if problem is not None:   # no holder named: nothing to wait for (a crash while writing)
            if created and problem == "it is empty":
                return None       # the file we have just created
            return (f"> taking over the lock {self.path}: {problem}, so it names no run to wait "
                    f"for{' and no process holds it' if flocked else ''}.")
        if record.get("host") == socket.gethostname() and record.get("pid") == os.getpid():
            return None
        if record.get("host") != socket.gethostname():
            if not self.force:
                raise SaveLockError(self._refusal(record, other_host=True))
            return (f"> --force-unlock: taking over the lock {self.path} of {describe(record)}.")
        if not flocked and pid_running(record.get("pid")):
            if not self.force:
                raise SaveLockError(self._refusal(record))
            return (f"> --force-unlock: taking over the lock {self.path} of {describe(record)}; "
                    f"that run must not save any more.")
        return (f"> taking over the stale lock {self.path} of {describe(record)}: that process "
                f"is no longer running.")

    def _wait_for_record(self, fd: int, wait_s: float = 2.0) -> dict | None:
        """The holder's record; a holder that has just flocked writes it within moments."""
        deadline = time.monotonic() + wait_s
        while True:
            record, problem = _read_record(fd)
            if problem is None:
                return record
            if time.monotonic() > deadline:   # a holder whose record is damaged
                return None if problem == "it is empty" else \
                    {"host": (record or {}).get("host") or "?", "pid": (record or {}).get("pid")
                     or "?", "since": f"? ({problem})"}
            time.sleep(0.05)

    def _refusal(self, record: dict | None, other_host: bool = False) -> str:
        what = (f"{self.flag} {self.folder} is locked by another run ({describe(record)}; lock "
                f"file {self.path})")
        if other_host:
            return (what + f": wait for that run to end or choose another {self.flag}; if it is "
                           "certainly gone, pass --force-unlock.")
        return what + f": wait for that run to end or choose another {self.flag}."

    def _write_record(self) -> None:
        data = json.dumps(holder_record()).encode()
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        os.write(self.fd, data)
        os.fsync(self.fd)

    def release(self) -> None:
        """Remove the lock file (still holding the flock, so no one takes the dying inode)."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            if self._same_file(fd):
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)


_held: list[SaveLock] = []     # the locks this process took (release_save_locks frees them)


def track(lock: SaveLock) -> SaveLock:
    """Register a taken lock for `release_save_locks` (an error or Ctrl-C skips finish())."""
    _held.append(lock)
    return lock


def release_save_locks(main):
    """Decorator of an entry point (pretrain_gpt.main): every lock taken during the call is
    released when it returns or raises (a run that stops with an error, Ctrl-C, or a test that
    calls main() again in the same process). A killed process leaves the lock file behind; the next
    run on this host takes it over as stale (its flock died with the process)."""
    import functools

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        finally:
            while _held:
                _held.pop().release()
    return wrapper


def fresh_run_problem(save: str | None, load: str | None, overwrite: bool) -> str | None:
    """The sentence refusing a run that does not resume --save although --save holds
    checkpoints (another run's), or None. `overwrite`: --overwrite-save."""
    from megatron_sp.checkpointing.io import complete_iterations
    if not save or overwrite or not os.path.isdir(save):
        return None
    if load and os.path.realpath(load) == os.path.realpath(save):
        return None
    have = complete_iterations(save)              # the tracker alone also counts as checkpoints
    if not have and not os.path.isfile(os.path.join(save, TRACKER_FILENAME)):
        return None
    newest = f"iteration {have[-1]}" if have else TRACKER_FILENAME
    loading = f"--load {load} is another folder" if load else "there is no --load"
    return (f"--save {save} already holds checkpoints of another run (newest: {newest}) and "
            f"{loading}: pass --load {save} to resume that run (Megatron's way), choose an "
            f"empty --save, or pass --overwrite-save to save a new run over them.")


def run_folder_problem(folder: str, flag: str = "--save-dir") -> str | None:
    """The sentence refusing a conversion into `folder` when it holds a training run's
    checkpoints (a complete or partial iter_* folder, or a tracker naming anything but 'release'),
    or None (absent, empty, another conversion's 'release' checkpoint, an export)."""
    if not os.path.isdir(folder):
        return None
    iterations = sorted(name for name in os.listdir(folder)
                        if re.fullmatch(r"iter_\d+(\.tmp|\.old)?", name))
    tracker = os.path.join(folder, TRACKER_FILENAME)
    named = None
    if os.path.isfile(tracker):
        with open(tracker, "rb") as f:
            named = f.read().decode("utf-8", "replace").strip()
    if not iterations and named in (None, "release"):
        return None
    newest = (f"tracker {TRACKER_FILENAME} names iteration {named}" if named not in
              (None, "release") else f"it holds {iterations[-1]}")
    return (f"{flag} {folder} holds a training run's checkpoints ({newest}) and a conversion "
            f"never writes into a run's folder (the run's next resume would load the converted "
            f"weights and save over its own iterations): choose a new or empty {flag}, e.g. "
            f"{os.path.normpath(folder)}-converted.")


@contextlib.contextmanager
def conversion_target(folder: str, flag: str = "--save-dir"):
    """Hold the lock of a conversion's output folder while it is written: refused (SaveLockError)
    while a training run (or another conversion) holds it, or when it holds a run's checkpoints
    (`run_folder_problem`, checked again once the lock is ours)."""
    problem = run_folder_problem(folder, flag)
    if problem:
        raise SaveLockError(problem)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise SaveLockError(f"{flag} {folder} is a file, not a folder: choose a folder (new or "
                            f"empty) for the output.")
    lock = SaveLock(folder, flag=flag)
    try:
        note = lock.acquire()
    except OSError as err:     # no permission, a read-only or missing parent, a full disk
        raise SaveLockError(f"cannot write into {flag} {folder} ({err.strerror or err}): choose "
                            f"a folder you can write to.") from None
    try:
        if note:
            print(note, flush=True)
        problem = run_folder_problem(folder, flag)
        if problem:
            raise SaveLockError(problem)
        yield lock
    finally:
        lock.release()
