"""GPT model configuration: one validated dataclass for the GPT-2 and Llama families.

Field names follow Megatron-LM's flags (--num-layers -> num_layers, ...). `__post_init__` fills the
defaults Megatron derives (ffn size, kv channels, query groups) and refuses impossible values with one
sentence. Parallel divisibility (heads over tp*sp, ...) is checked by `check_parallel`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields


@dataclass
class GPTConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int                          # real vocabulary (tokenizer); padded separately
    num_query_groups: int | None = None      # GQA: key/value heads; None = multi-head attention
    ffn_hidden_size: int | None = None       # None: 4*H (gelu) or Megatron's SwiGLU rule
    kv_channels: int | None = None           # head dim d; None: H / heads
    max_position_embeddings: int = 2048
    normalization: str = "LayerNorm"         # LayerNorm | RMSNorm
    norm_epsilon: float = 1e-5
    activation: str = "gelu"                 # gelu (exact) | gelu_tanh (GPT-2, --openai-gelu) | swiglu
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope | yarn
    rotary_base: float = 10000.0
    add_bias_linear: bool = True
    add_qkv_bias: bool | None = None         # None: same as add_bias_linear
    tie_embeddings: bool = True              # Megatron ties unless --untie-embeddings-and-output-weights
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    # Model families (models/families.py); Megatron's names. See models/rope.py for the frequency rules.
    qk_layernorm: bool = False               # RMSNorm over head_dim on every q and k head (Qwen3)
    use_rope_scaling: bool = False           # Llama-3.1 rule (transformers' rope_type "llama3")
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    yarn_rotary_scaling_factor: float = 1.0  # position_embedding_type "yarn" (rope_type "yarn")
    yarn_original_max_position_embeddings: int | None = None   # None: max_position_embeddings
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True
    sliding_window: int | None = None        # a converted model's window (Mistral v0.1): attention
                                             # is full, so sequences longer than it are refused
    # Megatron-LM flags that change the math (docs/design.md §10).
    apply_layernorm_1p: bool = False         # norm weights stored as gamma - 1, applied as 1 + w
    rotary_percent: float = 1.0              # RoPE on the first int(d * rotary_percent) dims only
    # Mixture of experts (models/moe.py), Megatron-LM's MoE flags. num_experts None: dense MLPs.
    num_experts: int | None = None           # --num-experts
    moe_ffn_hidden_size: int | None = None   # --moe-ffn-hidden-size; None: ffn_hidden_size
    moe_router_topk: int = 2                 # --moe-router-topk
    moe_layer_freq: int | list = 1           # --moe-layer-freq: layer i is MoE if i % k == 0, or
                                             # a list of 0/1 per layer
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False     # sigmoid gate on the shared expert (Qwen2-MoE)
    moe_router_pre_softmax: bool = False     # softmax over all experts, then top-k
    moe_router_score_function: str = "softmax"   # softmax | sigmoid
    moe_router_topk_scaling_factor: float | None = None
    moe_norm_topk_prob: bool = False         # renormalise pre-softmax top-k weights (Qwen3-MoE)
    moe_aux_loss_coeff: float = 0.0          # --moe-aux-loss-coeff
    moe_z_loss_coeff: float | None = None    # --moe-z-loss-coeff
    moe_router_load_balancing_type: str = "aux_loss"   # aux_loss | seq_aux_loss | none
    moe_expert_capacity_factor: float | None = None    # None: no token dropping
    moe_pad_expert_input_to_capacity: bool = False      # every expert gets `capacity` rows

    def __post_init__(self):
        def positive(name):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "max_position_embeddings", "make_vocab_size_divisible_by"):
            positive(name)
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        positive("num_query_groups")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_query_groups={self.num_query_groups}: each key/value head must serve a whole "
                f"group of query heads.")
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}: set kv_channels (--kv-channels) explicitly.")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            if self.activation == "swiglu":   # Megatron: 2/3 of 4H, rounded down to a multiple of 64
                self.ffn_hidden_size = int(4 * self.hidden_size * 2 / 3 / 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.add_qkv_bias is None:
            self.add_qkv_bias = self.add_bias_linear
        choices = {"normalization": ("LayerNorm", "RMSNorm"),
                   "activation": ("gelu", "gelu_tanh", "swiglu"),
                   "position_embedding_type": ("learned_absolute", "rope", "yarn")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r} is not one of {allowed}.")
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"GPTConfig.{name} must be in [0, 1), got {getattr(self, name)}.")
        self._check_rope_scaling()
        self._check_moe()
        if not 0.0 < self.rotary_percent <= 1.0 or int(self.kv_channels * self.rotary_percent) < 2:
            raise ValueError(f"rotary_percent (--rotary-percent) must be in (0, 1] and leave at "
                             f"least 2 rotary dimensions of kv_channels={self.kv_channels}, got "
                             f"{self.rotary_percent}.")

    def _check_moe(self):
        if self.num_experts is None:
            return
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.activation != "swiglu":
            raise ValueError(f"num_experts (--num-experts) needs SwiGLU experts (--swiglu), got "
                             f"activation {self.activation!r}.")
        freq = self.moe_layer_freq
        if isinstance(freq, (list, tuple)):
            if len(freq) != self.num_layers or any(v not in (0, 1) for v in freq):
                raise ValueError(f"moe_layer_freq (--moe-layer-freq) as a list must give 0 or 1 "
                                 f"for each of the {self.num_layers} layers, got {list(freq)}.")
            self.moe_layer_freq = [int(v) for v in freq]
        elif isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
            raise ValueError(f"moe_layer_freq (--moe-layer-freq) must be a positive integer or a "
                             f"list of 0/1 per layer, got {freq!r}.")
        self.moe_config()                     # MoEConfig refuses bad values in one sentence

    def moe_config(self):
        """The MoE layers' models.moe.MoEConfig (None for a dense model)."""
        if self.num_experts is None:
            return None
        from .moe import MoEConfig
        return MoEConfig(
            num_experts=self.num_experts, moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            moe_router_topk=self.moe_router_topk,
            moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=self.moe_shared_expert_gate,
            moe_router_pre_softmax=self.moe_router_pre_softmax,
            moe_router_score_function=self.moe_router_score_function,
            moe_router_topk_scaling_factor=self.moe_router_topk_scaling_factor,
            moe_aux_loss_coeff=self.moe_aux_loss_coeff, moe_z_loss_coeff=self.moe_z_loss_coeff,
            moe_router_load_balancing_type=self.moe_router_load_balancing_type,
            moe_expert_capacity_factor=self.moe_expert_capacity_factor,
            moe_pad_expert_input_to_capacity=self.moe_pad_expert_input_to_capacity,
            norm_topk_prob=self.moe_norm_topk_prob)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether (global, 0-based) layer `layer` has experts instead of a dense MLP."""
        if self.num_experts is None:
            return False
        freq = self.moe_layer_freq
        return bool(freq[layer]) if isinstance(freq, list) else layer % freq == 0

    @property
    def rotary_dim(self) -> int:
        """The head dimensions RoPE's frequencies are built over (Megatron: int(d * percent))."""
        if self.rotary_percent < 1.0:
            return int(self.kv_channels * self.rotary_percent)
        return self.kv_channels

    def _check_rope_scaling(self):
        if self.use_rope_scaling and self.position_embedding_type != "rope":
            raise ValueError(f"use_rope_scaling (--use-rope-scaling) needs position_embedding_type "
                             f"'rope', got {self.position_embedding_type!r}.")
        if self.use_rope_scaling and not (self.rope_scaling_factor >= 1.0
                                          and self.rope_high_freq_factor > self.rope_low_freq_factor):
            raise ValueError(f"RoPE scaling needs rope_scaling_factor >= 1 and high_freq_factor > "
                             f"low_freq_factor, got {self.rope_scaling_factor}, "
                             f"{self.rope_high_freq_factor}, {self.rope_low_freq_factor}.")
        if self.position_embedding_type == "yarn" and self.yarn_rotary_scaling_factor <= 0:
            raise ValueError(f"yarn_rotary_scaling_factor (--yarn-rotary-scaling-factor) must be "
                             f"positive, got {self.yarn_rotary_scaling_factor}.")

    # Derived sizes -----------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.kv_channels

    @property
    def uses_rope(self) -> bool:
        """Rotary positions (plain, Llama-3.1-scaled or YaRN)."""
        return self.position_embedding_type in ("rope", "yarn")

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Vocabulary padded to a multiple of make_vocab_size_divisible_by * tp (Megatron)."""
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_parameters(self) -> int:
        """Parameter count with the unpadded vocabulary (embeddings counted once when tied)."""
        H, L, F, V, d = self.hidden_size, self.num_layers, self.ffn_hidden_size, self.vocab_size, self.kv_channels
        qkv = H * (self.num_attention_heads + 2 * self.num_query_groups) * d
        proj = self.num_attention_heads * d * H
        mlp = H * F * (3 if self.activation == "swiglu" else 2)
        norms = 2 * H * (2 if self.normalization == "LayerNorm" else 1)
        norms += 2 * d if self.qk_layernorm else 0
        biases = 0
        if self.add_bias_linear:
            biases += H + (2 * F if self.activation == "swiglu" else F) + H
        if self.add_qkv_bias:
            biases += (self.num_attention_heads + 2 * self.num_query_groups) * d
        per_layer = qkv + proj + mlp + norms + biases
        emb = V * H * (1 if self.tie_embeddings else 2)
        pos = self.max_position_embeddings * H if self.position_embedding_type == "learned_absolute" else 0
        final_norm = H * (2 if self.normalization == "LayerNorm" else 1)
        total = L * per_layer + emb + pos + final_norm
        if self.num_experts is not None:      # MoE layers: router + experts (+ shared) for the MLP
            experts = self.num_experts * 3 * H * self.moe_ffn_hidden_size + self.num_experts * H
            experts += 3 * H * (self.moe_shared_expert_intermediate_size or 0)
            experts += H if self.moe_shared_expert_gate else 0
            moe_layers = sum(self.is_moe_layer(i) for i in range(L))
            total += moe_layers * (experts - mlp)
        return total

    def num_routed_expert_parameters(self) -> int:
        """Parameters of the routed experts, every MoE layer's E x SwiGLU (3 H Fm each; 0 for a
        dense model): the part of num_parameters() expert parallelism splits over ep."""
        if self.num_experts is None:
            return 0
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.num_layers))
        return moe_layers * self.num_experts * 3 * self.hidden_size * self.moe_ffn_hidden_size

    def num_active_parameters(self) -> int:
        """Parameters one token passes through: num_parameters() with only moe_router_topk of the
        E routed experts of each MoE layer (the router and the shared expert count whole); equal
        to num_parameters() for a dense model."""
        if self.num_experts is None:
            return self.num_parameters()
        per_expert = self.num_routed_expert_parameters() // self.num_experts   # layers x 3 H Fm
        return self.num_parameters() - (self.num_experts - self.moe_router_topk) * per_expert

    def check_parallel(self, tp: int = 1, sp: int = 1, pp: int = 1,
                       sequence_parallel: bool = False) -> None:
        """Refuse (ValueError) a layout this model cannot be split into, naming the numbers
        (docs/design.md §3, §4). The head rules are megatron_sp.mesh's, said in field names; a
        plain ValueError, so that the CLI prefixes it with the model flags."""
        from megatron_sp.mesh import head_layout_problem   # torch-free until a layout is checked
        problem = head_layout_problem(self.num_attention_heads, self.num_query_groups, tp, sp,
                                      what="config")
        if problem:
            raise ValueError(problem)
        if self.num_experts is not None and tp > 1 and not sequence_parallel:
            raise ValueError(f"num_experts={self.num_experts} with tp={tp} needs "
                             f"--sequence-parallel: the MoE layers route each tp rank's own "
                             f"slice of the tokens (as Megatron-LM requires), so add "
                             f"--sequence-parallel or use tp 1.")
        F = self.ffn_hidden_size
        if F % tp:
            raise ValueError(f"ffn_hidden_size={F} is not divisible by tp={tp}.")
        if self.num_layers < pp:
            raise ValueError(f"num_layers={self.num_layers} is fewer than pipeline stages pp={pp}.")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _gpt2(layers, hidden, heads, vocab=50257):
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=vocab,
                max_position_embeddings=1024, normalization="LayerNorm", activation="gelu_tanh",
                position_embedding_type="learned_absolute", add_bias_linear=True, tie_embeddings=True)


def _llama(layers, hidden, heads, groups, ffn, vocab=128256, theta=500000.0, tied=False, max_pos=8192):
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                num_query_groups=groups, ffn_hidden_size=ffn, vocab_size=vocab,
                max_position_embeddings=max_pos, normalization="RMSNorm", norm_epsilon=1e-5,
                activation="swiglu", position_embedding_type="rope", rotary_base=theta,
                add_bias_linear=False, tie_embeddings=tied)


# Presets (--model NAME). Vocabulary sizes are the published tokenizers'; override with a tokenizer.
PRESETS: dict[str, dict] = {
    "gpt2-tiny": _gpt2(2, 128, 4, vocab=2048),
    "gpt2-small": _gpt2(12, 768, 12),
    "gpt2-medium": _gpt2(24, 1024, 16),
    "llama-tiny": _llama(4, 256, 8, 2, 688, vocab=2048, theta=10000.0, max_pos=2048),
    "llama-1b": _llama(16, 2048, 32, 8, 8192, tied=True, max_pos=131072),   # Llama-3.2-1B shapes
    "llama-8b": _llama(32, 4096, 32, 8, 14336, max_pos=131072),            # Llama-3.1-8B shapes
    "llama3-70b": _llama(80, 8192, 64, 8, 28672, max_pos=8192),             # Llama-3-70B shapes
}


def _qwen(layers, hidden, heads, groups, ffn, *, tied, qk_norm=True, qkv_bias=False, vocab=151936,
          max_pos=40960, head_dim=128):
    """Qwen3 (qk-norm, head_dim 128) and Qwen2.5 (qkv bias) shapes, as their config.json."""
    return dict(_llama(layers, hidden, heads, groups, ffn, vocab=vocab, theta=1000000.0, tied=tied,
                       max_pos=max_pos), norm_epsilon=1e-6, kv_channels=head_dim,
                qk_layernorm=qk_norm, add_qkv_bias=qkv_bias)


# The families users arrive with (models/families.py): published shapes of the Hugging Face checkpoints.
LLAMA31_ROPE = dict(use_rope_scaling=True, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                    rope_high_freq_factor=4.0, rope_original_max_position_embeddings=8192)
PRESETS.update({
    "qwen3-0.6b": _qwen(28, 1024, 16, 8, 3072, tied=True),
    "qwen3-4b": _qwen(36, 2560, 32, 8, 9728, tied=True),
    "qwen3-8b": _qwen(36, 4096, 32, 8, 12288, tied=False),
    "qwen2.5-7b": _qwen(28, 3584, 28, 4, 18944, tied=False, qk_norm=False, qkv_bias=True,
                        vocab=152064, max_pos=131072, head_dim=None),
    "llama3.1-8b": dict(PRESETS["llama-8b"], **LLAMA31_ROPE),
    "llama3.2-1b": dict(PRESETS["llama-1b"], **dict(LLAMA31_ROPE, rope_scaling_factor=32.0)),
    "mistral-7b": _llama(32, 4096, 32, 8, 14336, vocab=32768, theta=1000000.0, max_pos=32768),  # v0.3
    # Mixture of experts (router_aux_loss_coef is not a model field: pass --moe-aux-loss-coeff).
    # Qwen3-30B-A3B: every layer has experts (decoder_sparse_step 1, no mlp_only_layers), so
    # intermediate_size 6144 (ffn_hidden_size) is unused. Its routing, norm_topk_prob true (softmax
    # over the 128, top-8, renormalised), is Megatron's default softmax over the top-8 logits (the
    # same weights, and the flags printed by cli/model_flags.config_to_flags rebuild it; a converted checkpoint
    # says it as moe_router_pre_softmax + moe_norm_topk_prob instead).
    "qwen3-30b-a3b": dict(_qwen(48, 2048, 32, 4, 6144, tied=False), num_experts=128,
                          moe_ffn_hidden_size=768, moe_router_topk=8, moe_layer_freq=1),
    # Qwen1.5-MoE-A2.7B (qwen2_moe): 60 experts of 1408, top-4 of a softmax over all 60 without
    # renormalising (norm_topk_prob false: --moe-router-pre-softmax), and a shared expert of 5632
    # behind a per-token sigmoid gate in every layer; q/k/v bias, no qk-norm.
    "qwen1.5-moe-a2.7b": dict(_qwen(24, 2048, 16, 16, 5632, tied=False, qk_norm=False,
                                    qkv_bias=True, max_pos=8192, head_dim=None),
                              num_experts=60, moe_ffn_hidden_size=1408, moe_router_topk=4,
                              moe_layer_freq=1, moe_router_pre_softmax=True,
                              moe_shared_expert_intermediate_size=5632,
                              moe_shared_expert_gate=True),
    # Mixtral-8x7B v0.1: 8 experts of intermediate_size 14336 in every layer, top-2, no window.
    "mixtral-8x7b": dict(_llama(32, 4096, 32, 8, 14336, vocab=32000, theta=1000000.0,
                                max_pos=32768), num_experts=8, moe_ffn_hidden_size=14336,
                         moe_router_topk=2, moe_layer_freq=1),
})


def preset(name: str, **overrides) -> GPTConfig:
    """A preset config, with fields overridden (e.g. vocab_size from the tokenizer)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}.")
    return GPTConfig(**{**PRESETS[name], **overrides})
