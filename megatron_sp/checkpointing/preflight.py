"""Start-up checks of the folders a run writes, before its first step (docs/checkpoints.md).

A run that cannot write its checkpoints used to train until its first save and end there. Here
every rank that writes checks, before training:
- --save (every rank writes its shards): creatable and writable, by writing and removing a probe
  file (a path under a regular file, a read-only mount, a folder without write permission);
- free space on --save's file system against the expected size of one checkpoint (the model's
  parameters and, unless --no-save-optim, the optimizer's moments, at their stored dtype):
  refused when it does not fit, unless --skip-free-space-check;
- rank 0 (the only writer of logs and index caches): --tensorboard-dir, --metrics-jsonl and
  --data-cache-path.

Each problem is one sentence; `startup_problems` returns them, the caller agrees on one across
the ranks (comm.agree_on_error) so that every rank stops with the same sentence.
"""
from __future__ import annotations

import errno
import os
import shutil
import socket

from megatron_sp.comm_stats import format_bytes

PROBE_PREFIX = ".megatron_sp-probe"


def _regular_file_above(path: str) -> str | None:
    """The first existing component of `path` that is not a folder (a regular file), or None."""
    current = os.path.abspath(path)
    chain = []
    while True:
        chain.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for p in reversed(chain):
        if os.path.exists(p) and not os.path.isdir(p):
            return p
    return None


def _os_problem(flag: str, path: str, err: OSError) -> str:
    """One sentence for an OSError met while creating or writing `path` (given as `flag`)."""
    blocker = _regular_file_above(path)
    if blocker is not None:
        return (f"{flag} {path} cannot be created: {blocker} is a regular file, not a folder; "
                f"choose another path.")
    if err.errno == errno.EROFS:
        return f"{flag} {path} is on a read-only file system; choose a writable folder."
    if err.errno in (errno.EACCES, errno.EPERM):
        return (f"{flag} {path} is not writable (permission denied); fix its permissions "
                f"(chmod u+w) or choose another folder.")
    if err.errno == errno.ENOSPC:
        return f"{flag} {path}: no space left on its file system; free space or choose another folder."
    return f"{flag} {path} is not writable ({err.strerror or err}); choose another folder."


def folder_problem(flag: str, path: str) -> str | None:
    """Create `path` if needed and write and remove a probe file in it; the problem or None."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f"{PROBE_PREFIX}-{socket.gethostname()}-{os.getpid()}")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return _os_problem(flag, path, err)
    return None


def file_problem(flag: str, path: str) -> str | None:
    """`path` (a file the run writes) can be created or appended to; the problem or None."""
    folder = os.path.dirname(os.path.abspath(path))
    problem = folder_problem(flag, folder)
    if problem is not None:
        return problem.replace(f"{flag} {folder}", f"{flag} {path}: its folder {folder}", 1)
    if os.path.isdir(path):
        return f"{flag} {path} is a folder; give a file name."
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return (f"{flag} {path} is not writable (permission denied); fix its permissions or "
                f"choose another file.")
    return None


def free_space_problem(path: str, needed: int, flag: str = "--save") -> str | None:
    """The sentence when `path`'s file system has less free space than `needed` bytes."""
    free = shutil.disk_usage(path).free
    if free >= needed:
        return None
    return (f"{flag} {path} has {format_bytes(free)} free but one checkpoint of this model needs "
            f"about {format_bytes(needed)}; free space, choose another --save, or pass "
            f"--skip-free-space-check to start anyway.")


def checkpoint_bytes(num_parameters: int, element_size: int, optimizer_moments: int) -> int:
    """About the bytes of one checkpoint: every parameter once (DCP writes replicated rectangles
    once), plus `optimizer_moments` tensors of the same size (Adam: 2, SGD with momentum: 1,
    --no-save-optim: 0)."""
    return int(num_parameters) * int(element_size) * (1 + int(optimizer_moments))


def startup_problems(rank: int, save: str | None, checkpoint_size: int | None,
                     skip_free_space: bool = False, tensorboard_dir: str | None = None,
                     metrics_jsonl: str | None = None,
                     data_cache_path: str | None = None) -> list[str]:
    """This rank's problems with the folders the run writes (empty when all is well)."""
    problems = []
    if save:
        problem = folder_problem("--save", save)
        if problem is None and checkpoint_size and not skip_free_space:
            problem = free_space_problem(save, checkpoint_size)
        problems += [problem] if problem else []
    if rank == 0:
        for flag, path, check in (("--tensorboard-dir", tensorboard_dir, folder_problem),
                                  ("--data-cache-path", data_cache_path, folder_problem),
                                  ("--metrics-jsonl", metrics_jsonl, file_problem)):
            problem = check(flag, path) if path else None
            problems += [problem] if problem else []
    return problems
