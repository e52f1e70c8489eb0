"""glibc malloc settings for training on CPU: keep freed memory for reuse.

A CPU training step allocates and frees the same large tensors every step (logits [b, s, V],
activations, gradients). Above glibc's mmap threshold each such allocation is a fresh mmap whose
pages fault in on first touch and are unmapped again when the tensor is freed; in a virtual machine
every fault can also be a host page fault. The step then spends a visible share of its time
zero-filling pages (tens of percent on 2 cores, measured with bench/train_step.py), and that share
varies from step to step.

`keep_freed_memory` raises the mmap threshold and the heap trim threshold (mallopt), so freed blocks
stay in the heap and the next step reuses them: what jemalloc / tcmalloc (LD_PRELOAD) give in
Intel's CPU tuning guides, without a preload. The process keeps its peak heap instead of returning
memory to the OS. No effect on GPU memory (CUDA has its caching allocator) and a no-op where the C
library is not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
_applied = False


def keep_freed_memory(threshold_bytes: int = 1 << 30) -> bool:
    """One heap for every thread (intra-op threads free what the main thread allocated), serving
    allocations up to threshold_bytes, never trimmed below 2x that; returns True where glibc took
    the three settings (applied once per process)."""
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = all([mallopt(M_ARENA_MAX, 1), mallopt(M_MMAP_THRESHOLD, threshold_bytes),
                    mallopt(M_TRIM_THRESHOLD, 2 * threshold_bytes)])
    return _applied
