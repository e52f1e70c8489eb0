"""FlexAttention (torch.nn.attention.flex_attention) behind the attention-backend interface
(docs/design.md §5).

FlexAttention (Dong et al. 2024) computes softmax attention under a `mask_mod(b, h, q_idx, kv_idx)
-> bool` predicate. A BlockMask records, per (query block, key block) of BLOCK_SIZE tokens, whether
the pair is empty (skipped), full (no mask evaluated) or partial (mask_mod evaluated inside the
kernel): O(s^2 / BLOCK_SIZE^2) integers instead of an s x s mask, the same skip-full-partial plan as
the blockwise path (attention/lse.py). Masks here:

    causal           q_idx >= kv_idx
    document         doc[b, q_idx] == doc[b, kv_idx]     (doc: the document index of each token)
    sliding window   q_idx - kv_idx < window             (Mistral's window, with causal)

The block mask depends only on the step's document_ids (and the shapes), so it is built once per
step and shared by every layer: `_BlockMaskCache`, keyed on the document_ids tensor's identity,
version and shape, as base.DocumentCache keys cu_seqlens.

Kernels: on CUDA torch.compile(flex_attention) (a Triton kernel with its backward) and
torch.compile(create_block_mask) (no dense mask while building); on CPU (torch 2.13) flex_attention
runs eagerly, forward only: its backward raises NotImplementedError there, so training with flex on
CPU is refused in one sentence pointing at the blockwise path (--attention-backend sdpa / auto).
FlexAttention has no dropout: attention dropout with flex is refused.
"""
from __future__ import annotations

import functools
import math
import warnings

import torch

from megatron_sp.attention.base import AttentionBackend, check_shapes
from megatron_sp.attention.lse import document_index
from megatron_sp.errors import ConfigError

try:   # torch >= 2.5
    from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention
except ImportError:     # an older torch: the backend says so when it is built
    and_masks = create_block_mask = flex_attention = None

BLOCK_SIZE = 128            # FlexAttention's default block (tokens per query / key block)

CPU_TRAINING = ("--attention-backend flex cannot train on CPU: FlexAttention has no backward on "
                "CPU in torch " + torch.__version__.split("+")[0] + "; train with "
                "--attention-backend sdpa (or auto), whose blockwise path handles packed documents "
                "without an s x s mask.")
NO_DROPOUT = ("--attention-backend flex has no attention dropout (FlexAttention has none): pass "
              "--attention-dropout 0 or choose --attention-backend sdpa.")


def flex_available() -> bool:
    """torch ships FlexAttention (torch >= 2.5)."""
    return flex_attention is not None


# Mask predicates (mask_mod: (b, h, q_idx, kv_idx) -> bool, traced by FlexAttention) -------------

def causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document_mask_mod(doc_q: torch.Tensor, doc_k: torch.Tensor | None = None):
    """Same document: doc_q [b, sq], doc_k [b, sk] (default doc_q) document indices, comparable
    across the two (megatron_sp.attention.lse.document_index of the full row)."""
    doc_k = doc_q if doc_k is None else doc_k

    def same_document(b, h, q_idx, kv_idx):
        return doc_q[b, q_idx] == doc_k[b, kv_idx]
    return same_document


def sliding_window_mask_mod(window: int):
    """Mistral's sliding window: query i sees key j when i - j < window (causal added apart)."""
    def in_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < window
    return in_window


def mask_mod_for(causal: bool, doc=None, window: int | None = None):
    """The mask_mod of self-attention over one row: causal, same document (doc [b, s] document
    index), sliding window; None when nothing is masked."""
    mods = ([causal_mask_mod] if causal else []) + ([document_mask_mod(doc)] if doc is not None
                                                     else [])
    if window is not None:
        mods.append(sliding_window_mask_mod(window))
    return _combine(mods)


def _combine(mods):
    if not mods:
        return None
    return mods[0] if len(mods) == 1 else and_masks(*mods)


# Kernels ----------------------------------------------------------------------------------------

@functools.cache
def _compiled(fn):
    """torch.compile of a flex function, built once per process (CUDA: FlexAttention's Triton
    kernels; compiling is what makes flex fast and keeps create_block_mask from a dense mask)."""
    return torch.compile(fn, dynamic=False)


def build_block_mask(mask_mod, b: int | None, sq: int, sk: int, device,
                     block_size: int = BLOCK_SIZE):
    """create_block_mask over [b or 1, 1 (every head), sq, sk]: compiled on CUDA; eager on CPU
    (evaluates the mask densely: CPU flex is for tests and inference only)."""
    build = _compiled(create_block_mask) if torch.device(device).type == "cuda" \
        else create_block_mask
    return build(mask_mod, b, None, sq, sk, device=device, BLOCK_SIZE=block_size)


def _flex(q, k, v, block_mask, scale, return_lse):
    """flex_attention on [b, heads, s, d] (GQA through enable_gqa): compiled on CUDA, eager on
    CPU (where torch warns that eager flex is slow: expected for the CPU forward, so silenced)."""
    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda:
        return _compiled(flex_attention)(q, k, v, block_mask=block_mask, scale=scale,
                                         enable_gqa=gqa, return_lse=return_lse)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                              return_lse=return_lse)


# The backend ------------------------------------------------------------------------------------

class _BlockMaskCache:
    """The BlockMask of the last (document_ids, causal, window, s): every layer of a step passes
    the same document_ids tensor, so the mask is built once per step (`builds` counts them)."""

    def __init__(self):
        self._key = None
        self._ids = None          # the document_ids tensor of the cached mask (identity check)
        self._mask = None
        self.builds = 0

    def __call__(self, document_ids, b, s, causal, window, device):
        key = (None if document_ids is None else (document_ids._version,
                                                  tuple(document_ids.shape)),
               b, s, causal, window, str(device))
        if self._mask is not None and key == self._key and self._ids is document_ids:
            return self._mask
        doc = None if document_ids is None else document_index(document_ids)   # [b, s]
        mod = mask_mod_for(causal, doc, window)
        self._mask = None if mod is None else build_block_mask(
            mod, b if doc is not None else None, s, s, device)
        self._key, self._ids = key, document_ids
        self.builds += 1
        return self._mask


class FlexAttention(AttentionBackend):
    """--attention-backend flex: FlexAttention with causal, document and sliding-window block
    masks, the mask shared by every layer of a step. GQA via enable_gqa (no key/value copies).
    Forward everywhere; backward on CUDA only (torch's CPU flex has none)."""

    name = "flex"

    def __init__(self):
        super().__init__()
        if not flex_available():
            raise ConfigError(f"--attention-backend flex needs torch's FlexAttention (torch >= "
                              f"2.5), and this torch is {torch.__version__}: upgrade torch or "
                              f"choose --attention-backend sdpa.")
        self._masks = _BlockMaskCache()

    def forward(self, q, k, v, *, causal=True, softmax_scale=None, document_ids=None, dropout_p=0.0,
                window=None):
        check_shapes(q, k, v, document_ids)
        if dropout_p:
            raise ConfigError(NO_DROPOUT)
        if not q.is_cuda and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise ConfigError(CPU_TRAINING)
        b, s, _, d = q.shape
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        block_mask = self._masks(document_ids, b, s, causal, window, q.device)
        out = _flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),   # [b, n, s, d]
                    block_mask, scale, return_lse=False)
        return out.transpose(1, 2).contiguous()          # [b, h, s, d] -> [b, s, h, d]
