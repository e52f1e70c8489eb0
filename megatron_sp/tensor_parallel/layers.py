"""Tensor-parallel layers (Megatron-LM's column/row parallel linear and vocab-parallel embedding).

Parameters are plain `nn.Parameter` shards. Each carries two attributes that make the layout
explicit, so that the layout-independent initialiser and the checkpointer can go between the full
tensor and this rank's shard without knowing the layer:

    tp_partition_dim  dimension split over tp, or None when the parameter is replicated over tp
    tp_chunks         the full tensor is cat(c_0, ..., c_{k-1}) along tp_partition_dim and each
                      c_j is split over tp separately (Megatron's layout for fused projections such
                      as SwiGLU's gate+up); 1 for an ordinary split

Replicated parameters whose gradient is partial under --sequence-parallel (the row-parallel bias)
also get `sequence_parallel = True`: sum their gradients over tp with `all_reduce_grads`.

Layers start from zeros: the model initialises every parameter from its full tensor and loads the
shard with `shard_of_full`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_sp.tensor_parallel import fp8 as fp8_ops, mappings
from megatron_sp.tensor_parallel.utils import check_divisible, divide


# Layout helpers ----------------------------------------------------------------------------------

def set_tp_attributes(param: torch.Tensor, partition_dim: int | None, chunks: int = 1,
                      sequence_parallel: bool = False) -> torch.Tensor:
    """Tag `param` with its tensor-parallel layout (see the module docstring)."""
    param.tp_partition_dim = partition_dim
    param.tp_chunks = chunks
    param.sequence_parallel = sequence_parallel
    return param


def full_shape(param: torch.Tensor, tp_size: int) -> torch.Size:
    """Shape of the full (unsharded) tensor of which `param` is one tp rank's shard."""
    dim = getattr(param, "tp_partition_dim", None)
    shape = list(param.shape)
    if dim is not None:
        shape[dim] *= tp_size
    return torch.Size(shape)


def shard_of_full(full_tensor: torch.Tensor, param: torch.Tensor, tp_rank: int,
                  tp_size: int) -> torch.Tensor:
    """This rank's shard of `full_tensor`, in `param`'s layout (honouring tp_chunks).

    Replicated parameters get the full tensor back. The result is contiguous; copy it into the
    parameter with `param.data.copy_(...)`.
    """
    expected = full_shape(param, tp_size)
    if tuple(full_tensor.shape) != tuple(expected):
        raise ValueError(f"full tensor of shape {tuple(full_tensor.shape)} does not match the full "
                         f"shape {tuple(expected)} of a parameter of local shape "
                         f"{tuple(param.shape)} at tp size {tp_size}.")
    dim = getattr(param, "tp_partition_dim", None)
    if dim is None:
        return full_tensor.contiguous()
    chunks = getattr(param, "tp_chunks", 1)
    check_divisible(full_tensor.size(dim), chunks * tp_size, f"dimension {dim} of the full tensor",
                    f"tp_chunks*tp = {chunks}*{tp_size}")
    parts = full_tensor.chunk(chunks, dim=dim)             # chunks x [n/chunks along dim]
    return torch.cat([c.chunk(tp_size, dim=dim)[tp_rank] for c in parts], dim=dim).contiguous()


def gather_full_like(tensor: torch.Tensor, param: torch.Tensor, group) -> torch.Tensor:
    """Full tensor of the shards `tensor` (same layout as `param`, e.g. its gradient) over tp."""
    dim = getattr(param, "tp_partition_dim", None)
    p = mappings.group_size(group)
    if dim is None or p == 1:
        return tensor.detach().clone()
    chunks = getattr(param, "tp_chunks", 1)
    gathered = mappings.gather_along_dim(tensor.detach(), dim, group)  # cat over ranks of shards
    pieces = gathered.chunk(p * chunks, dim=dim)           # index r*chunks + j: rank r, part j
    return torch.cat([pieces[r * chunks + j] for j in range(chunks) for r in range(p)], dim=dim)


def _new_param(shape, dtype, device, partition_dim, chunks=1, sequence_parallel=False):
    param = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
    return set_tp_attributes(param, partition_dim, chunks, sequence_parallel)


# Linear layers ---------------------------------------------------------------------------------

def _autocast_dtype(x: torch.Tensor):
    """The autocast dtype active for x's device, or None."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


class _SequenceParallelLinear(torch.autograd.Function):
    """y = all_gather(x) W^T + b that keeps only the sequence shard x [b, s/tp, in] for backward.

    Saving the gathered input [b, s, in] would undo --sequence-parallel's memory saving; instead the
    shard is saved and all-gathered again in backward, where the input gradient is reduce-scattered
    (Megatron-LM does the same). Under autocast the shard is cast before the gather (16-bit on the
    wire) and both matmuls run in the autocast dtype; gradients come back in the inputs' dtypes.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        dtype = _autocast_dtype(x)
        ctx.x_dtype, ctx.group, ctx.has_bias = x.dtype, group, bias is not None
        if dtype is not None:
            x, w = x.to(dtype), weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
        else:
            w, b = weight, bias
        ctx.save_for_backward(x, weight)
        ctx.dtype = dtype
        x_full = mappings.gather_along_dim(x, 1, group)         # [b, s/tp, in] -> [b, s, in]
        return F.linear(x_full, w, b)                           # [b, s, out/tp]

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        w = weight if ctx.dtype is None else weight.to(ctx.dtype)
        grad_y = grad_y.to(w.dtype)
        x_full = mappings.gather_along_dim(x, 1, ctx.group)     # gathered again: [b, s, in]
        grad_x_full = grad_y.matmul(w)                          # [b, s, in]
        grad_x = mappings.reduce_scatter_along_dim(grad_x_full, 1, ctx.group)  # [b, s/tp, in]
        grad_y2d = grad_y.reshape(-1, grad_y.size(-1))          # [b*s, out/tp]
        grad_w = grad_y2d.t().matmul(x_full.reshape(-1, x_full.size(-1)))     # [out/tp, in]
        grad_b = grad_y2d.sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad_x.to(ctx.x_dtype), grad_w.to(weight.dtype), grad_b, None


def sequence_parallel_linear(x, weight, bias, group):
    """Column-parallel linear of a sequence-sharded input [b, s/tp, in] -> [b, s, out/tp]."""
    return _SequenceParallelLinear.apply(x, weight, bias, group)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its output dimension (rows of the weight) over tp.

    weight [out/tp, in], bias [out/tp]. The input is copied into the tp region (identity forward,
    all-reduce of its gradient backward), or, with `sequence_parallel`, all-gathered over tp on the
    sequence dimension (dim 1 of [b, s/tp, in]; reduce-scattered backward). The output is this
    rank's columns [..., out/tp], or all of them [..., out] with `gather_output`.

    `chunks` > 1: the full weight is cat(c_0, ..., c_{chunks-1}) along dim 0 (e.g. SwiGLU's gate
    and up) and the local shard is cat(c_0.chunk(tp)[r], ...), so `output.chunk(chunks, -1)` gives
    each part's local slice. Returns the output tensor (bias already added).
    """

    def __init__(self, in_features: int, out_features: int, *, mesh, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, chunks: int = 1,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.tp_size = mesh.tp_group, mesh.tp_size
        self.gather_output, self.sequence_parallel, self.chunks = (
            gather_output, sequence_parallel, chunks)
        check_divisible(out_features, chunks * self.tp_size, "out_features of ColumnParallelLinear",
                        f"chunks*tp = {chunks}*{self.tp_size}")
        self.out_per_rank = out_features // self.tp_size
        self.weight = _new_param((self.out_per_rank, in_features), dtype, device, 0, chunks)
        self.bias = (_new_param((self.out_per_rank,), dtype, device, 0, chunks) if bias
                     else None)

    def reset_parameters(self) -> None:
        """Zeros: the model initialises every parameter from its full tensor."""
        with torch.no_grad():
            for p in self.parameters():
                p.zero_()

    fp8 = None
    """A megatron_sp.tensor_parallel.fp8.Fp8Plan: the matmuls in FP8 (None: high precision)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:     # the input all-gathered inside under sequence_parallel
            if not self.sequence_parallel:
                x = mappings.copy_to_tensor_parallel_region(x, self.group)
            y = fp8_ops.fp8_linear(x, self.weight, self.bias, self.fp8)     # [..., out/tp]
        elif self.sequence_parallel:  # all-gather [b, s/tp, in] -> [b, s, in], shard kept for backward
            y = sequence_parallel_linear(x, self.weight, self.bias, self.group)  # [b, s, out/tp]
        else:
            x = mappings.copy_to_tensor_parallel_region(x, self.group)
            y = F.linear(x, self.weight, self.bias)        # [..., out/tp]
        if self.gather_output:
            y = mappings.gather_from_tensor_parallel_region(y, self.group)  # [..., out]
            if self.chunks > 1:  # [..., (rank, part, n)] -> [..., (part, rank, n)]
                y = _regroup_chunks(y, self.tp_size, self.chunks)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.out_per_rank}), "
                f"tp={self.tp_size}, chunks={self.chunks}, bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


def _regroup_chunks(y: torch.Tensor, tp_size: int, chunks: int) -> torch.Tensor:
    """Reorder a gathered last dim from rank-major (rank, part, n) to the full layout (part, rank, n)."""
    n = y.size(-1) // (tp_size * chunks)
    y = y.unflatten(-1, (tp_size, chunks, n))              # [..., tp, chunks, n]
    return y.transpose(-3, -2).flatten(-3)                 # [..., chunks, tp, n] -> [..., out]


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its input dimension (columns of the weight) over tp.

    weight [out, in/tp], bias [out] (replicated over tp, added after the reduction). The input is
    this rank's [..., in/tp] (`input_is_parallel`) or the full [..., in], split here. The partial
    products are all-reduced over tp, or, with `sequence_parallel`, reduce-scattered on the sequence
    dimension to [b, s/tp, out]. Returns the output tensor (bias added).
    """

    def __init__(self, in_features: int, out_features: int, *, mesh, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear with sequence_parallel=True needs "
                             "input_is_parallel=True (its input comes from a column-parallel layer).")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.tp_size = mesh.tp_group, mesh.tp_size
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.in_per_rank = divide(in_features, self.tp_size, "in_features of RowParallelLinear",
                                  "the tensor-parallel size")
        self.weight = _new_param((out_features, self.in_per_rank), dtype, device, 1)
        self.bias = (_new_param((out_features,), dtype, device, None,
                                sequence_parallel=sequence_parallel) if bias else None)

    reset_parameters = ColumnParallelLinear.reset_parameters
    fp8 = None
    """A megatron_sp.tensor_parallel.fp8.Fp8Plan: the matmul in FP8 (None: high precision)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = mappings.scatter_to_tensor_parallel_region(x, self.group)  # [..., in/tp]
        if self.fp8 is not None:
            return self.reduce_partial(fp8_ops.fp8_linear(x, self.weight, None, self.fp8))
        return self.reduce_partial(F.linear(x, self.weight))   # [..., out]

    def reduce_partial(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial product y [..., out] (its input columns times theirs of the
        weight; also a sum of such products over column blocks, as SelfAttention's head chunks
        make it) -> the layer's output: summed over tp (all-reduce, or reduce-scattered on the
        sequence dimension to [b, s/tp, out] with sequence_parallel), + bias."""
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_parallel_region(y, self.group)  # [b, s/tp, out]
        else:
            y = mappings.reduce_from_tensor_parallel_region(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.in_per_rank}), out={self.out_features}, "
                f"tp={self.tp_size}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}")


# Embedding -------------------------------------------------------------------------------------

class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary (rows) split over tp: weight [V/tp, D].

    Each rank looks up the ids in its range [r*V/tp, (r+1)*V/tp), zeroes the others, and the
    partial embeddings are all-reduced over tp, or, with `sequence_parallel` (constructor or
    forward argument), reduce-scattered on dim 1 of [b, s, D] to [b, s/tp, D].
    `num_embeddings` is the padded vocabulary and must be divisible by tp.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, mesh,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.tp_size = mesh.tp_group, mesh.tp_size
        self.sequence_parallel = sequence_parallel
        self.rows_per_rank = divide(num_embeddings, self.tp_size,
                                    "num_embeddings (padded vocabulary) of VocabParallelEmbedding",
                                    "the tensor-parallel size")
        self.vocab_start = mesh.tp_rank * self.rows_per_rank
        self.vocab_end = self.vocab_start + self.rows_per_rank
        self.weight = _new_param((self.rows_per_rank, embedding_dim), dtype, device, 0)

    reset_parameters = ColumnParallelLinear.reset_parameters

    def forward(self, input_ids: torch.Tensor, sequence_parallel: bool | None = None) -> torch.Tensor:
        sequence_parallel = self.sequence_parallel if sequence_parallel is None else sequence_parallel
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)     # [b, s, D]
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight)          # [b, s, D], partial over tp
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # mask [b, s] -> [b, s, 1]
        if sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(out, self.group)  # [b, s/tp, D]
        return mappings.reduce_from_tensor_parallel_region(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (local {self.rows_per_rank}), {self.embedding_dim}, "
                f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}")
