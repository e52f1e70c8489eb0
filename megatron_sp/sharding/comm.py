"""Collectives of the distributed optimizer over the flattened dp x sp group (docs/design.md §11).

A bucket's buffer is rank-major, [n, segment]: segment r holds what rank r owns. Gradients are
reduce-scattered (summed: the loss is already normalised by the global token count), so rank r
receives the sum of every rank's segment r; updated parameters are all-gathered, so every rank
receives every segment. Both are identities on a group of one rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp import comm_stats
from megatron_sp.mesh import group_size


def reduce_scatter_sum(output: torch.Tensor, buffer: torch.Tensor, group):
    """output [segment] = sum over ranks of their buffer[my rank]; buffer [n, segment]. Async handle
    (None when there is nothing to wait for)."""
    if group_size(group) == 1:
        output.copy_(buffer[0])
        return None
    comm_stats.record("dp_sp/reduce_scatter", comm_stats.gather_bytes(
        output.numel(), output.element_size(), group_size(group)))
    flat = buffer.reshape(-1)                                          # [n, segment] -> [n * segment]
    return dist.reduce_scatter_single(output, flat, group=group, async_op=True)


def all_gather_segments(buffer: torch.Tensor, mine: torch.Tensor, group):
    """buffer [n, segment] <- every rank's `mine` [segment], in rank order. Async handle or None."""
    if group_size(group) == 1:
        buffer[0].copy_(mine)
        return None
    comm_stats.record("dp_sp/all_gather", comm_stats.gather_bytes(
        mine.numel(), mine.element_size(), group_size(group)))
    flat = buffer.reshape(-1)                           # [n, segment] -> [n * segment], same storage
    return dist.all_gather_single(flat, mine, group=group, async_op=True)


def all_reduce_views(tensors, group, kind: str) -> None:
    """Sum each tensor (views allowed) over `group`, in one flat all-reduce."""
    if group_size(group) == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])                 # [sum of numels]
    comm_stats.record(kind, comm_stats.all_reduce_bytes(flat.numel(), flat.element_size(),
                                                        group_size(group)))
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view(t.shape))         # [numel] -> tensor shape
        offset += t.numel()
