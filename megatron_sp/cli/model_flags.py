"""Model flags and GPTConfig, both ways, at the command-line edge (the models know no flags): the
pretrain_gpt.py / Megatron-LM flags that rebuild a GPTConfig (what convert.py prints and
--use-checkpoint-args applies), and the GPTConfig fields of the families' flags and of the
vocabulary (pretrain_gpt.py's model_config).
"""
from __future__ import annotations

from megatron_sp.errors import ConfigError
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


def family_fields(model) -> dict:
    """GPTConfig fields of --qk-layernorm, --use-rope-scaling and the --yarn-* flags (`model`: the
    run's megatron_sp.config.ModelFlags)."""
    fields = {}
    if model.qk_layernorm:
        fields["qk_layernorm"] = True
    if model.use_rope_scaling:
        fields["use_rope_scaling"] = True
    names = ("rope_scaling_factor", "yarn_rotary_scaling_factor",
             "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
             "yarn_mscale", "yarn_mscale_all_dim")
    fields.update({n: getattr(model, n) for n in names if getattr(model, n) is not None})
    return fields


def model_vocab_size(data, vocab_size: int) -> int:
    """The tokenizer's vocabulary, or --vocab-size when larger (a converted checkpoint's embedding
    rows, e.g. Qwen's 151936 for a tokenizer of 151669 ids). `data`: a DataConfig."""
    if data.vocab_size is None or data.tokenizer_type in (None, "NullTokenizer") or data.mock_data:
        return vocab_size
    if data.vocab_size < vocab_size:
        raise ConfigError(f"--vocab-size {data.vocab_size} is smaller than the "
                          f"{data.tokenizer_type}'s {vocab_size} ids; leave it out or pass "
                          f"the checkpoint's vocabulary size.")
    return data.vocab_size
