"""The MoE layer's collectives (issue 37).

reduce_statistics: the router's load-balancing statistics (assignments per expert, summed router
probabilities, token counts; the z-loss sums) summed over the ranks that hold parts of the same
sequences, the context group (cp x sp), so that the losses are those of the whole sequence, as
Megatron reduces them. Forward one all-reduce (sum) of the concatenated statistics; backward the
identity: every rank computes the same loss from the same sums, so d(loss)/d(its own statistics)
is d(loss)/d(sum), and the data-parallel gradient reduction then adds each rank's share once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp import comm_stats
from megatron_sp.mesh import group_size

COMM_KIND = "moe/statistics all_reduce"


class _SumStatistics(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward (module docstring)."""

    @staticmethod
    def forward(ctx, flat, group):
        out = flat.clone()
        comm_stats.record(COMM_KIND, comm_stats.all_reduce_bytes(out.numel(), out.element_size(),
                                                                 group_size(group)))
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def reduce_statistics(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Each tensor summed over `group` (None or one rank: unchanged), in one fp32 all-reduce."""
    if group_size(group) == 1:
        return list(tensors)
    shapes = [t.shape for t in tensors]
    flat = torch.cat([t.float().reshape(-1) for t in tensors])    # [sum of numels]
    out = _SumStatistics.apply(flat, group)
    parts = out.split([t.numel() for t in tensors])
    return [p.view(shape) for p, shape in zip(parts, shapes)]    # back to each tensor's shape
