"""Megatron-LM's parameter names and tensor-parallel cuts <-> ours (docs/checkpoints.md).

Per layer (megatron-core's local spec; Transformer Engine fuses the norms into the next linear:
`self_attention.linear_qkv.layer_norm_weight` is `input_layernorm.weight`,
`mlp.linear_fc1.layer_norm_weight` is `pre_mlp_layernorm.weight`; torch_dist uses those names with
either spec). The layouts are the same as ours: linear_qkv rows per query group (its h/g query
heads, then k, then v), fc1 = [gate; up] for SwiGLU.

Tensor parallelism (torch format, one file per tp rank): column-parallel (qkv, fc1, embedding,
output layer) cut on dim 0, where rank r holds whole query groups, and for SwiGLU [gate_r; up_r];
row-parallel (linear_proj, linear_fc2) on dim 1; norms and the row-parallel biases replicated.
"""
from __future__ import annotations

import re

import torch

from megatron_sp.checkpointing.format import CheckpointError

LAYER = {   # Megatron-LM (local spec) suffix of decoder.layers.{i}. -> ours of layers.{i}.
    "input_layernorm.weight": "input_norm.weight",
    "input_layernorm.bias": "input_norm.bias",
    "self_attention.linear_qkv.weight": "attention.qkv.weight",
    "self_attention.linear_qkv.bias": "attention.qkv.bias",
    "self_attention.q_layernorm.weight": "attention.q_layernorm.weight",
    "self_attention.q_layernorm.bias": "attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight": "attention.k_layernorm.weight",
    "self_attention.k_layernorm.bias": "attention.k_layernorm.bias",
    "self_attention.linear_proj.weight": "attention.proj.weight",
    "self_attention.linear_proj.bias": "attention.proj.bias",
    "pre_mlp_layernorm.weight": "post_attention_norm.weight",
    "pre_mlp_layernorm.bias": "post_attention_norm.bias",
    "mlp.linear_fc1.weight": "mlp.fc1.weight",
    "mlp.linear_fc1.bias": "mlp.fc1.bias",
    "mlp.linear_fc2.weight": "mlp.fc2.weight",
    "mlp.linear_fc2.bias": "mlp.fc2.bias",
    "mlp.router.weight": "mlp.router.weight",
    "mlp.experts.experts.linear_fc1.weight": "mlp.experts.w1",   # torch_dist: [E, 2F, H] a layer
    "mlp.experts.experts.linear_fc2.weight": "mlp.experts.w2",   # [E, H, F]
}
TE_FUSED = {   # Transformer Engine's (and torch_dist's) names of the norms
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
TE_NAME = {v: k for k, v in TE_FUSED.items()}
GLOBAL = {
    "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "decoder.final_layernorm.weight": "final_norm.weight",
    "decoder.final_layernorm.bias": "final_norm.bias",
    "output_layer.weight": "output_layer.weight",
}
OURS_GLOBAL = {v: k for k, v in GLOBAL.items()}
OURS_LAYER = {v: k for k, v in LAYER.items()}
COLUMN = ("attention.qkv.weight", "attention.qkv.bias", "mlp.fc1.weight", "mlp.fc1.bias",
          "embedding.word_embeddings.weight", "output_layer.weight")
ROW = ("attention.proj.weight", "mlp.fc2.weight")
LAYER_KEY = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")
EXPERT_KEY = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")


def our_layer_suffix(suffix: str, where: str) -> str:
    """Our name (after layers.{i}.) of a Megatron-LM per-layer suffix; refuses an unknown one."""
    suffix = TE_FUSED.get(suffix, suffix)
    if suffix not in LAYER:
        raise CheckpointError(f"checkpoint {where} holds decoder.layers.*.{suffix}, a tensor "
                              f"megatron_sp has no place for (a model feature it does not "
                              f"implement); it cannot be converted.")
    return LAYER[suffix]


def our_global(name: str, where: str) -> str:
    if name not in GLOBAL:
        raise CheckpointError(f"checkpoint {where} holds {name}, a tensor megatron_sp has no "
                              f"place for (a model feature it does not implement); it cannot be "
                              f"converted.")
    return GLOBAL[name]


def megatron_name(ours: str, te_names: bool = False) -> str:
    """Megatron-LM's name of one of our tensors (layers.{i}.x -> decoder.layers.{i}.y); with
    `te_names` the norms under Transformer Engine's fused names."""
    if ours in OURS_GLOBAL:
        return OURS_GLOBAL[ours]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", ours)
    if m is None or m.group(2) not in OURS_LAYER:
        raise CheckpointError(f"tensor {ours} has no Megatron-LM name (a feature megatron-core's "
                              f"GPT does not have); it cannot be written.")
    suffix = OURS_LAYER[m.group(2)]
    return f"decoder.layers.{m.group(1)}.{TE_NAME.get(suffix, suffix) if te_names else suffix}"


def _kind(ours: str) -> str:
    tail = ours.split(".", 2)[-1] if ours.startswith("layers.") else ours
    if tail in COLUMN:
        return "column"
    if tail in ROW:
        return "row"
    return "replicated"


def merge_tp(ours: str, shards: list[torch.Tensor], swiglu: bool) -> torch.Tensor:
    """The full tensor of one of our names from its tp shards (module docstring)."""
    kind = _kind(ours)
    if kind == "replicated" or len(shards) == 1:
        return shards[0]
    if kind == "row":
        return torch.cat(shards, dim=1)
    if swiglu and ours.split(".", 2)[-1] in ("mlp.fc1.weight", "mlp.fc1.bias"):
        halves = [s.chunk(2, dim=0) for s in shards]          # each [gate_r; up_r]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0)


def split_tp(ours: str, full: torch.Tensor, tp: int, rank: int, swiglu: bool) -> torch.Tensor:
    """Rank `rank`'s shard of one of our full tensors (the inverse of `merge_tp`)."""
    kind = _kind(ours)
    if kind == "replicated" or tp == 1:
        return full
    if kind == "row":
        return full.chunk(tp, dim=1)[rank]
    if swiglu and ours.split(".", 2)[-1] in ("mlp.fc1.weight", "mlp.fc1.bias"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    return full.chunk(tp, dim=0)[rank]


def join_experts(state: dict, where: str) -> dict:
    """One stage's per-expert tensors of the torch format (decoder.layers.{i}.mlp.experts.
    local_experts.{j}.linear_fc{1,2}.weight, already joined over tp) stacked as the torch_dist
    names' [E, ...] tensors of each layer; other keys as they are."""
    out, experts = {}, {}
    for key, t in state.items():
        m = LAYER_KEY.match(key)
        e = EXPERT_KEY.match(m.group(2)) if m else None
        if e is None:
            if m and re.match(r"mlp\.experts\.linear_fc[12]\.weight\d+$", m.group(2)):
                raise CheckpointError(f"checkpoint {where} holds grouped-GEMM experts ({key}), "
                                      f"which this reader does not join; save it as torch_dist.")
            out[key] = t
            continue
        experts.setdefault((int(m.group(1)), e.group(2)), {})[int(e.group(1))] = t
    for (i, fc), by_index in experts.items():
        stack = [by_index[j] for j in sorted(by_index)]
        out[f"decoder.layers.{i}.mlp.experts.experts.linear_fc{fc}.weight"] = torch.stack(stack)
    return out


def expected_names(fields: dict) -> list[str]:
    """Our tensor names of a model with GPTConfig `fields` (dense, or MoE in every layer's MLP
    where moe_layer_freq says)."""
    f = fields
    layer_norm = f.get("normalization", "LayerNorm") == "LayerNorm"
    bias = f.get("add_bias_linear", True)
    qkv_bias = f.get("add_qkv_bias", bias)
    names = ["embedding.word_embeddings.weight"]
    if f.get("position_embedding_type") == "learned_absolute":
        names.append("embedding.position_embeddings.weight")
    per = ["input_norm.weight", "attention.qkv.weight", "attention.proj.weight",
           "post_attention_norm.weight", "mlp.fc1.weight", "mlp.fc2.weight"]
    per += ["input_norm.bias", "post_attention_norm.bias"] if layer_norm else []
    per += ["attention.qkv.bias"] if qkv_bias else []
    per += ["attention.proj.bias", "mlp.fc1.bias", "mlp.fc2.bias"] if bias else []
    if f.get("qk_layernorm"):
        per += ["attention.q_layernorm.weight", "attention.k_layernorm.weight"]
        per += ["attention.q_layernorm.bias", "attention.k_layernorm.bias"] if layer_norm else []
    moe = [n for n in per if not n.startswith("mlp.")] + [
        "mlp.router.weight", "mlp.experts.w1", "mlp.experts.w2"]
    freq = f.get("moe_layer_freq", 1)
    for i in range(f["num_layers"]):
        is_moe = f.get("num_experts") and (freq[i] if isinstance(freq, list) else i % freq == 0)
        names += [f"layers.{i}.{n}" for n in (moe if is_moe else per)]
    names += ["final_norm.weight"] + (["final_norm.bias"] if layer_norm else [])
    if not f.get("tie_embeddings", True):
        names.append("output_layer.weight")
    return names
