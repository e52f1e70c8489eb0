"""Blockwise attention: one rank's whole sequence through the segment kernels, never an s x s
tensor (what SDPA runs for packed documents past MASK_TOKENS, and Mistral's window with them).

Packed documents are segments (attention/segments.py), not masks:

    no window       the full range against itself: each document's causal square (one
                    causal square without documents), in as few kernel calls as the kernel
                    allows (block_kernels: one varlen call on CUDA in fp16/bf16)
    sliding window  block pairs of `block` tokens, query block by query block:

        key block ->   0   1   2   3          D  diagonal: causal inside the block
        query 0        D   .   .   .          W  reaching past the window: its segments get
              1        W   D   .   .             a window mask of their size (<= block x block)
              2        .   W   D   .          .  skipped: above the diagonal, or wholly
              3        .   .   W   D             outside the window (window = block here)

                    and within each pair the segments its documents make.

Forward merges the segments' partial results in fp32 through their log-sum-exp; backward
recomputes each segment from the saved global out and lse (docs/design.md §14).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_sp.attention.block_kernels import backward_batch, forward_batch
from megatron_sp.attention.lse import heads_of
from megatron_sp.attention.segments import document_bounds, ranges_batches

DEFAULT_BLOCK = 512        # the window's block pairs when no block is given (tokens)


@dataclass(frozen=True)
class BlockPair:
    """Queries at positions q (a slice) against keys at positions k (a slice). causal: the
    diagonal block; window: Mistral's window, when some (query, key) of the pair falls outside it
    (query position i sees key position j only when i - j < window)."""
    q: slice
    k: slice
    causal: bool
    window: int | None = None


def blockwise_pairs(s: int, block: int, causal: bool,
                    window: int | None = None) -> list[BlockPair]:
    """The block pairs of a length-s sequence that attend anything, query block by query block:
    none above the causal diagonal, none wholly outside the window; a window mask where the
    pair's farthest distance reaches it."""
    slices = [slice(i, min(i + block, s)) for i in range(0, s, block)]
    pairs = []
    for i, qs in enumerate(slices):
        for j, ks in enumerate(slices):
            if causal and j > i:
                continue
            if window is not None and qs.start - (ks.stop - 1) >= window:
                continue                                                 # wholly out of window
            far = window is not None and (qs.stop - 1) - ks.start >= window
            pairs.append(BlockPair(qs, ks, causal and i == j, window if far else None))
    return pairs


def blockwise_plan(document_ids, s: int, block: int, causal: bool, window: int | None = None):
    """[(SegmentBatch, window or None)] of blockwise attention over a length-s sequence. It
    depends on the step's document_ids only, so a backend makes it once per step for every layer
    (its one host sync included) and passes it as blockwise_attention's `plan`."""
    bounds = document_bounds(document_ids)
    if window is None:
        return [(batch, None) for batch in ranges_batches(bounds, [(0, 0, s)], [(0, 0, s)],
                                                          causal)]
    plan = []
    for pair in blockwise_pairs(s, block, causal, window):
        q = [(pair.q.start, pair.q.start, pair.q.stop - pair.q.start)]
        k = [(pair.k.start, pair.k.start, pair.k.stop - pair.k.start)]
        plan += [(batch, pair.window) for batch in ranges_batches(bounds, q, k, causal)]
    return plan


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, plan):
        b, s, h, d = q.shape
        out = torch.zeros(b, s, h, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, s, h), float("-inf"), dtype=torch.float32, device=q.device)
        for batch, window in plan:
            forward_batch(q, k, v, batch, scale=scale, out=out, lse=lse, window=window)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for batch, window in ctx.plan:
            backward_batch(q, k, v, out, dout, lse, batch, scale=ctx.scale, dq=dq, dk=dk, dv=dv,
                           window=window)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def blockwise_attention(q, k, v, *, causal: bool, scale: float | None = None,
                        block: int | None = None, document_ids=None, window: int | None = None,
                        plan=None):
    """Attention over the whole sequence, segment by segment, merged in fp32.

    q [b, s, h, d], k, v [b, s, g, d] -> out [b, s, h, d] in q's dtype; backward recomputes each
    segment from the saved global out and lse. document_ids [b, s]: packed documents (tokens of
    different documents never attend each other): each document's causal square, nothing across.
    window: Mistral's sliding window (causal only): query i sees keys j with i - window < j <= i,
    through block pairs of `block` tokens (default min(s, DEFAULT_BLOCK)). plan: the
    blockwise_plan of these document_ids, shape, block, causal and window, when the caller has it.
    """
    heads_of(q, k, v)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"blockwise attention is self-attention: {q.shape[1]} queries, "
                         f"{k.shape[1]} keys.")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    block = min(q.shape[1], DEFAULT_BLOCK) if block is None else block
    if block < 1:
        raise ValueError(f"blockwise attention needs a block of at least one token, got {block}.")
    if window is not None and (not causal or window < 1):
        raise ValueError(f"a sliding window needs causal attention and at least one token, got "
                         f"window={window}, causal={causal}.")
    plan = plan or blockwise_plan(document_ids, q.shape[1], block, causal, window)
    return _BlockwiseAttention.apply(q, k, v, scale, plan)
