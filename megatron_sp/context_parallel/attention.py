"""The ring as the local attention of a layer: what UlyssesAttention calls after its seq->head
exchange when the context is also split over a ring of cp ranks (Megatron-LM's --cp-comm-type
p2p, and a2a+p2p with Ulysses inside; docs/design.md §14).

    tokens  [b, s/(sp*cp), h_l, d]  this rank's chunk of its ring rank's zigzag tokens
    Ulysses seq->head over sp       [b, 2c, h_l/sp, d]   the ring rank's whole zigzag portion
    ring over cp (this module)      [b, 2c, h_l/sp, d]   attention against the whole sequence
    Ulysses head->seq over sp       [b, s/(sp*cp), h_l, d]

It takes the attention-backend signature (q, k, v, causal, softmax_scale, dropout_p) except for
packed documents: a backend takes `document_ids` of the whole sequence, the ring takes
`document_index`, its tokens' document INDEX counted over the full row (GPTModel computes it once
per step, UlyssesAttention passes it on), which travels with the key/value blocks.
"""
from __future__ import annotations

from torch import nn

from megatron_sp.context_parallel.ring import ring_attention
from megatron_sp.mesh import group_size


class RingLocalAttention(nn.Module):
    """ring_attention over `cp_group` behind the attention-backend interface (causal, no dropout:
    --attention-dropout is refused with a ring at start-up)."""

    name = "ring"

    def __init__(self, cp_group):
        super().__init__()
        self.cp_group = cp_group
        self.cp_size = group_size(cp_group)

    def forward(self, q, k, v, *, causal=True, softmax_scale=None, document_index=None,
                dropout_p=0.0):
        """q [b, n, h, d], k, v [b, n, g, d]: this ring rank's n = s/cp zigzag tokens (chunk r
        then chunk 2cp-1-r of the sequence, as zigzag_split cuts them), all of its heads.

        document_index: None (no packed documents) or an int64 [b, n] tensor: for each of those n
        tokens, the index of its document counted over the FULL row of s tokens (1 for the row's
        first document, +1 at every document start: megatron_sp.attention.lse.document_index of
        the full [b, s] document ids, then zigzag_split with this ring rank), so that indices of
        different ring ranks compare and a token attends only to keys of the same index. It is
        not the document ids themselves: ids that repeat in a row (0 1 0) are three documents.
        Returns out [b, n, h, d], the same tokens."""
        if dropout_p:
            raise ValueError(f"attention dropout ({dropout_p}) is not implemented under ring "
                             f"context parallelism: pass --attention-dropout 0.")
        return ring_attention(q, k, v, self.cp_group, causal=causal, scale=softmax_scale,
                              document_index=document_index)

    def extra_repr(self) -> str:
        return f"cp={self.cp_size}"
