"""Layout-independent parameter initialisation (docs/design.md §8).

Each parameter is drawn whole from its own generator, seeded from (seed, global parameter name), then
this rank's tensor-parallel shard is copied in (expert-parallel experts: the full [E, ...] tensor,
this ep rank's E/ep rows). Any two layouts therefore start from identical weights, and only one
full parameter is in host memory at a time (an 8B model never sits whole on the host).

Megatron's scheme: weights ~ N(0, std), the two output projections of each layer (attention proj and
fc2) ~ N(0, std / sqrt(2 * num_layers)), biases 0, norm weights 1 (0 with --apply-layernorm-1p,
which stores gamma - 1), norm biases 0. Vocabulary padding
rows are zero so that the padded size (which depends on tp) never changes the model.
"""
from __future__ import annotations

import hashlib
import math

import torch

from megatron_sp.tensor_parallel.layers import full_shape, shard_of_full


def param_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for one parameter (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _full_init(name: str, shape, std: float, num_layers: int, real_rows: int | None, seed: int,
               zero_centered_norms: bool = False):
    leaf = name.rsplit(".", 1)[-1]
    is_norm = "norm" in name
    if leaf == "bias" or (is_norm and leaf != "weight"):
        return torch.zeros(shape)
    if is_norm:   # --apply-layernorm-1p stores gamma - 1: the same initial gamma of 1
        return torch.zeros(shape) if zero_centered_norms else torch.ones(shape)
    if name.endswith(("attention.proj.weight", "mlp.fc2.weight", "mlp.experts.w2",
                      "mlp.shared_expert.fc2.weight")):   # Megatron's output-layer init
        std = std / math.sqrt(2.0 * num_layers)
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    if real_rows is not None:  # vocabulary rows: draw the real ones, zero the padding
        full = torch.zeros(shape)
        full[:real_rows].normal_(0.0, std, generator=gen)
        return full
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_parameters(model, seed: int, std: float | None = None) -> None:
    """Initialise every parameter of `model` (a GPTModel or one pipeline chunk) from its full tensor."""
    config, mesh = model.config, model.mesh
    std = config.init_method_std if std is None else std
    for name, param in model.named_parameters():
        shape = full_shape(param, mesh.tp_size)
        ep = getattr(param, "ep_size", 1) if getattr(param, "expert_parallel", False) else 1
        if ep > 1:   # E/ep local experts: the full [E, ...] tensor, this ep rank's rows
            shape = torch.Size([shape[0] * ep, *shape[1:]])
        real_rows = getattr(param, "real_rows", None)
        full = _full_init(name, shape, std, config.num_layers, real_rows, seed,
                          getattr(config, "apply_layernorm_1p", False))
        if ep > 1:
            full = full.chunk(ep, dim=0)[param.ep_rank]
        param.copy_(shard_of_full(full, param, mesh.tp_rank, mesh.tp_size).to(param.dtype))
