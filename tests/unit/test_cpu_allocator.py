"""megatron_sp.memory.cpu_allocator: on glibc, large CPU tensors come from the heap (reused from step to
step) instead of fresh mmaps that page-fault on first touch."""
import ctypes
import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, sys, torch
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    from megatron_sp.memory.cpu_allocator import keep_freed_memory
    assert keep_freed_memory() and keep_freed_memory()       # applied, and idempotent
before = libc.mallinfo2().hblkhd
x = torch.ones(16 << 20)                                      # 64 MiB
print(libc.mallinfo2().hblkhd - before)                       # bytes newly mmapped
"""


def _has_mallinfo2():
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _has_mallinfo2(),
                    reason="needs glibc >= 2.33 (mallinfo2)")
def test_large_tensors_come_from_the_heap():
    """A 64 MiB tensor is mmapped by default and served from the heap once keep_freed_memory ran
    (mallinfo2's hblkhd: bytes in mmapped blocks)."""
    mapped = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        mapped[mode] = int(out.stdout.split()[-1])
    assert mapped["default"] >= 64 << 20, mapped
    assert mapped["keep"] == 0, mapped
