"""Tensor-parallel communication: every torch.distributed call of tensor_parallel lives here.

Megatron-LM's "mappings": autograd functions that move activations in and out of the
tensor-parallel region, each with a plain wrapper that takes the group explicitly.

    copy_to_tensor_parallel_region          fwd identity              bwd all-reduce
    reduce_from_tensor_parallel_region      fwd all-reduce            bwd identity
    scatter_to_tensor_parallel_region       fwd split last dim        bwd all-gather last dim
    gather_from_tensor_parallel_region      fwd all-gather last dim   bwd split last dim

and for Megatron's --sequence-parallel on our [b, s, H] activations (sequence in dim 1):

    scatter_to_sequence_parallel_region         fwd split dim 1        bwd all-gather dim 1
    gather_from_sequence_parallel_region        fwd all-gather dim 1   bwd reduce-scatter dim 1
    reduce_scatter_to_sequence_parallel_region  fwd reduce-scatter 1   bwd all-gather dim 1

A group that is None or has one rank makes every function the identity, with no
torch.distributed call at all. Every collective records the bytes this rank sends in
`megatron_sp.comm_stats` under "tp/all_reduce", "tp/all_gather" or "tp/reduce_scatter".
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp import comm_stats
from megatron_sp.mesh import group_rank, group_size
from megatron_sp.tensor_parallel.utils import check_divisible

# Newer torch renamed the flat-tensor collectives (the old names still work, with a warning).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


# Raw collectives (no autograd) ------------------------------------------------------------

def all_reduce_(tensor: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """All-reduce a contiguous tensor in place over `group` ("sum", "max" or "min"); returns it."""
    p = group_size(group)
    if p == 1:
        return tensor
    assert tensor.is_contiguous(), "all_reduce_ needs a contiguous tensor"
    comm_stats.record("tp/all_reduce",
                      comm_stats.all_reduce_bytes(tensor.numel(), tensor.element_size(), p))
    dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group)
    return tensor


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of `x` over the group, in a new buffer (the input may be saved by autograd)."""
    if group_size(group) == 1:
        return x
    return all_reduce_(x.clone(memory_format=torch.contiguous_format), group)


def split_along_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous 1/p slice of `x` along `dim` (no communication)."""
    p = group_size(group)
    if p == 1:
        return x
    check_divisible(x.size(dim), p, f"dimension {dim} of a tensor of shape {tuple(x.shape)}")
    # A copy, never a view: a view would keep the whole unsplit tensor alive for as long as the
    # slice is saved for backward (with micro-batch 1 every sequence chunk is contiguous).
    return x.chunk(p, dim=dim)[group_rank(group)].clone(memory_format=torch.contiguous_format)


def gather_along_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather `x` over the group and concatenate along `dim`, in rank order."""
    p = group_size(group)
    if p == 1:
        return x
    dim = dim % x.dim()
    front = x.movedim(dim, 0).contiguous()                  # [n, ...rest] with dim moved first
    out = front.new_empty((p * front.size(0),) + tuple(front.shape[1:]))  # [p*n, ...rest]
    comm_stats.record("tp/all_gather",
                      comm_stats.gather_bytes(front.numel(), front.element_size(), p))
    _all_gather_flat(out, front, group=group)
    return out.movedim(0, dim).contiguous()                 # [..., p*n at dim, ...]


def reduce_scatter_along_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's 1/p slice along `dim`.

    Uses the backend's reduce-scatter; where the backend lacks one (older gloo), falls back to an
    all-reduce followed by taking this rank's chunk. Either way the bytes are counted as the
    reduce-scatter sends them: (p-1) output-sized parts.
    """
    p = group_size(group)
    if p == 1:
        return x
    dim = dim % x.dim()
    check_divisible(x.size(dim), p, f"dimension {dim} of a tensor of shape {tuple(x.shape)}")
    front = x.movedim(dim, 0).contiguous()                  # [p*n, ...rest] with dim moved first
    out = front.new_empty((front.size(0) // p,) + tuple(front.shape[1:]))  # [n, ...rest]
    comm_stats.record("tp/reduce_scatter",
                      comm_stats.gather_bytes(out.numel(), out.element_size(), p))
    try:
        _reduce_scatter_flat(out, front, group=group)
    except (RuntimeError, NotImplementedError):
        if dist.get_backend(group) != "gloo":
            raise
        _reduce_scatter_via_all_reduce(out, front, group)
    return out.movedim(0, dim).contiguous()                 # [..., n at dim, ...]


def _reduce_scatter_via_all_reduce(out, front, group) -> None:
    """Fallback reduce-scatter along dim 0: all-reduce the whole buffer, copy this rank's chunk.

    Not counted again: the caller has already recorded the reduce-scatter's bytes.
    """
    summed = front.clone()                                  # [p*n, ...]; front may alias the input
    dist.all_reduce(summed, group=group)
    out.copy_(summed.chunk(group_size(group), dim=0)[group_rank(group)])


def all_reduce_grads(tensors, group) -> None:
    """Sum `tensors` (e.g. the grads of tp-replicated params under sequence parallel) over `group`
    in place, flattened into one buffer per dtype so that there is one all-reduce per dtype.
    None entries are skipped."""
    tensors = [t for t in tensors if t is not None]
    if group_size(group) == 1 or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])     # [sum of numel]
        all_reduce_(flat, group)
        for t, part in zip(same, flat.split([t.numel() for t in same])):
            t.copy_(part.view_as(t))                        # part [numel] -> t's shape


# Autograd functions ---------------------------------------------------------------------------

class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Column-parallel input: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)                                 # same shape, a new autograd node

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Row-parallel output: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Split the last dimension forward, all-gather it backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_dim(grad, -1, ctx.group), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather the last dimension forward, split it backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return split_along_dim(grad, -1, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Split the sequence (dim 1) forward, all-gather it backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along_dim(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_dim(grad, 1, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence (dim 1) forward. Backward: reduce-scatter when the gathered tensor
    feeds a tensor-parallel op (each rank then holds a partial gradient), else split."""

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return gather_along_dim(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter_along_dim(grad, 1, ctx.group), None, None
        return split_along_dim(grad, 1, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Row-parallel output under sequence parallel: reduce-scatter dim 1 forward, all-gather back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_along_dim(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_dim(grad, 1, ctx.group), None


# Wrappers -----------------------------------------------------------------------------------

def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter the tp region (column-parallel input): identity fwd, all-reduce bwd."""
    if group_size(group) == 1:
        return x
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave the tp region (row-parallel output): all-reduce fwd, identity bwd."""
    if group_size(group) == 1:
        return x
    return _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's slice of the last dim: split fwd, all-gather bwd."""
    if group_size(group) == 1:
        return x
    return _ScatterToTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate the ranks' slices of the last dim: all-gather fwd, split bwd."""
    if group_size(group) == 1:
        return x
    return _GatherFromTensorParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s, H] -> [b, s/p, H] (this rank's sequence chunk); all-gather bwd."""
    if group_size(group) == 1:
        return x
    return _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """[b, s/p, H] -> [b, s, H]: all-gather fwd; reduce-scatter bwd (split bwd when
    `tensor_parallel_output_grad` is False, i.e. the consumer is replicated over tp)."""
    if group_size(group) == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s, H] partial sums -> [b, s/p, H] summed: reduce-scatter fwd, all-gather bwd."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)
