"""ModelFlags: the model flags as given (a --model preset and the Megatron-LM flags that override it),
with Megatron-LM's --moe-layer-freq read safely (an int, or its list expression read with ast)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_sp.config.section import _flag, _resolve
from megatron_sp.errors import ConfigError

# --moe-layer-freq: Megatron-LM's int, or its Python list expression ("([1]*3+[0]*1)*3").
MOE_LAYER_FREQ_LIMIT = 100_000           # entries: a list expression may not build more


def parse_moe_layer_freq(value) -> int | tuple[int, ...]:
    """--moe-layer-freq as given -> k (layer i has experts if i % k == 0) or one 0/1 per layer.

    The string form is read with the ast module, never evaluated: only list literals, integers,
    + and * (Megatron's "([1]*3+[0]*1)*3", "[1,0,1,0]"); anything else is a ConfigError."""
    if isinstance(value, bool):
        raise ConfigError(f"--moe-layer-freq must be a positive integer or a list of 0/1 per "
                          f"layer, got {value!r}.")
    if isinstance(value, int):
        result = value
    elif isinstance(value, (list, tuple)):
        result = list(value)
    else:
        import ast
        text = str(value).strip()
        try:
            result = _layer_freq_value(ast.parse(text, mode="eval").body)
        except (SyntaxError, ValueError, RecursionError):
            raise ConfigError(f"--moe-layer-freq {text!r} is not an integer or a list expression of "
                              f"0s and 1s (list literals, integers, + and * only, such as 2 or "
                              f"\"([1]*3+[0]*1)*3\").") from None
    if isinstance(result, int):
        if result < 1:
            raise ConfigError(f"--moe-layer-freq must be a positive integer or a list of 0/1 per "
                              f"layer, got {result}.")
        return result
    if not result or any(isinstance(v, bool) or v not in (0, 1) for v in result):
        raise ConfigError(f"--moe-layer-freq as a list must hold one 0 (dense) or 1 (experts) per "
                          f"layer, got {list(result)}.")
    return tuple(int(v) for v in result)


def _layer_freq_value(node):
    """An int or a list of ints from an ast node of list literals, ints, + and * (ValueError
    otherwise)."""
    import ast
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        items = [_layer_freq_value(e) for e in node.elts]
        if any(not isinstance(v, int) for v in items):
            raise ValueError("nested list")
        return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _layer_freq_value(node.left), _layer_freq_value(node.right)
        if isinstance(node.op, ast.Add):
            if isinstance(left, list) != isinstance(right, list):
                raise ValueError("list + int")
            result_len = len(left) + len(right) if isinstance(left, list) else 0
        else:
            if isinstance(left, list) and isinstance(right, list):
                raise ValueError("list * list")
            if isinstance(left, int) and isinstance(right, int):
                if abs(left) > MOE_LAYER_FREQ_LIMIT or abs(right) > MOE_LAYER_FREQ_LIMIT:
                    raise ValueError("too large")
                return left * right
            items, times = (left, right) if isinstance(left, list) else (right, left)
            result_len = len(items) * max(times, 0)
        if result_len > MOE_LAYER_FREQ_LIMIT:
            raise ValueError("too long")
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"{type(node).__name__} is not allowed")


def check_moe_layer_freq(freq, num_layers: int) -> None:
    """A --moe-layer-freq list must give each of the model's layers its 0/1 (ConfigError)."""
    if isinstance(freq, (list, tuple)) and len(freq) != num_layers:
        raise ConfigError(f"--moe-layer-freq gives {len(freq)} layers but the model has "
                          f"{num_layers} (--num-layers): give one 0 (dense) or 1 (experts) per "
                          f"layer, or an integer k (experts in every k-th layer).")


@dataclass(frozen=True)
class ModelFlags:
    """The model flags as given (a --model preset and the Megatron-LM flags that override it); the
    edge turns them into the model's own config."""

    model: str | None = None
    """--model: preset: gpt2-tiny, gpt2-small, gpt2-medium, llama-tiny, llama-1b, llama-8b,
    llama3.1-8b, llama3.2-1b, qwen3-0.6b, qwen3-4b, qwen3-8b, qwen2.5-7b, mistral-7b (flags
    below override its fields)."""
    num_layers: int | None = None
    """--num-layers: transformer layers."""
    hidden_size: int | None = None
    """--hidden-size: hidden size H."""
    ffn_hidden_size: int | None = None
    """--ffn-hidden-size: MLP hidden size (default 4H, or Megatron's SwiGLU rule)."""
    num_attention_heads: int | None = None
    """--num-attention-heads: query heads."""
    group_query_attention: bool = False
    """--group-query-attention: use grouped-query attention (--num-query-groups)."""
    num_query_groups: int | None = None
    """--num-query-groups: key/value heads (GQA)."""
    kv_channels: int | None = None
    """--kv-channels: head dimension (default H / heads)."""
    max_position_embeddings: int | None = None
    """--max-position-embeddings: positions of the learned embedding (defaults to --seq-length)."""
    position_embedding_type: str | None = None
    """--position-embedding-type: learned absolute positions, RoPE or YaRN-scaled RoPE."""
    rotary_base: float | None = None
    """--rotary-base: RoPE base theta."""
    normalization: str | None = None
    """--normalization: LayerNorm or RMSNorm."""
    norm_epsilon: float | None = None
    """--norm-epsilon: epsilon of the norms."""
    swiglu: bool = False
    """--swiglu: SwiGLU MLP."""
    openai_gelu: bool = False
    """--openai-gelu: tanh-approximated GeLU (GPT-2)."""
    disable_bias_linear: bool = False
    """--disable-bias-linear: no biases in linear layers."""
    add_qkv_bias: bool = False
    """--add-qkv-bias: bias in the QKV projection even with --disable-bias-linear."""
    untie_embeddings_and_output_weights: bool = False
    """--untie-embeddings-and-output-weights: separate output layer."""
    make_vocab_size_divisible_by: int = 128
    """--make-vocab-size-divisible-by: pad the vocabulary to a multiple of this times tp."""
    attention_dropout: float | None = None
    """--attention-dropout: dropout on attention probabilities (Megatron's 0.1 without --model)."""
    hidden_dropout: float | None = None
    """--hidden-dropout: dropout on the residual branches (Megatron's 0.1 without --model)."""
    init_method_std: float | None = None
    """--init-method-std: standard deviation of the normal initialisation."""
    qk_layernorm: bool = False
    """--qk-layernorm: normalise every query and key head over head_dim (Qwen3)."""
    use_rope_scaling: bool = False
    """--use-rope-scaling: Llama-3.1 RoPE frequency scaling (low/high frequency factors 1/4,
    original context 8192)."""
    rope_scaling_factor: float | None = None
    """--rope-scaling-factor: Llama-3.1 RoPE scaling factor (8)."""
    yarn_rotary_scaling_factor: float | None = None
    """--yarn-rotary-scaling-factor: YaRN factor."""
    yarn_original_max_position_embeddings: int | None = None
    """--yarn-original-max-position-embeddings: YaRN: the context before extension (default --max-
    position-embeddings)."""
    yarn_beta_fast: float | None = None
    """--yarn-beta-fast: YaRN beta_fast (32)."""
    yarn_beta_slow: float | None = None
    """--yarn-beta-slow: YaRN beta_slow (1)."""
    yarn_mscale: float | None = None
    """--yarn-mscale: YaRN mscale (1)."""
    yarn_mscale_all_dim: float | None = None
    """--yarn-mscale-all-dim: YaRN mscale_all_dim (0)."""
    apply_layernorm_1p: bool = False
    """--apply-layernorm-1p: norm weights stored zero-centred (gamma - 1, initialised to 0) and
    applied as 1 + w."""
    rotary_percent: float = 1.0
    """--rotary-percent: RoPE on the first int(head_dim * percent) dimensions only (1.0)."""
    add_position_embedding: bool = True
    """--no-position-embedding: no learned position embedding (with --position-embedding-type rope,
    already the case)."""
    attention_backend: str = "auto"
    """--attention-backend: Megatron's auto, flash, fused (TE), unfused (two matmuls: short
    sequences), local (SDPA); ours te, flash-attn, sdpa, flex (FlexAttention). Resolved by
    cli/megatron_compat.py: Megatron's flash / fused become sdpa when their package is missing."""
    transformer_impl: str = "local"
    """--transformer-impl: local: these layers; transformer_engine: Transformer Engine's fused
    attention (runs as local, said at start-up, when it is not installed)."""
    num_experts: int | None = None
    """--num-experts: experts of each mixture-of-experts layer (None: a dense model)."""
    moe_ffn_hidden_size: int | None = None
    """--moe-ffn-hidden-size: hidden size of each expert's SwiGLU MLP (default --ffn-hidden-size)."""
    moe_router_topk: int | None = None
    """--moe-router-topk: experts each token is routed to (Megatron's default 2)."""
    moe_layer_freq: int | tuple[int, ...] | str | None = None
    """--moe-layer-freq: experts in every k-th layer (layer i if i % k == 0; default 1: all), or
    Megatron's list of 0/1 per layer, e.g. "([1]*3+[0]*1)*3" (read with ast: list literals,
    integers, + and * only)."""
    moe_shared_expert_intermediate_size: int | None = None
    """--moe-shared-expert-intermediate-size: hidden size of the shared expert every token also
    goes through (None: no shared expert)."""
    moe_shared_expert_gate: bool = False
    """--moe-shared-expert-gate: the shared expert's output times sigmoid(x . g) per token
    (Qwen2-MoE's shared_expert_gate; Megatron-core's moe_shared_expert_gate)."""
    moe_router_pre_softmax: bool = False
    """--moe-router-pre-softmax: softmax over all experts before the top-k (default: top-k of the
    logits, then softmax over the k)."""
    moe_router_score_function: str | None = None
    """--moe-router-score-function: softmax (default) or sigmoid router scores."""
    moe_router_topk_scaling_factor: float | None = None
    """--moe-router-topk-scaling-factor: the routing weights of the top-k times this."""
    moe_aux_loss_coeff: float | None = None
    """--moe-aux-loss-coeff: weight of the load-balancing loss (default 0: none)."""
    moe_z_loss_coeff: float | None = None
    """--moe-z-loss-coeff: weight of the router z-loss (default: none)."""
    moe_router_load_balancing_type: str | None = None
    """--moe-router-load-balancing-type: aux_loss (default: over the micro-batch), seq_aux_loss
    (per sequence) or none."""
    moe_expert_capacity_factor: float | None = None
    """--moe-expert-capacity-factor: each expert takes at most capacity_factor x tokens x topk /
    experts tokens, the others are dropped (default: no dropping)."""
    moe_pad_expert_input_to_capacity: bool = False
    """--moe-pad-expert-input-to-capacity: with --moe-expert-capacity-factor, every expert's input
    padded with zero rows to its capacity (static shapes; the same outputs)."""
    moe_token_dispatcher_type: str | None = None
    """--moe-token-dispatcher-type: alltoall or allgather, accepted: one rank holds every expert
    and permutes its tokens locally (no dispatch communication)."""
    moe_router_dtype: str | None = None
    """--moe-router-dtype: fp32 only: the router always runs in fp32."""
    checkpoint_vocab_size: int | None = None
    """Not a flag: the vocabulary of the --load checkpoint's model under --use-checkpoint-args."""

    def __post_init__(self):
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ConfigError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}.")
        if self.group_query_attention and self.num_query_groups is None:
            _resolve(self, num_query_groups=1)      # Megatron's default number of query groups
        self._check_moe()

    # The MoE flags that name a value; giving one of them needs a model with experts.
    MOE_FLAGS = ("moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq",
                 "moe_shared_expert_intermediate_size", "moe_router_pre_softmax",
                 "moe_router_score_function", "moe_router_topk_scaling_factor",
                 "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_load_balancing_type",
                 "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity",
                 "moe_shared_expert_gate")

    def moe_flags_given(self) -> list[str]:
        """The --moe-* flags of the model that were given (their command-line names)."""
        return [_flag(n) for n in self.MOE_FLAGS if getattr(self, n) not in (None, False)]

    def _check_capacity(self) -> None:
        """A capacity factor over num_experts / topk is no capacity: an expert's capacity
        (factor x tokens x topk / experts, of a rank's tokens) is then over the tokens it can
        receive, so nothing is dropped, and padding to it allocates that many rows (1e9: TB)."""
        factor, experts = self.moe_expert_capacity_factor, self.num_experts
        topk = self.moe_router_topk or 2                   # Megatron-LM's default top-k
        if factor is None or experts is None or factor * topk <= experts:
            return
        bound = experts / topk
        raise ConfigError(f"--moe-expert-capacity-factor {factor:g} is no capacity: with "
                          f"{experts} experts and top-{topk} routing a factor of {bound:g} "
                          f"already lets an expert take every token of a rank, so nothing is "
                          f"dropped (and padding to it only adds zero rows); leave the flag out "
                          f"for no dropping, or give a factor <= {bound:g}.")

    def _check_moe(self) -> None:
        """Megatron-LM's MoE flags at the edge, one sentence each (the model's own rules: MoEConfig)."""
        for name in ("num_experts", "moe_ffn_hidden_size", "moe_router_topk",
                     "moe_shared_expert_intermediate_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{_flag(name)} must be a positive integer, got {value}.")
        k, n = self.moe_router_topk, self.num_experts
        if k is not None and n is not None and k > n:
            raise ConfigError(f"--moe-router-topk {k} exceeds --num-experts {n}: a token cannot "
                              f"go to more experts than there are.")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < math.inf:
                raise ConfigError(f"{_flag(name)} must be >= 0 and finite, got {value:g}.")
        for name in ("moe_router_topk_scaling_factor", "moe_expert_capacity_factor"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise ConfigError(f"{_flag(name)} must be > 0 and finite, got {value:g}.")
        self._check_capacity()
        if self.moe_layer_freq is not None:
            freq = parse_moe_layer_freq(self.moe_layer_freq)
            if self.num_layers is not None:
                check_moe_layer_freq(freq, self.num_layers)
            _resolve(self, moe_layer_freq=freq)
        if self.moe_router_dtype not in (None, "fp32"):
            raise ConfigError(f"--moe-router-dtype {self.moe_router_dtype}: the router always runs "
                              f"in fp32 here; pass fp32 or leave the flag out.")
        dispatcher = self.moe_token_dispatcher_type
        if dispatcher not in (None, "alltoall", "allgather"):
            raise ConfigError(f"--moe-token-dispatcher-type {dispatcher} is not one of alltoall, "
                              f"allgather (one rank holds every expert and permutes its tokens "
                              f"locally either way); pass one of them or leave the flag out.")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise ConfigError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size: "
                              "there is no shared expert to gate without it.")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ConfigError("--moe-pad-expert-input-to-capacity needs "
                              "--moe-expert-capacity-factor, as in Megatron-LM: there is no "
                              "capacity to pad to without it.")
        if dispatcher == "allgather" and self.moe_expert_capacity_factor is not None:
            raise ConfigError("--moe-expert-capacity-factor needs --moe-token-dispatcher-type "
                              "alltoall, as in Megatron-LM: pass alltoall or drop the capacity "
                              "factor.")
