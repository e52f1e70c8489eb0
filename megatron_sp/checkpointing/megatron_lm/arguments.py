"""Megatron-LM's stored arguments (the checkpoint's argparse.Namespace) <-> our model fields.

The sizes come from the checkpoint itself: `model_fields(args)` gives the GPTConfig fields (as a
dict: the core does not import the models) of a dense or MoE GPT, and refuses in one sentence a
feature megatron_sp cannot represent. `args_for` writes the Namespace Megatron-LM reads back
(its check_checkpoint_args / --use-checkpoint-args fields).
"""
from __future__ import annotations

import argparse

from megatron_sp.checkpointing.format import CheckpointError

# Megatron-LM features we cannot represent: (argument, how it reads when set, the feature's name)
UNSUPPORTED = (
    ("multi_latent_attention", "multi-latent attention (MLA, DeepSeek-V2/V3)"),
    ("mtp_num_layers", "multi-token prediction layers (--mtp-num-layers)"),
    ("hybrid_override_pattern", "hybrid Mamba layers (--hybrid-override-pattern)"),
    ("is_hybrid_model", "hybrid Mamba layers"),
    ("heterogeneous_layers_config_path",
     "heterogeneous layers (--heterogeneous-layers-config-path)"),
    ("heterogeneous_layers_config_encoded_json", "heterogeneous layers"),
    ("num_layers_per_virtual_pipeline_stage", None),   # handled: model0.. chunks (torch format)
    ("squared_relu", "the squared-ReLU activation (--squared-relu)"),
    ("use_legacy_models", "the legacy (pre-megatron-core) model (--use-legacy-models)"),
    ("moe_use_upcycling", None),
    ("experimental_attention_variant", "an experimental attention variant"),
    ("attention_output_gate", "gated attention output (--attention-output-gate)"),
    ("moe_latent_size", "latent MoE (--moe-latent-size)"),
    ("qk_l2_norm", "L2 qk-norm (--qk-l2-norm)"),
    ("window_size", "sliding-window attention (--window-size)"),
    ("rotary_interleaved", "interleaved rotary embeddings (--rotary-interleaved)"),
    ("quick_geglu", "the quick-GeGLU activation (--quick-geglu)"),
    ("glu_linear_offset", "an offset in the GLU's linear half (--glu-linear-offset)"),
    ("activation_func_clamp_value", "a clamped activation (--activation-func-clamp-value)"),
)


def _get(stored: dict, name: str, default=None):
    value = stored.get(name, default)
    return default if value is None else value


def _position_type(stored: dict) -> str:
    """position_embedding_type; older Megatron-LM saves say RoPE as use_rotary_position_embeddings."""
    if stored.get("position_embedding_type") is None and stored.get("use_rotary_position_embeddings"):
        return "rope"
    return _get(stored, "position_embedding_type", "learned_absolute")


def as_dict(stored) -> dict:
    """The stored arguments as a dict (a Namespace or the safe loader's stand-in)."""
    if stored is None:
        return {}
    if isinstance(stored, dict):
        return dict(stored)
    return dict(vars(stored))


def refuse_unsupported(stored: dict, where: str) -> None:
    """One sentence naming the first stored feature we cannot represent."""
    if stored.get("num_experts"):
        _refuse_unsupported_moe(stored, where)
    for name, feature in UNSUPPORTED:
        value = stored.get(name)
        if feature and value not in (None, False, 0, "", [], "none"):
            raise CheckpointError(f"checkpoint {where} uses {feature} ({name}={value!r}), which "
                                  f"megatron_sp does not implement; it cannot be converted.")
    pos = _position_type(stored)
    if pos not in ("learned_absolute", "rope", "yarn"):
        raise CheckpointError(f"checkpoint {where} uses position_embedding_type {pos!r}; "
                              f"megatron_sp reads learned_absolute, rope and yarn.")
    if stored.get("add_position_embedding") is False and pos == "learned_absolute":
        raise CheckpointError(f"checkpoint {where} has no position embedding "
                              f"(--no-position-embedding), which megatron_sp does not build.")
    if (stored.get("virtual_pipeline_model_parallel_size") or 1) > 1:
        raise CheckpointError(f"checkpoint {where} was saved with virtual pipeline stages "
                              f"(virtual_pipeline_model_parallel_size="
                              f"{stored['virtual_pipeline_model_parallel_size']}); convert it with "
                              f"--ckpt-format torch_dist in Megatron-LM first.")


def _refuse_unsupported_moe(stored: dict, where: str) -> None:
    """The mixture-of-experts features this reader does not map (Mixtral / Qwen3-MoE-shaped
    models are: softmax routing, top-k, SwiGLU experts, no shared expert, no expert biases)."""
    checks = (
        ((stored.get("moe_shared_expert_intermediate_size") or 0) > 0, "a shared expert"),
        (_get(stored, "moe_router_score_function", "softmax") != "softmax",
         f"{stored.get('moe_router_score_function')!r} router scores"),
        (bool(stored.get("moe_router_enable_expert_bias")), "an expert bias in the router"),
        ((stored.get("moe_router_num_groups") or 0) > 1, "group-limited routing"),
        (bool(stored.get("moe_router_group_topk")), "group-limited routing"),
        (not stored.get("swiglu"), "experts without SwiGLU"),
        (_get(stored, "add_bias_linear", True), "expert biases (no --disable-bias-linear)"),
    )
    for bad, feature in checks:
        if bad:
            raise CheckpointError(f"checkpoint {where} is a mixture-of-experts model with "
                                  f"{feature}, which this reader does not map; it cannot be "
                                  f"converted.")


def _activation(stored: dict, where: str) -> str:
    if stored.get("swiglu"):
        return "swiglu"
    if stored.get("openai_gelu"):
        return "gelu_tanh"
    if stored.get("gated_linear_unit"):
        raise CheckpointError(f"checkpoint {where} uses a gated linear unit that is not SwiGLU; "
                              f"not supported.")
    return "gelu"


def model_fields(stored: dict, vocab_rows: int, where: str) -> dict:
    """GPTConfig fields (a dict) of the checkpoint's model; `vocab_rows`: the stored embedding's
    rows (Megatron-LM's padded vocabulary, all kept: the padding rows take part in its softmax)."""
    refuse_unsupported(stored, where)
    heads = stored["num_attention_heads"]
    groups = stored.get("num_query_groups") if stored.get("group_query_attention") else None
    fields = dict(
        num_layers=stored["num_layers"], hidden_size=stored["hidden_size"],
        num_attention_heads=heads, num_query_groups=groups or heads,
        ffn_hidden_size=stored.get("ffn_hidden_size"), kv_channels=stored.get("kv_channels"),
        vocab_size=vocab_rows,
        max_position_embeddings=_get(stored, "max_position_embeddings", stored.get("seq_length")),
        normalization=_get(stored, "normalization", "LayerNorm"),
        norm_epsilon=float(_get(stored, "norm_epsilon", _get(stored, "layernorm_epsilon", 1e-5))),
        activation=_activation(stored, where),
        position_embedding_type=_position_type(stored),
        rotary_base=float(_get(stored, "rotary_base", 10000)),
        rotary_percent=float(_get(stored, "rotary_percent", 1.0)),
        add_bias_linear=bool(_get(stored, "add_bias_linear", True)),
        add_qkv_bias=bool(_get(stored, "add_bias_linear", True) or stored.get("add_qkv_bias")),
        tie_embeddings=not stored.get("untie_embeddings_and_output_weights", False),
        qk_layernorm=bool(stored.get("qk_layernorm")),
        apply_layernorm_1p=bool(stored.get("apply_layernorm_1p")),
        attention_dropout=float(_get(stored, "attention_dropout", 0.1)),
        hidden_dropout=float(_get(stored, "hidden_dropout", 0.1)),
        init_method_std=float(_get(stored, "init_method_std", 0.02)),
        make_vocab_size_divisible_by=int(_get(stored, "make_vocab_size_divisible_by", 128)))
    if fields["position_embedding_type"] == "yarn":
        for name in ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings",
                     "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim"):
            if stored.get(name) is not None:
                fields[name] = stored[name]
    if stored.get("use_rope_scaling"):
        fields.update(use_rope_scaling=True,
                      rope_scaling_factor=float(_get(stored, "rope_scaling_factor", 8.0)))
    if stored.get("num_experts"):
        freq = _get(stored, "moe_layer_freq", 1)
        fields.update(num_experts=stored["num_experts"],
                      moe_ffn_hidden_size=_get(stored, "moe_ffn_hidden_size",
                                               stored.get("ffn_hidden_size")),
                      moe_router_topk=_get(stored, "moe_router_topk", 2),
                      moe_layer_freq=list(freq) if isinstance(freq, (list, tuple)) else int(freq),
                      moe_router_pre_softmax=bool(stored.get("moe_router_pre_softmax")),
                      moe_router_topk_scaling_factor=stored.get("moe_router_topk_scaling_factor"),
                      moe_aux_loss_coeff=float(_get(stored, "moe_aux_loss_coeff", 0.0)),
                      moe_z_loss_coeff=stored.get("moe_z_loss_coeff"),
                      moe_router_load_balancing_type=_get(stored, "moe_router_load_balancing_type",
                                                          "aux_loss"),
                      moe_expert_capacity_factor=stored.get("moe_expert_capacity_factor"))
    return {k: v for k, v in fields.items() if v is not None}


def args_for(config, *, tp: int, pp: int, padded_vocab_size: int, iteration: int,
             extra: dict | None = None) -> argparse.Namespace:
    """The Namespace a Megatron-LM run reads from a checkpoint of `config` (a GPTConfig) saved at
    tp x pp: the model arguments of --use-checkpoint-args and check_checkpoint_args."""
    c = config
    gqa = c.num_query_groups != c.num_attention_heads
    ns = dict(
        num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
        num_attention_heads=c.num_attention_heads, group_query_attention=gqa,
        num_query_groups=c.num_query_groups if gqa else 1, kv_channels=c.kv_channels,
        max_position_embeddings=c.max_position_embeddings,
        position_embedding_type=c.position_embedding_type, rotary_base=int(c.rotary_base)
        if float(c.rotary_base).is_integer() else c.rotary_base,
        rotary_percent=c.rotary_percent, use_rope_scaling=c.use_rope_scaling,
        rope_scaling_factor=c.rope_scaling_factor,
        normalization=c.normalization, norm_epsilon=c.norm_epsilon,
        swiglu=c.activation == "swiglu", openai_gelu=c.activation == "gelu_tanh",
        squared_relu=False, add_bias_linear=c.add_bias_linear, add_qkv_bias=bool(c.add_qkv_bias),
        untie_embeddings_and_output_weights=not c.tie_embeddings, qk_layernorm=c.qk_layernorm,
        apply_layernorm_1p=c.apply_layernorm_1p, add_position_embedding=True,
        attention_dropout=c.attention_dropout, hidden_dropout=c.hidden_dropout,
        init_method_std=c.init_method_std,
        make_vocab_size_divisible_by=c.make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab_size, vocab_size=c.vocab_size,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        num_experts=c.num_experts, iteration=iteration, use_legacy_models=False,
        consumed_train_samples=0, consumed_valid_samples=0)
    ns.update(extra or {})          # the MoE arguments: write.moe_args
    return argparse.Namespace(**ns)
