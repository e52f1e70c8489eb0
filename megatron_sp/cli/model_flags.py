"""The pretrain_gpt.py / Megatron-LM flags that rebuild a GPTConfig: what convert.py prints and
--use-checkpoint-args applies (the command-line edge: the models know no flags).
"""
from __future__ import annotations

from megatron_sp.models.config import GPTConfig


def config_to_flags(config: GPTConfig) -> list[str]:
    """The pretrain_gpt.py / Megatron-LM flags that rebuild `config` (the vocabulary comes from the
    tokenizer). `convert.py` prints them; `--use-checkpoint-args` applies them from a checkpoint."""
    c = config
    flags = ["--num-layers", str(c.num_layers), "--hidden-size", str(c.hidden_size),
             "--num-attention-heads", str(c.num_attention_heads),
             "--ffn-hidden-size", str(c.ffn_hidden_size)]
    if c.num_query_groups != c.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(c.num_query_groups)]
    if c.kv_channels * c.num_attention_heads != c.hidden_size:
        flags += ["--kv-channels", str(c.kv_channels)]
    flags += ["--max-position-embeddings", str(c.max_position_embeddings),
              "--position-embedding-type", c.position_embedding_type]
    if c.position_embedding_type != "learned_absolute":
        flags += ["--rotary-base", f"{c.rotary_base:g}"]
    flags += ["--normalization", c.normalization, "--norm-epsilon", f"{c.norm_epsilon:g}"]
    flags += {"swiglu": ["--swiglu"], "gelu_tanh": ["--openai-gelu"]}.get(c.activation, [])
    if not c.add_bias_linear:
        flags.append("--disable-bias-linear")
        if c.add_qkv_bias:
            flags.append("--add-qkv-bias")
    if not c.tie_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    flags += ["--make-vocab-size-divisible-by", str(c.make_vocab_size_divisible_by),
              "--attention-dropout", f"{c.attention_dropout:g}",
              "--hidden-dropout", f"{c.hidden_dropout:g}", "--init-method-std", f"{c.init_method_std:g}"]
    if c.apply_layernorm_1p:
        flags.append("--apply-layernorm-1p")
    if c.rotary_percent != 1.0:
        flags += ["--rotary-percent", f"{c.rotary_percent:g}"]
    return flags + family_flags(c)   # --qk-layernorm, --use-rope-scaling, --yarn-*, MoE


def family_flags(config: GPTConfig) -> list[str]:
    """The flags of the families' features (--qk-layernorm, --use-rope-scaling, --yarn-*, and the
    --num-experts / --moe-* of the MoE families) that rebuild `config` on top of its shape flags
    (config_to_flags' flags of the plain model)."""
    c, flags = config, []
    if c.qk_layernorm:
        flags.append("--qk-layernorm")
    if c.use_rope_scaling:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", f"{c.rope_scaling_factor:g}"]
    if c.position_embedding_type == "yarn":
        for name in ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings",
                     "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim"):
            if getattr(c, name) is not None:
                flags += ["--" + name.replace("_", "-"), f"{getattr(c, name):g}"]
    if c.num_experts is not None:   # the converted families' MoE fields (moe_norm_topk_prob has no
        freq = c.moe_layer_freq     # flag: a preset carries it)
        flags += ["--num-experts", str(c.num_experts), "--moe-ffn-hidden-size",
                  str(c.moe_ffn_hidden_size), "--moe-router-topk", str(c.moe_router_topk),
                  "--moe-layer-freq", str(freq) if isinstance(freq, int)
                  else "[" + ",".join(str(v) for v in freq) + "]"]
        if c.moe_router_pre_softmax:
            flags.append("--moe-router-pre-softmax")
        if c.moe_pad_expert_input_to_capacity:
            flags.append("--moe-pad-expert-input-to-capacity")
        if c.moe_shared_expert_gate:
            flags.append("--moe-shared-expert-gate")
        if c.moe_shared_expert_intermediate_size:
            flags += ["--moe-shared-expert-intermediate-size",
                      str(c.moe_shared_expert_intermediate_size)]
        # the router and its losses (a resumed run keeps them under --use-checkpoint-args)
        if c.moe_router_score_function != "softmax":
            flags += ["--moe-router-score-function", c.moe_router_score_function]
        if c.moe_router_load_balancing_type != "aux_loss":
            flags += ["--moe-router-load-balancing-type", c.moe_router_load_balancing_type]
        for name in ("moe_router_topk_scaling_factor", "moe_z_loss_coeff",
                     "moe_expert_capacity_factor"):
            if getattr(c, name) is not None:
                flags += ["--" + name.replace("_", "-"), f"{getattr(c, name):g}"]
        if c.moe_aux_loss_coeff:
            flags += ["--moe-aux-loss-coeff", f"{c.moe_aux_loss_coeff:g}"]
    return flags
