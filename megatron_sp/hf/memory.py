"""Long-context memory for transformers causal LMs: a sequence-tiled MLP and activation
checkpointing with the checkpointed inputs on the host (docs/design.md §15; ALST's TiledMLP).

    tile_mlp(model, tiles="auto")       every decoder layer's `mlp` runs over sequence tiles
    offload_checkpointing(model)        every decoder layer is one checkpoint whose input lives
                                        on the host until backward

Tiled MLP: the MLP is token-wise, so running it on sequence tiles of its input x [b, s/sp, H] is
the same function; each tile is a checkpoint (megatron_sp.memory.tiling.tiled_mlp), so the
[b, tile, F] intermediates (SwiGLU: gate, up, act(gate)*up) of one tile exist at a time in
backward instead of the whole [b, s/sp, F] ones being kept from the forward. "auto" is the
megatron_sp.memory rule: about ceil(F / H) tiles, never fewer than MIN_TILE_TOKENS tokens each.

Offloaded checkpointing: each decoder layer runs inside a non-reentrant torch checkpoint (only its
hidden-state input [b, s/sp, H] is kept, everything inside is recomputed in backward) within
megatron_sp.memory.offload_saved_tensors, so that kept input is copied to (pinned) host memory and
comes back for the recompute: the device holds no activations of the layers between forward and
backward. Use it instead of the model's own gradient_checkpointing (not on top of it). Other layer
arguments (RoPE cos/sin, masks, position ids) are shared by all layers and stay where they are.

Both patch instance `forward`s, so parameter names and state dicts are unchanged, and compose with
megatron_sp.hf.sequence_parallel (the recompute repeats a layer's all-to-alls in backward, in the
same order on every sp rank). The bench row of bench/hf_ulysses.py measures the saved bytes.
"""
from __future__ import annotations

import functools

import torch

from megatron_sp.errors import ConfigError
from megatron_sp.memory.offload import offload_saved_tensors
from megatron_sp.memory.recompute import checkpoint
from megatron_sp.memory.tiling import tiled_mlp

_TILED = "_megatron_sp_tiled_mlp"
_OFFLOADED = "_megatron_sp_offload_checkpoint"


def decoder_layers(model) -> list:
    """The decoder layers of a transformers causal LM (llama / mistral / qwen2 / qwen3:
    model.model.layers; gpt2: model.transformer.h)."""
    for path in (("model", "layers"), ("transformer", "h")):
        owner = model
        for name in path:
            owner = getattr(owner, name, None)
        if isinstance(owner, torch.nn.ModuleList):
            return list(owner)
    raise ConfigError(f"megatron_sp.hf.memory: {type(model).__name__} has no decoder layers at "
                      f"model.model.layers or model.transformer.h; pass a llama, mistral, qwen2, "
                      f"qwen3 or gpt2 causal LM.")


def _ffn_width(config) -> int:
    return getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or \
        4 * config.hidden_size


def _tiled_forward(forward, tiles, width, x, *args, **kwargs):
    """The MLP's own forward over sequence tiles of x [b, s, H] -> [b, s, H]."""
    if args or kwargs or x.dim() != 3:
        return forward(x, *args, **kwargs)
    return tiled_mlp(forward, x, tiles, width)


def tile_mlp(model, tiles: int | str = "auto"):
    """Run every decoder layer's `mlp` over `tiles` sequence tiles (an int or "auto"), each
    recomputed in backward. Returns the model (changed in place; applying it twice is refused)."""
    config = model.config
    for layer in decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            raise ConfigError(f"megatron_sp.hf.memory.tile_mlp: {type(layer).__name__} has no "
                              f"`mlp` module to tile.")
        if getattr(mlp, _TILED, False):
            raise ConfigError("megatron_sp.hf.memory.tile_mlp: the MLPs are already tiled.")
        mlp.forward = functools.partial(_tiled_forward, mlp.forward, tiles,
                                        _ffn_width(config))
        setattr(mlp, _TILED, True)
    return model


def _offloaded_forward(forward, hidden_states, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(hidden_states, *args, **kwargs)

    def run(x):
        return forward(x, *args, **kwargs)

    with offload_saved_tensors():
        return checkpoint(run, hidden_states)


def offload_checkpointing(model):
    """Make every decoder layer one checkpoint whose kept input lives on the host (module
    docstring). Refuses a model with its own gradient checkpointing on. Returns the model."""
    name = "is_activation_checkpointing"            # transformers 5; is_gradient_checkpointing before
    if getattr(model, name if hasattr(type(model), name) else "is_gradient_checkpointing", False):
        raise ConfigError("megatron_sp.hf.memory.offload_checkpointing replaces the model's own "
                          "gradient checkpointing; call model.gradient_checkpointing_disable() (or "
                          "gradient_checkpointing=False in the TrainingArguments / SFTConfig) first.")
    for layer in decoder_layers(model):
        if getattr(layer, _OFFLOADED, False):
            raise ConfigError("megatron_sp.hf.memory.offload_checkpointing: already applied.")
        layer.forward = functools.partial(_offloaded_forward, layer.forward)
        setattr(layer, _OFFLOADED, True)
    return model


def saved_bytes(step) -> dict:
    """Bytes kept for backward while `step()` (a forward + backward) runs, by
    megatron_sp.memory's SavedTensorAccountant: {"device_bytes", "host_bytes"} of the largest
    pass (activations only: parameters and weight copies are not counted)."""
    from megatron_sp.memory.accounting import SavedTensorAccountant

    accountant = SavedTensorAccountant()
    with accountant.recording():
        step()
    report = accountant.report()
    return {"device_bytes": report["device_bytes"], "host_bytes": report["host_bytes"]}
