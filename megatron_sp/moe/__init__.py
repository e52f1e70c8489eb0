"""Mixture of experts: the collectives of the MoE layer (models/moe.py holds the layer itself)."""
from megatron_sp.moe.comm import COMM_KIND, gather_tokens, reduce_scatter_tokens, reduce_statistics
from megatron_sp.moe.dispatch import (COUNTS_KIND as DISPATCH_COUNTS_KIND, ROWS_KIND as DISPATCH_KIND,
                                      dispatch_bytes, dispatch_experts_combine)

__all__ = ["COMM_KIND", "DISPATCH_COUNTS_KIND", "DISPATCH_KIND", "dispatch_bytes",
           "dispatch_experts_combine", "gather_tokens", "reduce_scatter_tokens", "reduce_statistics"]
