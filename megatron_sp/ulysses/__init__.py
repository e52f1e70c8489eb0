"""Ulysses sequence parallelism: seq<->head all-to-alls and the attention wrapper (docs/design.md §4)."""
from megatron_sp.ulysses.attention import (UlyssesAttention, check_head_chunks,
                                           check_ulysses_layout, expand_kv_heads,
                                           head_chunk_problem)
from megatron_sp.ulysses.comm import (COMM_KIND, all_to_all_bytes, head_to_seq_all_to_all,
                                      head_to_seq_qkv_all_to_all, seq_to_head_all_to_all,
                                      seq_to_head_qkv_all_to_all)

__all__ = [
    "UlyssesAttention", "check_ulysses_layout", "expand_kv_heads",
    "check_head_chunks", "head_chunk_problem",
    "seq_to_head_all_to_all", "head_to_seq_all_to_all",
    "seq_to_head_qkv_all_to_all", "head_to_seq_qkv_all_to_all", "all_to_all_bytes", "COMM_KIND",
]
