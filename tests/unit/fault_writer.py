"""A fault-injecting writer for checkpoint tests: DCP's file streams whose path contains a marker
fail with an OSError (ENOSPC by default: a full disk) after a few bytes, or sleep in their first
write (a slow disk, to interrupt a save). Used in-process (`install`) and as a wrapper script that
runs pretrain_gpt.py with the fault installed (directly or as torchrun's script):

    FAULT_WRITE_MATCH=iter_0000004 python tests/unit/fault_writer.py <pretrain_gpt flags>

FAULT_WRITE_MATCH: the path marker; FAULT_WRITE_ERRNO: the errno's name (ENOSPC); FAULT_WRITE_AFTER:
bytes written before the failure (64); FAULT_WRITE_SLEEP_S: instead of failing, print
"[fault writer] slow write <path>" and sleep so long in the first write.
"""
from __future__ import annotations

import contextlib
import errno
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _FailingStream:
    """A binary stream that accepts `after` bytes, then raises OSError(code) on every write."""

    def __init__(self, stream, code: int, after: int, sleep_s: float, path: str):
        self._stream, self._code, self._left = stream, code, after
        self._sleep_s, self._path = sleep_s, path

    def write(self, data) -> int:
        if self._sleep_s:
            print(f"[fault writer] slow write {self._path}", file=sys.stderr, flush=True)
            time.sleep(self._sleep_s)
            self._sleep_s = 0.0
            return self._stream.write(data)
        n = len(memoryview(data).cast("B"))
        if n > self._left:
            self._stream.write(bytes(memoryview(data).cast("B")[:self._left]))
            self._left = 0
            raise OSError(self._code, os.strerror(self._code))
        self._left -= n
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def install(match: str, code: int = errno.ENOSPC, after: int = 64, sleep_s: float = 0.0):
    """Patch DCP's FileSystem.create_stream; returns a function that undoes the patch."""
    from torch.distributed.checkpoint import filesystem
    original = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with original(self, path, mode) as stream:
            if match in str(path) and "w" in mode:
                yield _FailingStream(stream, code, after, sleep_s, str(path))
            else:
                yield stream

    filesystem.FileSystem.create_stream = create_stream
    return lambda: setattr(filesystem.FileSystem, "create_stream", original)


if __name__ == "__main__":
    import runpy
    install(os.environ["FAULT_WRITE_MATCH"], getattr(errno, os.environ.get("FAULT_WRITE_ERRNO",
                                                                            "ENOSPC")),
            int(os.environ.get("FAULT_WRITE_AFTER", "64")),
            float(os.environ.get("FAULT_WRITE_SLEEP_S", "0")))
    sys.path.insert(0, ROOT)
    sys.argv = [os.path.join(ROOT, "pretrain_gpt.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
