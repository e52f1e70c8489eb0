"""Tiled MLP and chunked loss: sequence tiles recomputed in backward, so that neither the MLP's
[s, ffn] intermediate nor the [s, vocab] logits ever exist whole.

Tiled MLP: the MLP is token-wise, so running it on sequence tiles (each a checkpoint: only the tile's
input, a view of the MLP input, is kept) gives the same function. Under tensor parallelism each tile
does its own collectives; with --sequence-parallel fc1 all-gathers tile t of every tp rank and fc2
reduce-scatters it back to the same tokens, which is correct because the MLP mixes no tokens.

Chunked loss: the final-norm output is copied into (or, with --sequence-parallel, all-gathered over)
the tp region once; then each sequence chunk runs output projection + vocab-parallel cross entropy as
one checkpoint, keeping only its input.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_sp.memory.options import resolve_count
from megatron_sp.memory.recompute import checkpoint
from megatron_sp.tensor_parallel import mappings, vocab_parallel_cross_entropy


def _split(t: torch.Tensor, n: int):
    size = -(-t.shape[1] // n)
    return t.split(size, dim=1)


def tiled_mlp(mlp_forward, x: torch.Tensor, tiles, ffn_width: int) -> torch.Tensor:
    """mlp_forward over sequence tiles of x [b, s_l, H]; `ffn_width` sizes tiles="auto"."""
    n = resolve_count(tiles, x.shape[1], ffn_width, x.shape[-1], tokens=x.shape[0] * x.shape[1])
    if n == 1:
        return mlp_forward(x)
    if not torch.is_grad_enabled():
        return torch.cat([mlp_forward(t) for t in _split(x, n)], dim=1)
    return torch.cat([checkpoint(mlp_forward, t) for t in _split(x, n)], dim=1)  # [b, s_l, H]


def _chunk_loss(x, labels, weight, group, vocab_size):
    logits = F.linear(x, weight)                              # [b, c, V/tp]
    return vocab_parallel_cross_entropy(logits, labels, group, vocab_size=vocab_size)


def chunked_output_loss(x, labels, weight, *, mesh, sequence_parallel: bool, vocab_size: int,
                        chunks) -> torch.Tensor:
    """Per-token loss [b, s/sp] of final-norm output x ([b, s/sp, H]; s/(sp*tp) with sequence
    parallel) against labels [b, s/sp], the logits built one sequence chunk at a time."""
    group = mesh.tp_group
    if sequence_parallel:
        x = mappings.gather_from_sequence_parallel_region(x, group)   # [b, s/sp, H]
    else:
        x = mappings.copy_to_tensor_parallel_region(x, group)
    n = resolve_count(chunks, x.shape[1], weight.shape[0], x.shape[-1],
                      tokens=x.shape[0] * x.shape[1])
    if n == 1:                          # ("auto" on a short sequence) nothing to recompute
        return _chunk_loss(x, labels, weight, group, vocab_size)
    pieces = zip(_split(x, n), _split(labels, n))
    if not torch.is_grad_enabled():
        return torch.cat([_chunk_loss(xc, lc, weight, group, vocab_size) for xc, lc in pieces], 1)
    return torch.cat([checkpoint(_chunk_loss, xc, lc, weight, group, vocab_size)
                      for xc, lc in pieces], dim=1)                  # [b, s/sp]
