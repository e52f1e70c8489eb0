"""The ring as the local attention of a layer: what UlyssesAttention calls after its seq->head
exchange when the context is also split over a ring of cp ranks (Megatron-LM's --cp-comm-type
p2p, and a2a+p2p with Ulysses inside; docs/design.md §14).

    tokens  [b, s/(sp*cp), h_l, d]  this rank's chunk of its ring rank's zigzag tokens
    Ulysses seq->head over sp       [b, 2c, h_l/sp, d]   the ring rank's whole zigzag portion
    ring over cp (this module)      [b, 2c, h_l/sp, d]   attention against the whole sequence
    Ulysses head->seq over sp       [b, s/(sp*cp), h_l, d]

It takes the attention-backend signature, so UlyssesAttention and the model's layers need no
change; `document_ids` is then the ring rank's tokens' document INDEX over the full row
(GPTModel computes it once per step), which travels with the key/value blocks.
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

    def forward(self, q, k, v, *, causal=True, softmax_scale=None, document_ids=None,
                dropout_p=0.0):
        if dropout_p:
            raise ValueError(f"attention dropout ({dropout_p}) is not implemented under ring "
                             f"context parallelism: pass --attention-dropout 0.")
        return ring_attention(q, k, v, self.cp_group, causal=causal, scale=softmax_scale,
                              document_index=document_ids)

    def extra_repr(self) -> str:
        return f"cp={self.cp_size}"
