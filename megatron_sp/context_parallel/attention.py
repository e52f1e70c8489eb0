"""The ring as the local attention of a layer: what UlyssesAttention calls after its seq->head
exchange when the context is also split over a ring of cp ranks (Megatron-LM's --cp-comm-type
p2p, and a2a+p2p with Ulysses inside; docs/design.md §14).

    tokens  [b, s/(sp*cp), h_l, d]  this rank's chunk of its ring rank's zigzag tokens
    Ulysses seq->head over sp       [b, 2c, h_l/sp, d]   the ring rank's whole zigzag portion
    ring over cp (this module)      [b, 2c, h_l/sp, d]   attention against the whole sequence
    Ulysses head->seq over sp       [b, s/(sp*cp), h_l, d]

It takes the attention-backend signature (q, k, v, causal, softmax_scale, document_ids,
dropout_p): `document_ids` are the FULL rows' ids [b, s] (every rank has them, as every backend
gets them), from which the ring's segments are planned once per step (the plan is cached on the
ids tensor every layer passes) and shared by every layer, forward and backward.

Which tokens each ring rank holds is its `planner`'s layout (context_parallel/balance.py): the
whole-row zigzag by default; a model hands every ring of its layers one shared LayoutPlanner, so
that the balanced layout of packed documents is computed once per step, the same one the model
gathers its tokens by.
"""
from __future__ import annotations

from torch import nn

from megatron_sp.context_parallel.balance import LayoutPlanner
from megatron_sp.context_parallel.ring import ring_attention
from megatron_sp.mesh import group_rank, group_size


class RingLocalAttention(nn.Module):
    """ring_attention over `cp_group` behind the attention-backend interface (causal, no dropout:
    --attention-dropout is refused with a ring at start-up)."""

    name = "ring"

    def __init__(self, cp_group, planner: LayoutPlanner | None = None):
        super().__init__()
        self.cp_group = cp_group
        self.cp_size = group_size(cp_group)
        self.planner = planner or LayoutPlanner("zigzag", self.cp_size, group_rank(cp_group))

    def forward(self, q, k, v, *, causal=True, softmax_scale=None, document_ids=None,
                dropout_p=0.0):
        """q [b, n, h, d], k, v [b, n, g, d]: this ring rank's n = s/cp tokens of the planner's
        layout (zigzag: chunk r then chunk 2cp-1-r of the sequence, as zigzag_split cuts them),
        all of its heads.
        document_ids: None (no packed documents) or the FULL rows' int64 [b, s] segment ids (a
        document is a maximal run of equal ids). Returns out [b, n, h, d], the same tokens."""
        if dropout_p:
            raise ValueError(f"attention dropout ({dropout_p}) is not implemented under ring "
                             f"context parallelism: pass --attention-dropout 0.")
        b, n = q.shape[:2]
        if document_ids is not None and tuple(document_ids.shape) != (b, n * self.cp_size):
            raise ValueError(f"document_ids must cover the full rows, [b, s] = [{b}, "
                             f"{n * self.cp_size}] (cp = {self.cp_size} ranks of {n} tokens), got "
                             f"{tuple(document_ids.shape)}.")
        plan = self.planner.plan(document_ids, b, n, causal)
        return ring_attention(q, k, v, self.cp_group, causal=causal, scale=softmax_scale,
                              plan=plan)

    def extra_repr(self) -> str:
        return f"cp={self.cp_size}, layout={self.planner.kind}"
