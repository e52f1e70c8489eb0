"""The checkpoint code's few collectives (barrier, broadcast, the exit-flag all-reduce).

Every function is the identity / a no-op without an initialised process group, so one-process
tools (conversion, inference) use the same code.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _barrier():
    if _dist():
        dist.barrier()


def _broadcast_object(obj, src: int = 0):
    if not _dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def any_rank_flag(flags, group=None) -> list[bool]:
    """All-reduce (MAX) a few boolean flags over `group` (default: the world); one collective.

    Used once per iteration so that every rank agrees to save and exit when any rank received a
    signal or ran out of time. Returns the agreed flags.
    """
    t = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float32)
    if _dist():
        if dist.get_backend(group) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.cpu().tolist()]
