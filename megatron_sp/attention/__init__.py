"""Attention backends behind one [b, s, heads, d] interface: TE, flash-attn, SDPA, FlexAttention
(docs/design.md §5); SDPA's kernel choice in kernels.py."""
from megatron_sp.attention.backends import (AttentionBackendUnavailable, FlashAttention,
                                            SDPAAttention, TEAttention, get_attention_backend)
from megatron_sp.attention.base import BACKEND_NAMES, AttentionBackend
from megatron_sp.attention.documents import (cu_seqlens_from_document_ids, document_causal_mask,
                                             document_starts)
from megatron_sp.attention.kernels import describe_attention, sdpa_kernel_plan

__all__ = [
    "AttentionBackend", "AttentionBackendUnavailable", "SDPAAttention", "FlashAttention",
    "TEAttention", "get_attention_backend", "BACKEND_NAMES",
    "cu_seqlens_from_document_ids", "document_causal_mask", "document_starts",
    "describe_attention", "sdpa_kernel_plan",
]
