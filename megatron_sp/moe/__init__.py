"""Mixture of experts: the collectives of the MoE layer (comm.py) and expert parallelism's token
dispatch (dispatch.py); models/moe.py holds the layer itself."""
from megatron_sp.moe.comm import COMM_KIND
from megatron_sp.moe.comm import COUNTS_KIND as DISPATCH_COUNTS_KIND
from megatron_sp.moe.comm import ROWS_KIND as DISPATCH_KIND
from megatron_sp.moe.comm import gather_tokens, reduce_scatter_tokens, reduce_statistics
from megatron_sp.moe.dispatch import dispatch_bytes, dispatch_experts_combine

__all__ = ["COMM_KIND", "DISPATCH_COUNTS_KIND", "DISPATCH_KIND", "dispatch_bytes",
           "dispatch_experts_combine", "gather_tokens", "reduce_scatter_tokens", "reduce_statistics"]
