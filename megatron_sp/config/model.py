"""ModelFlags: the model flags as given (a --model preset, the Megatron-LM flags that override it),
with Megatron-LM's --moe-layer-freq read safely (an int, or its list expression read with ast)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_sp.config.section import field_flag as _flag
from megatron_sp.config.section import resolve_fields as _resolve
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
    """--model"""
    num_layers: int | None = None
    """--num-layers"""
    hidden_size: int | None = None
    """--hidden-size"""
    ffn_hidden_size: int | None = None
    """--ffn-hidden-size"""
    num_attention_heads: int | None = None
    """--num-attention-heads"""
    group_query_attention: bool = False
    """--group-query-attention"""
    num_query_groups: int | None = None
    """--num-query-groups; 1 under --group-query-attention when not given (Megatron's)."""
    kv_channels: int | None = None
    """--kv-channels"""
    max_position_embeddings: int | None = None
    """--max-position-embeddings"""
    position_embedding_type: str | None = None
    """--position-embedding-type"""
    rotary_base: float | None = None
    """--rotary-base"""
    normalization: str | None = None
    """--normalization"""
    norm_epsilon: float | None = None
    """--norm-epsilon"""
    swiglu: bool = False
    """--swiglu"""
    openai_gelu: bool = False
    """--openai-gelu"""
    disable_bias_linear: bool = False
    """--disable-bias-linear"""
    add_qkv_bias: bool = False
    """--add-qkv-bias"""
    untie_embeddings_and_output_weights: bool = False
    """--untie-embeddings-and-output-weights"""
    make_vocab_size_divisible_by: int = 128
    """--make-vocab-size-divisible-by"""
    attention_dropout: float | None = None
    """--attention-dropout"""
    hidden_dropout: float | None = None
    """--hidden-dropout"""
    init_method_std: float | None = None
    """--init-method-std"""
    qk_layernorm: bool = False
    """--qk-layernorm"""
    use_rope_scaling: bool = False
    """--use-rope-scaling"""
    rope_scaling_factor: float | None = None
    """--rope-scaling-factor"""
    yarn_rotary_scaling_factor: float | None = None
    """--yarn-rotary-scaling-factor"""
    yarn_original_max_position_embeddings: int | None = None
    """--yarn-original-max-position-embeddings"""
    yarn_beta_fast: float | None = None
    """--yarn-beta-fast"""
    yarn_beta_slow: float | None = None
    """--yarn-beta-slow"""
    yarn_mscale: float | None = None
    """--yarn-mscale"""
    yarn_mscale_all_dim: float | None = None
    """--yarn-mscale-all-dim"""
    apply_layernorm_1p: bool = False
    """--apply-layernorm-1p"""
    rotary_percent: float = 1.0
    """--rotary-percent"""
    add_position_embedding: bool = True
    """--no-position-embedding"""
    attention_backend: str = "auto"
    """--attention-backend; auto, flash, te, unfused, sdpa or flex once cli/megatron_compat.py has
    mapped Megatron's names."""
    transformer_impl: str = "local"
    """--transformer-impl; local once cli/megatron_compat.py finds no Transformer Engine."""
    num_experts: int | None = None
    """--num-experts"""
    moe_ffn_hidden_size: int | None = None
    """--moe-ffn-hidden-size"""
    moe_router_topk: int | None = None
    """--moe-router-topk"""
    moe_layer_freq: int | tuple[int, ...] | str | None = None
    """--moe-layer-freq; k or a tuple of one 0/1 per layer once read (parse_moe_layer_freq)."""
    moe_shared_expert_intermediate_size: int | None = None
    """--moe-shared-expert-intermediate-size"""
    moe_shared_expert_gate: bool = False
    """--moe-shared-expert-gate"""
    moe_router_pre_softmax: bool = False
    """--moe-router-pre-softmax"""
    moe_router_score_function: str | None = None
    """--moe-router-score-function"""
    moe_router_topk_scaling_factor: float | None = None
    """--moe-router-topk-scaling-factor"""
    moe_aux_loss_coeff: float | None = None
    """--moe-aux-loss-coeff"""
    moe_z_loss_coeff: float | None = None
    """--moe-z-loss-coeff"""
    moe_router_load_balancing_type: str | None = None
    """--moe-router-load-balancing-type"""
    moe_expert_capacity_factor: float | None = None
    """--moe-expert-capacity-factor"""
    moe_pad_expert_input_to_capacity: bool = False
    """--moe-pad-expert-input-to-capacity"""
    moe_token_dispatcher_type: str | None = None
    """--moe-token-dispatcher-type"""
    moe_router_dtype: str | None = None
    """--moe-router-dtype"""
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
