"""Mixture of experts: the collectives of the MoE layer (models/moe.py holds the layer itself)."""
from megatron_sp.moe.comm import COMM_KIND, reduce_statistics

__all__ = ["COMM_KIND", "reduce_statistics"]
