"""The MoE layer's collectives (issue 37).

reduce_statistics: the router's load-balancing statistics (assignments per expert, summed router
probabilities, token counts; the z-loss sums) summed over the ranks that hold parts of the same
sequences, the context group (cp x sp), so that the losses are those of the whole sequence, as
Megatron reduces them. Forward one all-reduce (sum) of the concatenated statistics; backward the
identity: every rank computes the same loss from the same sums, so d(loss)/d(its own statistics)
is d(loss)/d(sum), and the data-parallel gradient reduction then adds each rank's share once.

gather_tokens / reduce_scatter_tokens: expert tensor parallelism (etp = tp, ep 1; Megatron's
tp-split experts under --sequence-parallel). Each tp rank routes its own T tokens; the rows the
experts need ([T, H] tokens, [T, k] routing weights and indices) are all-gathered over tp in rank
order ([tp*T, ...]), every rank computes its ffn shard of every expert for all of them, and the
partial outputs [tp*T, H] are reduce-scattered back to [T, H]. The autograd mappings of
megatron_sp/tensor_parallel/mappings.py (sequence dim 1 of a [1, tokens, ...] view): all-gather
forward / reduce-scatter backward (each rank's gradient of the gathered rows is partial, from its
ffn shard), and the reverse.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp import comm_stats
from megatron_sp.mesh import group_size
from megatron_sp.tensor_parallel import mappings

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


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """[T, ...] on each rank -> [p*T, ...] (rank-major) on every rank of `group`: all-gather
    forward, reduce-scatter backward; integer tensors (routing indices) gathered without autograd."""
    if group_size(group) == 1:
        return x
    if not x.is_floating_point():
        return mappings.gather_along_dim(x, 0, group)
    gathered = mappings.gather_from_sequence_parallel_region(x.unsqueeze(0), group)  # [1, p*T, ...]
    return gathered.squeeze(0)                                    # [1, p*T, ...] -> [p*T, ...]


def reduce_scatter_tokens(y: torch.Tensor, group) -> torch.Tensor:
    """Partial sums [p*T, H] -> this rank's rows [T, H], summed over `group`: reduce-scatter
    forward, all-gather backward."""
    if group_size(group) == 1:
        return y
    out = mappings.reduce_scatter_to_sequence_parallel_region(y.unsqueeze(0), group)  # [1, T, H]
    return out.squeeze(0)                                         # [1, T, H] -> [T, H]
