"""Attention backends behind one [b, s, heads, d] interface: TE, flash-attn, SDPA (docs/design.md §5)."""
from megatron_sp.attention.backends import (BACKEND_NAMES, AttentionBackend,
                                            AttentionBackendUnavailable, FlashAttention,
                                            SDPAAttention, TEAttention, get_attention_backend)
from megatron_sp.attention.documents import (cu_seqlens_from_document_ids, document_causal_mask,
                                             document_starts)

__all__ = [
    "AttentionBackend", "AttentionBackendUnavailable", "SDPAAttention", "FlashAttention",
    "TEAttention", "get_attention_backend", "BACKEND_NAMES",
    "cu_seqlens_from_document_ids", "document_causal_mask", "document_starts",
]
