"""Byte counters for collectives, per rank.

Every communication module calls `record(kind, nbytes)` for each collective it issues, with the
number of bytes this rank *sends* (the figure docs/design.md §4 uses). The training loop reads and resets
the counters once per logged step; benchmarks read them directly. Counting is plain Python on
host-side sizes, so it costs nothing on the device.
"""
from collections import defaultdict

import torch

_counters: dict[str, int] = defaultdict(int)
_calls: dict[str, int] = defaultdict(int)


def _count(kind: str, nbytes: int) -> None:
    """Add `nbytes` sent by this rank to the counter `kind` (e.g. "tp/all_reduce")."""
    _counters[kind] += int(nbytes)
    _calls[kind] += 1


record = _count   # callers look it up as comm_stats.record at each call (keep_out_of_graphs)


def keep_out_of_graphs() -> None:
    """Make `record` run eagerly under torch.compile (a host-side count, never traced: no guard
    on the counts). Called where compilation starts (compile.compile_layers, megatron_sp.hf whose
    users compile their own models), not at import: torch.compiler.disable imports torch._dynamo,
    about a second of start-up that a run without compilation never needs."""
    global record
    if record is _count:
        record = torch.compiler.disable(_count)


def snapshot() -> dict[str, int]:
    """Bytes per counter since the last reset."""
    return dict(_counters)


def calls() -> dict[str, int]:
    """Number of collectives per counter since the last reset."""
    return dict(_calls)


def reset() -> None:
    _counters.clear()
    _calls.clear()


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, one decimal; whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def all_reduce_bytes(numel: int, elem_size: int, group_size: int) -> int:
    """Bytes a rank sends in a ring all-reduce: 2*(p-1)/p of the buffer."""
    if group_size <= 1:
        return 0
    return 2 * (group_size - 1) * numel * elem_size // group_size


def gather_bytes(numel_local: int, elem_size: int, group_size: int) -> int:
    """Bytes a rank sends in a ring all-gather / reduce-scatter of its local part: (p-1) local parts."""
    if group_size <= 1:
        return 0
    return (group_size - 1) * numel_local * elem_size
