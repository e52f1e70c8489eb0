"""Memory and communication model of one training step, and the parallel-layout planner
(docs/design.md §9, §11), in rooms, each with its part of the model in its docstring:

  job            Workload (the step apart from the model) and Hardware (the machine)
  activations    the bytes one layer (and the output layer) saves for backward, term by term
  moe            the mixture-of-experts terms: MoE layers, the MoE block, its backward
  state          model-state bytes per rank under each sharding mode (and their host copies)
  communication  bytes one rank sends per step, by kind
  peak           the peak of one step: what the forward keeps + the largest backward phase
  search         the layouts, the memory techniques and sharding that fit, scored; the longest
                 sequence that fits

The attention kernel a plan assumes is named in one place, megatron_sp/attention/kernels.py
(attention_kernel_name, attention_kernel), re-exported here.
"""
from megatron_sp.attention.kernels import DEVICES, attention_kernel, attention_kernel_name
from megatron_sp.memory.planner.activations import (activation_bytes, fused_rms_norm,
                                                    korthikanti_layer_bytes, ring_buffer_bytes)
from megatron_sp.memory.planner.communication import comm_bytes_per_step, ring_layer_bytes
from megatron_sp.memory.planner.job import GiB, Hardware, Workload
from megatron_sp.memory.planner.moe import (MLP_TERMS, is_moe, moe_backward_bytes, moe_layer_flags,
                                            router_prob_bytes, stage_layers)
from megatron_sp.memory.planner.peak import layer_backward_peak, plan_index_bytes, step_peak_bytes
from megatron_sp.memory.planner.search import (BINDS, LOSS_CHUNK_TOKENS, MLP_TILE_TOKENS,
                                               TECHNIQUE_COST, TECHNIQUE_LADDER, Plan,
                                               SearchProgress, binding_limit, concrete_memory,
                                               expert_parallel_choices, head_chunk_choices,
                                               head_chunk_cost, layouts, max_feasible_seq, plan,
                                               seq_step, sharding_candidates,
                                               technique_candidates)
from megatron_sp.memory.planner.state import (BYTES_PER_PARAM, SHARDING_MODES, expert_shard_ranks,
                                              fsdp_expert_units, fsdp_in_flight_params,
                                              fsdp_units, host_state_pinned_bytes,
                                              layout_state_bytes, model_state_bytes,
                                              moe_layer_parameters, params_per_rank,
                                              params_split_per_rank, pinned_bytes)

# The names these had before the planner became a package (tests import them).
_fused_rms_norm = fused_rms_norm
_layer_backward_peak = layer_backward_peak
_moe_backward_bytes = moe_backward_bytes
_model_state = layout_state_bytes

__all__ = [
    "BINDS", "BYTES_PER_PARAM", "DEVICES", "GiB", "Hardware", "LOSS_CHUNK_TOKENS", "MLP_TERMS",
    "MLP_TILE_TOKENS", "Plan", "SHARDING_MODES", "SearchProgress", "TECHNIQUE_COST",
    "TECHNIQUE_LADDER", "Workload", "activation_bytes", "attention_kernel",
    "attention_kernel_name", "binding_limit", "comm_bytes_per_step", "concrete_memory",
    "expert_parallel_choices", "expert_shard_ranks", "fsdp_expert_units",
    "fsdp_in_flight_params", "fsdp_units", "fused_rms_norm", "head_chunk_choices",
    "head_chunk_cost", "host_state_pinned_bytes", "is_moe", "korthikanti_layer_bytes",
    "layer_backward_peak", "layout_state_bytes", "layouts", "max_feasible_seq",
    "model_state_bytes", "moe_backward_bytes", "moe_layer_flags", "moe_layer_parameters",
    "params_per_rank", "params_split_per_rank", "pinned_bytes", "plan", "plan_index_bytes",
    "ring_buffer_bytes", "ring_layer_bytes", "router_prob_bytes", "seq_step",
    "sharding_candidates", "stage_layers", "step_peak_bytes", "technique_candidates",
]
