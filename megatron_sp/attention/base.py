"""The attention-backend interface (docs/design.md §5): the base class every backend derives from,
the shape check each runs first, the per-step cache of what packed documents make, and the names
and limits the backends, the kernels' description and FlexAttention share. Imports no backend:
backends.py (the registry, get_attention_backend) and flex.py build on it.

    backend(q, k, v, *, causal=True, softmax_scale=None, document_ids=None, dropout_p=0.0) -> out

q [b, s, h, d], k/v [b, s, g, d] with h % g == 0, out [b, s, h, d] (backends.py's docstring).
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_sp.attention.documents import cu_seqlens_from_document_ids

BACKEND_NAMES = ("auto", "te", "flash", "sdpa", "unfused", "flex")
MASK_TOKENS = 4096   # packed documents with dropout: an s x s mask up to this length; flex beyond


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids):
    """ValueError in one sentence unless q is [b, s, h, d] and k, v [b, s, g, d] with h % g == 0
    (and document_ids [b, s])."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"attention expects q [b, s, h, d] and k, v [b, s, g, d]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}.")
    (b, s, h, d), g = q.shape, k.shape[2]
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} differ in batch, sequence "
                         f"or head size.")
    if h % g != 0:
        raise ValueError(f"{h} query heads are not a multiple of {g} key/value heads (GQA needs "
                         f"h % g == 0).")
    if document_ids is not None and tuple(document_ids.shape) != (b, s):
        raise ValueError(f"document_ids must be [b, s] = [{b}, {s}], got "
                         f"{tuple(document_ids.shape)}.")


class DocumentCache:
    """Remembers what `build` made of the last document_ids tensor (cu_seqlens by default): every
    layer of a step passes the same tensor, so the boundaries (and their host syncs) are computed
    once per step. `extra`: further arguments of build, part of the key."""

    def __init__(self, build=cu_seqlens_from_document_ids):
        self._build = build
        self._key = None
        self._value = None

    def __call__(self, document_ids: torch.Tensor, *extra):
        key = (document_ids, document_ids._version, extra)
        if self._key is None or self._key[0] is not key[0] or self._key[1:] != key[1:]:
            self._key, self._value = key, self._build(document_ids, *extra)
        return self._value


class AttentionBackend(nn.Module):
    """Base class: `name` is what the start-up log prints."""

    name = "base"

    def extra_repr(self) -> str:
        return f"name={self.name}"
