"""Document boundaries of packed sequences (Megatron's --reset-attention-mask).

`document_ids` [b, s] int64 gives each token a segment id; a document is a maximal run of equal
ids in a row, and a token attends only to earlier tokens of its own document. Fused kernels take
the same information as cumulative sequence lengths over the flattened [b*s] tokens (cu_seqlens,
int32, starting at 0 and ending at b*s); SDPA takes a block-diagonal causal mask (tests / CPU only:
it is [b, 1, s, s]).
"""
from __future__ import annotations

import torch


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] ids -> [b, s] bool, True where a document starts (every row's first token too)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def cu_seqlens_from_document_ids(document_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[b, s] ids -> (cu_seqlens int32 [num_docs + 1], max_seqlen) over the flattened b*s tokens.

    Rows are concatenated, so a document never spans two rows. max_seqlen is a Python int (one
    host synchronisation), as flash-attn and Transformer Engine expect.
    """
    b, s = document_ids.shape
    starts = document_starts(document_ids).reshape(b * s).nonzero().squeeze(1)  # [num_docs]
    end = torch.tensor([b * s], dtype=starts.dtype, device=starts.device)
    cu_seqlens = torch.cat([starts, end]).to(torch.int32)                        # [num_docs + 1]
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
    return cu_seqlens, max_seqlen


def document_index(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] ids -> [b, s] int64 index of each token's document in its row (non-decreasing);
    a document is a maximal run of equal ids."""
    return document_starts(document_ids).cumsum(dim=1)


def document_causal_mask(document_ids: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """[b, s] ids -> [b, 1, s, s] bool mask, True where query i may attend to key j: same document
    and (when causal) j <= i."""
    s = document_ids.shape[1]
    doc = document_index(document_ids)                               # [b, s] document index per row
    mask = doc[:, :, None] == doc[:, None, :]                        # [b, s, s] same document
    if causal:
        mask &= torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    return mask.unsqueeze(1)                                         # [b, 1, s, s]
