"""Publishing a written file: the user's umask on its mode, then renamed into place (atomic); a
small text file written atomically (the checkpoint trackers and metadata); and whether a process
named in a leftover (a lock record, a temporary folder) still runs.

Writers that go through a private temporary file (safetensors writes mode 0600) would leave an
export readable only by its owner; `publish` gives it the mode a plain open() would have
(0o666 & ~umask) before renaming it to its final name.
"""
from __future__ import annotations

import contextlib
import os


def current_umask() -> int:
    """The process's umask (read by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temporary_name(path: str) -> str:
    """A temporary name beside `path` (same folder, so the rename is atomic)."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.tmp{os.getpid()}")


def publish(tmp: str, path: str) -> str:
    """chmod `tmp` to 0o666 & ~umask and rename it to `path`; returns `path`."""
    os.chmod(tmp, 0o666 & ~current_umask())
    os.replace(tmp, path)
    return path


def pid_running(pid) -> bool:
    """Whether process `pid` runs on this host; a process of another user (or an unreadable pid)
    counts as running, so nothing that may still be in use is taken over."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True
    return True


def write_text_atomic(path: str, text: str) -> None:
    """Write `path` through `path`.tmp and a rename. The temporary file is created afresh
    (O_EXCL | O_NOFOLLOW: a leftover or a symbolic link planted there is removed, never followed),
    and the rename replaces a link at `path` itself, not its target."""
    tmp = path + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str) -> None:
    """fsync a folder (its entries: a rename in it is durable); errors ignored (not every file
    system lets a folder be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
