"""FP8 scaling communication: the amax reductions of megatron_sp.tensor_parallel.fp8.

A scale is fp8_max / amax. For the scales of a sharded tensor to be those one rank would compute on
the whole tensor, each rank's amax is reduced with MAX over the ranks that hold the other pieces
(docs/design.md §17): the tp group for a dimension split over tp, the dp x cp x sp group for the
tokens of a micro-batch split over data, context and Ulysses ranks. Every call records the bytes
this rank sends under "fp8/amax" in `megatron_sp.comm_stats`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp import comm_stats
from megatron_sp.mesh import group_size


def max_over_groups_(amax: torch.Tensor, groups) -> torch.Tensor:
    """amax (contiguous, fp32) <- its elementwise max over each group of `groups` in turn, in place.

    None and one-rank groups are skipped (no torch.distributed call). Every rank of each group must
    call this at the same point with an amax of the same shape. Returns `amax`.
    """
    for group in groups:
        p = group_size(group)
        if p == 1:
            continue
        comm_stats.record("fp8/amax",
                          comm_stats.all_reduce_bytes(amax.numel(), amax.element_size(), p))
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax
