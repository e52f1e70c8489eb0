"""Megatron-LM's checkpoints, read and written without megatron-core (docs/checkpoints.md).

- `folder`: where a checkpoint lies and in which format (torch_dist or torch), refusals of what is
  not one or is half-written;
- `safe_load`: its pickles read with torch.load(weights_only=True) and an allowlist;
- `arguments`: the stored arguments <-> our model fields;
- `names`: parameter names and tensor-parallel cuts;
- `read`: a checkpoint of any tp x pp -> full tensors in our names (`read_checkpoint`);
- `write`: our full tensors -> a checkpoint megatron-core loads strictly at a chosen tp x pp;
- `resume`: a Megatron-LM checkpoint loaded into a training run of any layout.

Part of the core: model configs are passed in (GPTConfig-like objects) or returned as dicts of
fields, never built here.
"""
from megatron_sp.checkpointing.megatron_lm.folder import is_megatron_lm_checkpoint, locate
from megatron_sp.checkpointing.megatron_lm.read import MegatronCheckpoint, read_checkpoint
from megatron_sp.checkpointing.megatron_lm.resume import load_for_training


def megatron_lm_folder(load: str | None, step: int | None = None) -> str | None:
    """The path to read when --load (with --ckpt-step `step`) names a Megatron-LM checkpoint,
    else None (our own format, or nothing there)."""
    if not is_megatron_lm_checkpoint(load):
        return None
    if step is None:
        return load
    import os
    from megatron_sp.checkpointing.format import iteration_dirname
    return os.path.join(load, iteration_dirname(step))


__all__ = ["MegatronCheckpoint", "is_megatron_lm_checkpoint", "load_for_training", "locate",
           "megatron_lm_folder", "read_checkpoint"]
