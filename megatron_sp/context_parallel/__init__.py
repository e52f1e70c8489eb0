"""Context parallelism past the head count: ring attention, zigzag layout (docs/design.md §14).

zigzag: the head-tail sequence layout (chunks r and 2cp-1-r on ring rank r); comm: the ring
exchange (every torch.distributed call); ring: ring attention, forward and backward; attention:
the ring behind the attention-backend interface (a model layer's local attention); rehearsal: the
ring of cp virtual ranks in one process (one GPU checks the CUDA ring); te: Transformer Engine's
own context parallelism for the te backend. Packed
documents are planned as segments in megatron_sp.attention.segments; the fused block kernels
(forward with lse, backward from a given lse, the merge) are megatron_sp.attention.block_kernels.
"""
from megatron_sp.context_parallel.attention import RingLocalAttention
from megatron_sp.context_parallel.comm import COMM_KIND, RingExchange, send_next_recv_prev
from megatron_sp.context_parallel.rehearsal import rehearse_rank_peak, ring_rehearsal
from megatron_sp.context_parallel.ring import RingAttention, plan_ring, ring_attention
from megatron_sp.context_parallel.zigzag import (check_zigzag_length, zigzag_chunks, zigzag_merge,
                                                 zigzag_positions, zigzag_split)

__all__ = [
    "COMM_KIND", "RingExchange", "RingLocalAttention", "send_next_recv_prev", "RingAttention", "ring_attention",
    "plan_ring", "ring_rehearsal", "rehearse_rank_peak", "check_zigzag_length", "zigzag_chunks", "zigzag_merge", "zigzag_positions",
    "zigzag_split",
]
