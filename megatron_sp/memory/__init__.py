"""Long-context memory techniques: activation recompute (full / selective), tiled MLP,
chunked loss, activation offload, saved-tensor accounting and the parallel-layout planner.

The model takes them as one `MemoryOptions` (GPTModel(..., memory=MemoryOptions(...))).
"""
from megatron_sp.memory.accounting import (SavedTensorAccountant, format_report, layer_bytes,
                                           measure_saved_bytes, peak_device_memory)
from megatron_sp.memory.offload import offload_saved_tensors
from megatron_sp.memory.options import TECHNIQUES, MemoryOptions, resolve_count
from megatron_sp.memory.recompute import (RecomputedAttention, checkpoint, forward_layers,
                                          recompute_plan)
from megatron_sp.memory.tiling import chunked_output_loss, tiled_mlp

__all__ = ["MemoryOptions", "TECHNIQUES", "resolve_count", "SavedTensorAccountant",
           "measure_saved_bytes", "format_report", "layer_bytes",
           "peak_device_memory", "offload_saved_tensors", "RecomputedAttention", "checkpoint",
           "forward_layers", "recompute_plan", "chunked_output_loss", "tiled_mlp"]
