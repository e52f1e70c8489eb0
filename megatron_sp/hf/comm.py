"""The collectives of megatron_sp.hf beyond Ulysses' all-to-alls (megatron_sp/ulysses/comm.py).

    sum_over_groups(x, groups)       differentiable all-reduce sum; backward all-reduces the grad
    count_over_groups(x, groups)     all-reduce sum without autograd (token counts)
    gather_sequence(x, group)        all-gather [b, s/sp] along the sequence -> [b, s] (no autograd)
    gather_context(x, sp, cp)        all-gather a rank's [b, n] of the Ulysses x ring layout ->
                                     the full [b, s] in sequence order (no autograd)
    same_over_group(value, groups)   whether an int64 (a batch checksum) is equal on every rank of
                                     the groups (one group, or sp then cp: the whole context)

Why the backward of sum_over_groups is an all-reduce sum (not the identity): the loss
L = (sum_r S_r) / N is computed on every rank of the group, each rank seeds its own backward with
dL = 1, and every rank's local sum S_r feeds every rank's copy of L. The gradient that reaches S_r
is therefore the sum of the n seeds, n * (1/N): the autograd of the replicated value sum_r L_r.
Averaging the parameter gradients over the n ranks (DDP / FSDP2's default) then gives exactly
dL/dtheta (docs/design.md §15, megatron_sp/hf/loss.py).

A group that is None or of size 1 makes every function the identity without touching
torch.distributed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp.mesh import group_size


def _live(groups):
    return [g for g in groups if group_size(g) > 1]


def _all_reduce(x: torch.Tensor, groups) -> torch.Tensor:
    out = x.clone()
    for group in groups:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


class _SumOverGroups(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return _all_reduce(x, groups)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous(), ctx.groups), None


def sum_over_groups(x: torch.Tensor, groups) -> torch.Tensor:
    """All-reduce sum of x over each group in turn (e.g. sp, then dp); backward is the same
    all-reduce of the incoming gradient (see the module docstring)."""
    live = _live(groups)
    if not live:
        return x
    return _SumOverGroups.apply(x, tuple(live))


@torch.no_grad()
def count_over_groups(x: torch.Tensor, groups) -> torch.Tensor:
    """All-reduce sum of x over each group in turn, without autograd (a count of tokens)."""
    live = _live(groups)
    return _all_reduce(x, live) if live else x


@torch.no_grad()
def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s/sp] on every rank -> [b, s], the chunks in rank order (equal chunks, as gloo's
    all_gather needs). No autograd: for position ids."""
    sp = group_size(group)
    if sp == 1:
        return x
    x = x.contiguous()
    chunks = [torch.empty_like(x) for _ in range(sp)]
    dist.all_gather(chunks, x, group=group)
    return torch.cat(chunks, dim=1)                       # sp x [b, s/sp] -> [b, s]


@torch.no_grad()
def gather_layout_order(x: torch.Tensor, sp_group, cp_group) -> torch.Tensor:
    """A rank's [b, n] -> [b, s] on every rank in layout order: over sp (a ring rank's tokens),
    then over cp (ring rank 0's, then 1's, ...). No autograd: for position ids."""
    portion = gather_sequence(x, sp_group)                # [b, n] -> ring rank's [b, sp n]
    cp = group_size(cp_group)
    if cp == 1:
        return portion
    portions = [torch.empty_like(portion) for _ in range(cp)]
    dist.all_gather(portions, portion.contiguous(), group=cp_group)
    return torch.cat(portions, dim=1)                     # cp x [b, s/cp] -> [b, s]


@torch.no_grad()
def gather_context(x: torch.Tensor, sp_group, cp_group) -> torch.Tensor:
    """A rank's [b, n] of the Ulysses x ring zigzag layout (megatron_sp.hf.batch without
    documents: ring rank j owns zigzag chunks j and 2cp-1-j, cut contiguously over its sp ranks)
    -> the full [b, s] in sequence order, on every rank. No autograd: for position ids."""
    return zigzag_order(gather_layout_order(x, sp_group, cp_group), group_size(cp_group))


def zigzag_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """[b, s] in the zigzag layout's order (ring rank 0's chunks 0 and 2cp-1, then rank 1's, ...)
    -> [b, s] in sequence order."""
    from megatron_sp.context_parallel.zigzag import zigzag_merge
    if cp == 1:
        return gathered
    return zigzag_merge(list(gathered.chunk(cp, dim=1)), cp, dim=1)   # cp x [b, s/cp] -> [b, s]


@torch.no_grad()
def same_over_group(value: torch.Tensor, group) -> bool:
    """Whether the int64 scalar `value` is the same on every rank of `group` (or of a tuple of
    groups, e.g. (sp, cp): the whole context): an all-reduce (max) of [value, -value], 16 bytes,
    over each group in turn. Max over the rows, then over the columns, is the max over the grid,
    so every rank computes the answer from the same reduced pair and all of them agree on it
    (none goes on while another raises)."""
    live = _live(group if isinstance(group, (tuple, list)) else (group,))
    if not live:
        return True
    device = torch.device("cpu") if dist.get_backend(live[0]) == "gloo" else value.device
    v = value.reshape(()).to(device=device, dtype=torch.int64) & ((1 << 62) - 1)   # -v fits
    pair = torch.stack([v, -v])
    for g in live:
        dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=g)
    return bool(pair[0] == -pair[1])                 # max == min
