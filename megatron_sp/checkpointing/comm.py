"""The checkpoint code's few collectives (the exit-flag all-reduce, the checksums gathered at
save, the verdict agreed at load) and the world's rank and size (the barrier is mesh.barrier).

Every function is the identity / a no-op without an initialised process group, so one-process
tools (conversion, inference) use the same code.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """Whether a process group exists (else every function here is the one-process identity)."""
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def global_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def any_rank_flag(flags, group=None) -> list[bool]:
    """All-reduce (MAX) a few boolean flags over `group` (default: the world); one collective.

    Used once per iteration so that every rank agrees to save and exit when any rank received a
    signal or ran out of time. Returns the agreed flags.
    """
    t = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float32)
    if is_distributed():
        if dist.get_backend(group) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.cpu().tolist()]


def all_gather_object(obj) -> list:
    """`obj` of every rank of the world, in rank order ([obj] with one process)."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def agree_on_error(message: str | None) -> str | None:
    """The verdict of every rank on one step (collective): the first error message by rank order,
    the same on every rank, or None when no rank failed. Lets every rank stop with one sentence
    when any rank found a problem (a damaged file only it reads) instead of waiting in the next
    collective."""
    return next((m for m in all_gather_object(message) if m), None)
