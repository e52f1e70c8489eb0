"""The MoE layer's collectives (docs/design.md §16).

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

exchange_counts / all_to_all_rows: expert parallelism's token dispatch (moe/dispatch.py, Megatron's
MoEAlltoAllTokenDispatcher): the int64 rows-per-expert counts, then the rows themselves, by
all_to_all_single over the ep group with uneven splits; a row exchange's backward is the same
exchange with the splits swapped. Counted (comm_stats, what this rank sends to OTHER ranks):
ROWS_KIND for the rows (H x element size per row), COUNTS_KIND for the int64 counts.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_sp import comm_stats
from megatron_sp.mesh import group_rank, group_size
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


# Expert parallelism's token dispatch -------------------------------------------------------------

ROWS_KIND = "moe/dispatch all_to_all"
COUNTS_KIND = "moe/dispatch counts all_to_all"


def _all_to_all_rows(x: torch.Tensor, group, input_splits: list[int], output_splits: list[int],
                     kind: str = ROWS_KIND):
    """x [sum(input_splits), ...] -> [sum(output_splits), ...]; counts the rows sent to other
    ranks under comm_stats `kind`."""
    me = group_rank(group)
    sent = sum(input_splits) - input_splits[me]
    comm_stats.record(kind, sent * math.prod(x.shape[1:]) * x.element_size())
    x = x.contiguous()
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=output_splits,
                           input_split_sizes=input_splits, group=group)
    return out


class _AllToAllRows(torch.autograd.Function):
    """Rows all-to-all forward; backward the reverse exchange (splits swapped)."""

    @staticmethod
    def forward(ctx, x, group, input_splits, output_splits, kind):
        ctx.group, ctx.input_splits, ctx.output_splits = group, input_splits, output_splits
        ctx.kind = kind
        return _all_to_all_rows(x, group, input_splits, output_splits, kind)

    @staticmethod
    def backward(ctx, grad):
        back = _all_to_all_rows(grad, ctx.group, ctx.output_splits, ctx.input_splits, ctx.kind)
        return back, None, None, None, None


def exchange_counts(tokens_per_expert: torch.Tensor, group) -> torch.Tensor:
    """tokens_per_expert [E] (this rank's rows per global expert) -> received [ep, E/ep] int64: row
    s = the rows source rank s sends to each of this rank's local experts."""
    ep = group_size(group)
    send = tokens_per_expert.to(torch.int64).reshape(ep, -1).contiguous()   # [E] -> [ep, E/ep]
    recv = torch.empty_like(send)
    me = group_rank(group)
    comm_stats.record(COUNTS_KIND, (ep - 1) * send[me].numel() * send.element_size())
    dist.all_to_all_single(recv, send, group=group)
    return recv


def all_to_all_rows(x: torch.Tensor, group, input_splits: list[int], output_splits: list[int],
                    kind: str = ROWS_KIND):
    """x [sum(input_splits), ...] -> [sum(output_splits), ...] over `group` (the ep group; the
    context group for TE's thd layout), input_splits[j] rows to rank j (autograd: the backward
    sends the gradients back with the splits swapped). Bytes counted under comm_stats `kind`."""
    return _AllToAllRows.apply(x, group, input_splits, output_splits, kind)
