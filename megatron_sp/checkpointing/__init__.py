"""Distributed checkpoints: torch.distributed.checkpoint (DCP) with layout-independent keys.

Every tensor is stored under its global name with its *full* (unsharded, layout-independent)
shape; each rank writes the rectangle it holds, and DCP reads back whatever rectangles another
layout needs. A checkpoint saved with any (tp, sp, pp, dp) therefore loads into any other.

Modules (as torchtitan keeps format, staging and manager apart):
- `format`: what is stored (keys, `Shard` rectangles, model / optimizer / RNG state, metadata);
- `planners`: DCP planners for `Shard`, DCP errors turned into `CheckpointError`;
- `io`: DCP save / load (synchronous or background), atomic publish, the tracker file;
- `pretrained`: one-process access (`load_pretrained`, safetensors export);
- `manager`: `CheckpointManager` (--save / --load / exit flags) and `SignalHandler`;
- `lock`: one run per --save folder (`SaveLock`, the refusal of a fresh run into another's);
- `preflight`: start-up checks of the folders a run writes (writable, free space);
- `comm`: the few collectives (barrier, broadcast, `any_rank_flag`).

This package is part of the core: it does not import the models (except `pretrained`, lazily);
it works on any nn.Module chunks whose parameters carry the tensor-parallel attributes.
"""
from megatron_sp.checkpointing.comm import any_rank_flag
from megatron_sp.checkpointing.format import (ARCHITECTURE_FIELDS, FORMAT_VERSION, FUNCTION_FIELDS,
                                              META_FILENAME, RELEASE, TRACKER_FILENAME,
                                              CheckpointError, Shard, check_config,
                                              iteration_dirname, model_state, named_parameters,
                                              optimizer_state, param_shard, read_meta)
from megatron_sp.checkpointing.io import (finalize_async_save, load_checkpoint, read_tracker,
                                          resolve_checkpoint, save_checkpoint)
from megatron_sp.checkpointing.manager import CheckpointManager, SignalHandler
from megatron_sp.checkpointing.pretrained import export_safetensors, load_pretrained

__all__ = ["ARCHITECTURE_FIELDS", "FORMAT_VERSION", "FUNCTION_FIELDS", "META_FILENAME", "RELEASE",
           "TRACKER_FILENAME", "CheckpointError", "CheckpointManager", "Shard", "SignalHandler",
           "any_rank_flag", "check_config", "export_safetensors", "finalize_async_save",
           "iteration_dirname", "load_checkpoint", "load_pretrained", "model_state",
           "named_parameters", "optimizer_state", "param_shard", "read_meta", "read_tracker",
           "resolve_checkpoint", "save_checkpoint"]
