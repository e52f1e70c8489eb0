"""The typed configuration of a run: frozen dataclasses, validated once, passed to the library.

Configuration travels as in torchtitan and Megatron core: the command line is parsed at the edge
(`megatron_sp.cli`: argparse with Megatron-LM's flag names, the mapping of Megatron-LM's other flags,
the embedded default run, --use-checkpoint-args), turned into one `JobConfig`, and never changed
afterwards. Everything past the edge (trainer, checkpointing, sharding, loss scaler, memory options,
profiler, ramp-up, FP8, model families) takes these sections instead of the argparse namespace.

Each field keeps its Megatron-LM flag's name (docs/design.md §10) and says which flag sets it. A
section checks its own rules in `__post_init__` with one sentence each (a ConfigError: what, where,
what to do); values that Megatron-LM derives from other flags (--global-batch-size from
--micro-batch-size, --train-iters from --train-samples, --lr-decay-iters from --train-iters, ...)
are filled in there too, so a section is complete once it exists. Rules that need the mesh or the
model (heads over tp x sp, layers over stages, the batch over dp) are checked where those exist
(megatron_sp.mesh.ParallelDims, the model config, the Trainer).

    job = JobConfig.from_flags({"micro_batch_size": 2, "global_batch_size": 8, "seq_length": 1024,
                                "tensor_model_parallel_size": 2, "bf16": True})
    job.training.global_batch_size, job.parallel.tensor_model_parallel_size, job.precision.bf16
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from megatron_sp.errors import ConfigError

NONFINITE_POLICIES = ("skip", "stop")


def _flag(name: str) -> str:
    """The command-line flag of a field: "train_iters" -> "--train-iters"."""
    return "--" + name.replace("_", "-")


def _resolve(section, **values) -> None:
    """Set fields while a frozen section is being built (__post_init__ only)."""
    for name, value in values.items():
        object.__setattr__(section, name, value)


def _example_hierarchy(n: int) -> str:
    """A valid --hierarchical-context-parallel-sizes for --context-parallel-size n: "2 {n/2}"."""
    return f"2 {n // 2}" if n % 2 == 0 else f"1 {n}"


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
class ParallelConfig:
    """The parallel layout and how model state is sharded and reduced (docs/design.md §3, §11)."""

    tensor_model_parallel_size: int = 1
    """--tensor-model-parallel-size: tensor-parallel ranks (tp)."""
    pipeline_model_parallel_size: int = 1
    """--pipeline-model-parallel-size: pipeline stages (pp)."""
    sequence_parallel_size: int = 1
    """--sequence-parallel-size: Ulysses sequence-parallel degree."""
    sequence_parallel: bool = False
    """--sequence-parallel: Megatron sequence sharding inside tensor parallelism."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """--num-layers-per-virtual-pipeline-stage: interleaved 1F1B: layers per virtual stage."""
    decoder_first_pipeline_num_layers: int | None = None
    """--decoder-first-pipeline-num-layers: layers of the first pipeline stage (uneven stages)."""
    decoder_last_pipeline_num_layers: int | None = None
    """--decoder-last-pipeline-num-layers: layers of the last pipeline stage (uneven stages)."""
    distributed_backend: str | None = None
    """--distributed-backend: nccl or gloo (default: nccl on GPU, gloo on CPU)."""
    distributed_timeout_minutes: float = 10.0
    """--distributed-timeout-minutes: a collective gives up (and the run stops) after this long."""
    use_distributed_optimizer: bool = False
    """--use-distributed-optimizer: ZeRO-1/2: shard the Adam state (and fp32 master weights of
    16-bit parameters) over the dp x sp ranks; gradients reduce-scattered, updated parameters
    all-gathered."""
    use_torch_fsdp2: bool = False
    """--use-torch-fsdp2: ZeRO-3 with torch's FSDP2: parameters, gradients and optimizer state
    sharded over the dp x sp ranks, one FSDP unit per transformer layer (all-gathered just
    before use, next layer prefetched), gradients reduce-scattered; with --bf16 the gathered
    parameters and the gradients on the wire are bf16 and the sharded master weights fp32."""
    optimizer_cpu_offload: bool = False
    """--optimizer-cpu-offload: keep the sharded state in (pinned) host memory and step the
    optimizer there: with --use-distributed-optimizer the master rows, their gradients and the
    Adam state; with --use-torch-fsdp2 the sharded parameters, gradients and optimizer state
    (CPUOffloadPolicy), the device holding only the layers in flight."""
    overlap_grad_reduce: bool = False
    """--overlap-grad-reduce: overlap the gradient reduction with backward (always on: buckets are
    launched from the gradient hooks of the last backward pass)."""
    overlap_param_gather: bool = False
    """--overlap-param-gather: distributed optimizer: launch the all-gathers of all buckets at once
    after the step (FSDP2 always prefetches the next layer's)."""
    grad_bucket_size_mb: float = 25.0
    """--grad-bucket-size-mb: size of the gradient buckets reduced during backward."""
    grad_reduce_in_bf16: bool = False
    """--grad-reduce-in-bf16: reduce gradients over dp x sp in bf16 on the wire (accumulated in
    fp32)."""
    context_parallel_size: int = 1
    """--context-parallel-size: Megatron-LM's context-parallel degree, the ranks one sequence is
    split over (how: cp_comm_type)."""
    cp_comm_type: str = "p2p"
    """--cp-comm-type: p2p (ring attention, Megatron's default), a2a (Ulysses), a2a+p2p (Ulysses
    inside x ring across) or allgather (refused)."""
    hierarchical_context_parallel_sizes: tuple[int, ...] | None = None
    """--hierarchical-context-parallel-sizes: a2a+p2p's Ulysses and ring degrees (A R)."""
    context_parallel_layout: str = "balanced"
    """--context-parallel-layout: which tokens each ring rank holds with packed documents:
    balanced (documents placed so every rank has the same causal attention work; docs/design.md
    §14) or zigzag (chunks r and 2cp-1-r of the row). Without documents both are the zigzag."""
    expert_model_parallel_size: int = 1
    """--expert-model-parallel-size: Megatron-LM's expert-parallel degree (ep): each MoE layer's
    experts split over ep consecutive ranks of a stage's (dp, cp, sp, tp) order, tokens dispatched
    by all-to-all; with --expert-tensor-parallel-size tp (the default) over dp x cp x sp only."""
    expert_tensor_parallel_size: int | None = None
    """--expert-tensor-parallel-size: tensor-parallel degree of the experts. tp (or unset, as in
    Megatron-LM; MoE under tp > 1 needs --sequence-parallel): the experts split over tp like the
    dense SwiGLU MLP, the tokens all-gathered over tp around them, ep over dp x cp x sp; 1: whole
    experts on each rank, each tp rank routing its own tokens, ep folded over tp too (Megatron's
    parallel folding). GPTModel resolves None."""

    def __post_init__(self):
        pp = self.pipeline_model_parallel_size
        if pp < 1:
            raise ConfigError(f"--pipeline-model-parallel-size must be >= 1, got {pp}.")
        for name in ("tensor_model_parallel_size", "sequence_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{_flag(name)} must be >= 1, got {getattr(self, name)}.")
        if pp == 1:
            for name in ("num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
                         "decoder_last_pipeline_num_layers"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{_flag(name)} needs --pipeline-model-parallel-size > 1.")
        # Layer split and micro-batch count are checked once the model and mesh are known
        # (megatron_sp.pipeline.partition), with the numbers.
        if self.use_torch_fsdp2 and self.use_distributed_optimizer:
            raise ConfigError("--use-torch-fsdp2 and --use-distributed-optimizer are two sharding "
                              "modes: choose one.")
        for name in ("optimizer_cpu_offload", "overlap_param_gather"):
            if getattr(self, name) and not self.sharded_state:
                raise ConfigError(f"{_flag(name)} acts on sharded model state: add "
                                  f"--use-distributed-optimizer or --use-torch-fsdp2.")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            _resolve(self, sequence_parallel=False)   # Megatron drops it at tp=1 too: nothing to shard
        ep = self.expert_model_parallel_size
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise ConfigError(f"--expert-model-parallel-size must be a positive integer, got {ep!r}.")
        size, tp = self.expert_tensor_parallel_size, self.tensor_model_parallel_size
        if size is not None and size not in (1, tp):
            raise ConfigError(f"--expert-tensor-parallel-size {size} must be 1 (whole experts) "
                              f"or --tensor-model-parallel-size {tp} (experts split over tp, the "
                              f"default): other sizes are not implemented yet.")
        self._resolve_context()

    def _resolve_context(self) -> None:
        """Megatron's context-parallel flags -> our Ulysses degree (sequence_parallel_size) and the
        ring degree (ring_size); docs/design.md §14."""
        n, kind, s = self.context_parallel_size, self.cp_comm_type, self.sequence_parallel_size
        sizes = self.hierarchical_context_parallel_sizes
        if sizes is not None:
            sizes = tuple(sizes)
            _resolve(self, hierarchical_context_parallel_sizes=sizes)
        if n < 1:
            raise ConfigError(f"--context-parallel-size must be >= 1, got {n}.")
        if self.context_parallel_layout not in ("balanced", "zigzag"):
            raise ConfigError(f"--context-parallel-layout {self.context_parallel_layout!r} is "
                              f"not a layout: use balanced or zigzag.")
        if sizes is not None and kind != "a2a+p2p":
            raise ConfigError(f"--hierarchical-context-parallel-sizes applies to --cp-comm-type "
                              f"a2a+p2p, not {kind}: add --cp-comm-type a2a+p2p or drop the sizes.")
        if kind == "allgather" and n > 1:
            raise ConfigError(f"--cp-comm-type allgather (Llama 3's key/value all-gather) is not "
                              f"implemented: use p2p (ring attention, the default), a2a (Ulysses) "
                              f"or a2a+p2p for --context-parallel-size {n}.")
        if kind == "a2a" and n > 1:
            if s not in (1, n):
                raise ConfigError(f"--context-parallel-size {n} and --sequence-parallel-size {s} "
                                  f"disagree; pass one of them.")
            _resolve(self, sequence_parallel_size=n)
        if sizes is not None and (len(sizes) != 2 or min(sizes) < 1):
            raise ConfigError(
                f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} must be two "
                f"positive integers A R (Ulysses ranks x ring ranks) whose product is "
                f"--context-parallel-size {n}; e.g. --hierarchical-context-parallel-sizes "
                f"{_example_hierarchy(n)}.")
        if kind == "a2a+p2p":
            if sizes is None or sizes[0] * sizes[1] != n:
                raise ConfigError(
                    f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A R with "
                    f"A x R = --context-parallel-size {n}, got {list(sizes) if sizes else 'none'}; "
                    f"e.g. --hierarchical-context-parallel-sizes {_example_hierarchy(n)}.")
            if s not in (1, sizes[0]):
                raise ConfigError(f"--sequence-parallel-size {s} and the Ulysses degree {sizes[0]} "
                                  f"of --hierarchical-context-parallel-sizes disagree; pass one of "
                                  f"them.")
            _resolve(self, sequence_parallel_size=sizes[0])

    @property
    def ring_size(self) -> int:
        """The ring degree of context parallelism (1: none): the mesh's cp axis."""
        n, kind = self.context_parallel_size, self.cp_comm_type
        if kind == "p2p":
            return n
        if kind == "a2a+p2p":
            return self.hierarchical_context_parallel_sizes[1]
        return 1

    def describe_context(self) -> str | None:
        """The start-up line saying how the context of a sequence is split, or None."""
        n, kind, s, r = (self.context_parallel_size, self.cp_comm_type,
                         self.sequence_parallel_size, self.ring_size)
        if n == 1 and r == 1:
            return None
        if kind == "a2a":
            return (f"> --context-parallel-size {n} --cp-comm-type a2a runs as Ulysses "
                    f"--sequence-parallel-size {n}: all-to-all of heads")
        ulysses = f"Ulysses all-to-all over {s} adjacent ranks x " if s > 1 else ""
        return (f"> --context-parallel-size {n} --cp-comm-type {kind}: {ulysses}ring attention over "
                f"{r} ranks (zigzag chunks): one sequence over {s * r} ranks")

    @property
    def sharded_state(self) -> bool:
        """Model state sharded over dp x sp (distributed optimizer or FSDP2), not replicated."""
        return self.use_distributed_optimizer or self.use_torch_fsdp2


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


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from and how samples are cut (docs/design.md §7)."""

    data_path: tuple[str, ...] | None = None
    """--data-path: dataset prefixes, optionally weighted: [w1] prefix1 [w2 prefix2 ...]."""
    split: str = "969,30,1"
    """--split: train,valid,test proportions of the documents, commas or slashes (Megatron's)."""
    data_cache_path: str | None = None
    """--data-cache-path: folder of the cached sample indices (default: next to the data)."""
    tokenizer_type: str | None = None
    """--tokenizer-type: the tokenizer the data was preprocessed with."""
    tokenizer_model: str | None = None
    """--tokenizer-model: its model file (.model) or Hugging Face folder."""
    vocab_file: str | None = None
    """--vocab-file: GPT2BPETokenizer: vocab.json."""
    merge_file: str | None = None
    """--merge-file: GPT2BPETokenizer: merges.txt."""
    trust_remote_code: bool = False
    """--trust-remote-code: a Hugging Face tokenizer folder may run its own code (auto_map)."""
    vocab_size: int | None = None
    """--vocab-size: vocabulary of the NullTokenizer."""
    reset_position_ids: bool = False
    """--reset-position-ids: positions restart after each end-of-document token."""
    reset_attention_mask: bool = False
    """--reset-attention-mask: attention never crosses an end-of-document token."""
    eod_mask_loss: bool = False
    """--eod-mask-loss: no loss on end-of-document tokens."""
    mock_data: bool = False
    """--mock-data: synthetic random tokens (tests and benchmarks)."""
    cache_dir: str | None = None
    """--cache-dir: where the embedded default corpus is built."""
    num_workers: int = 0
    """--num-workers: data loader worker processes."""
    dataloader_type: str = "single"
    """--dataloader-type: single: one pass in order; cyclic: epochs repeat, each shuffled."""

    def __post_init__(self):
        if self.data_path is not None:
            _resolve(self, data_path=tuple(self.data_path))
        self.split_weights()     # one sentence (DataError) for a --split that cannot be used

    def split_weights(self) -> list[float]:
        """--split as three non-negative weights, train, valid, test (commas or slashes, as
        Megatron-LM; a DataError naming the flag for anything else)."""
        from megatron_sp.data.builder import parse_split
        return parse_split(self.split)


@dataclass(frozen=True)
class TrainingConfig:
    """The batch, the length of training, the optimizer and its learning-rate schedule, evaluation
    and the non-finite policy."""

    micro_batch_size: int = 1
    """--micro-batch-size: samples per micro-batch per data-parallel rank."""
    global_batch_size: int | None = None
    """--global-batch-size: samples per optimizer step over all data-parallel ranks (default:
    --micro-batch-size x dp)."""
    seq_length: int | None = None
    """--seq-length: tokens per sample."""
    train_iters: int | None = None
    """--train-iters: optimizer steps to train (default 100 when --train-samples is not given)."""
    train_samples: int | None = None
    """--train-samples: samples to train, instead of --train-iters."""
    rampup_batch_size: tuple[int, ...] | None = None
    """--rampup-batch-size: the global batch grows from START by INCR over SAMPLES samples
    (Megatron's ramp-up)."""
    lr: float = 0.0003
    """--lr: peak learning rate."""
    min_lr: float = 0.0
    """--min-lr: learning rate at the end of the decay."""
    lr_warmup_iters: int = 0
    """--lr-warmup-iters: linear warm-up steps."""
    lr_warmup_fraction: float | None = None
    """--lr-warmup-fraction: warm-up as a fraction of --lr-decay-iters."""
    lr_decay_style: str = "linear"
    """--lr-decay-style: learning-rate decay after warm-up."""
    lr_decay_iters: int | None = None
    """--lr-decay-iters: steps of the decay, warm-up included (default --train-iters)."""
    lr_wsd_decay_iters: int | None = None
    """--lr-wsd-decay-iters: WSD: steps of the final linear decay."""
    lr_decay_samples: int | None = None
    """--lr-decay-samples: decay length in samples (with --train-samples)."""
    lr_warmup_samples: int = 0
    """--lr-warmup-samples: warm-up length in samples (with --train-samples)."""
    lr_wsd_decay_samples: int | None = None
    """--lr-wsd-decay-samples: WSD final decay in samples (with --train-samples)."""
    weight_decay: float = 0.01
    """--weight-decay: AdamW decoupled weight decay (not on norms and biases)."""
    clip_grad: float = 1.0
    """--clip-grad: clip the global gradient norm to this (0: no clipping)."""
    adam_beta1: float = 0.9
    """--adam-beta1: Adam beta1."""
    adam_beta2: float = 0.999
    """--adam-beta2: Adam beta2."""
    adam_eps: float = 1e-08
    """--adam-eps: Adam epsilon."""
    optimizer: str = "adam"
    """--optimizer: adam (AdamW) or sgd."""
    sgd_momentum: float = 0.9
    """--sgd-momentum: --optimizer sgd momentum (0.9)."""
    decoupled_lr: float | None = None
    """--decoupled-lr: peak learning rate of the embedding and output layer weights."""
    decoupled_min_lr: float | None = None
    """--decoupled-min-lr: their minimum learning rate (default --min-lr)."""
    calculate_per_token_loss: bool = False
    """--calculate-per-token-loss: the loss is the sum of per-token losses over the global batch's
    token count (always the case here)."""
    seed: int = 1234
    """--seed: seed of initialisation, data order and dropout."""
    eval_interval: int = 1000
    """--eval-interval: evaluate every N iterations."""
    eval_iters: int = 10
    """--eval-iters: batches per evaluation."""
    nonfinite_loss: str = "stop"
    """--nonfinite-loss: a NaN/inf loss or gradient norm: stop the run with the iteration (default,
    like Megatron's NaN check) or skip that optimizer step and count it in the log."""
    max_skipped_steps: int = 10
    """--max-skipped-steps: with --nonfinite-loss skip: stop the run (it diverged) after this many
    optimizer steps in a row were skipped; nothing is saved from the first one."""
    torch_compile: bool = False
    """--torch-compile: compile every transformer layer with torch.compile, one graph per layer as
    torchtitan compiles its blocks (megatron_sp/compile.py; ours, Megatron-LM has no such flag)."""
    torch_compile_backend: str = "inductor"
    """--torch-compile-backend: torch.compile backend: inductor, aot_eager (no code generation),
    eager (Dynamo only)."""

    def __post_init__(self):
        """Megatron-LM's defaults that follow from other flags, then its rules, one sentence each."""
        if self.rampup_batch_size is not None:
            _resolve(self, rampup_batch_size=tuple(self.rampup_batch_size))
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise ConfigError("--decoupled-min-lr needs --decoupled-lr (the embedding and "
                              "output layer's peak learning rate).")
        if self.global_batch_size is None:
            _resolve(self, global_batch_size=self.micro_batch_size)
        if self.train_iters is None:   # Megatron: --train-samples counts samples, a constant batch
            _resolve(self, train_iters=(self.train_samples // self.global_batch_size
                                        if self.train_samples is not None else 100))
        if self.lr_decay_iters is None:
            _resolve(self, lr_decay_iters=self.train_iters if self.train_iters else 1)
        if self.lr_warmup_fraction is not None:
            _resolve(self, lr_warmup_iters=int(self.lr_warmup_fraction * self.lr_decay_iters))
        if self.train_samples is None and self.lr_warmup_iters > self.lr_decay_iters:
            raise ConfigError(f"--lr-warmup-iters {self.lr_warmup_iters} is longer than the "
                              f"learning-rate decay, --lr-decay-iters {self.lr_decay_iters}"
                              + (" (which defaults to --train-iters)"
                                 if self.lr_decay_iters == self.train_iters else "")
                              + "; lower --lr-warmup-iters or raise --lr-decay-iters.")
        self._check_sample_schedule()
        if self.rampup_batch_size is not None and self.train_samples is not None:
            _resolve(self, train_iters=self.rampup().train_iters(self.train_samples))
        _resolve(self, eval_iters=max(self.eval_iters, 0))  # train_llama3.sh's -1: no evaluation
        if self.nonfinite_loss not in NONFINITE_POLICIES:
            raise ConfigError(f"--nonfinite-loss {self.nonfinite_loss!r} is not one of "
                              f"{NONFINITE_POLICIES}.")
        if self.max_skipped_steps < 1:
            raise ConfigError(f"--max-skipped-steps must be at least 1, got {self.max_skipped_steps}.")

    def _check_sample_schedule(self) -> None:
        """Megatron's rules for the sample flags; the ramp-up reaches --global-batch-size."""
        sample_flags = [f for f, v in (("--lr-decay-samples", self.lr_decay_samples),
                                       ("--lr-warmup-samples", self.lr_warmup_samples or None),
                                       ("--lr-wsd-decay-samples", self.lr_wsd_decay_samples))
                        if v is not None]
        if sample_flags and self.train_samples is None:
            raise ConfigError(f"{sample_flags[0]} counts the schedule in samples: it needs "
                              f"--train-samples instead of --train-iters (as Megatron-LM).")
        if self.rampup_batch_size is not None:
            start, incr, samples = self.rampup_batch_size
            gbs = self.global_batch_size
            if start <= 0 or incr <= 0 or samples < 0 or start > gbs or (gbs - start) % incr:
                raise ConfigError(f"--rampup-batch-size {start} {incr} {samples} does not reach "
                                  f"--global-batch-size {gbs}: START and INCR must be positive and "
                                  f"GLOBAL - START a multiple of INCR.")

    def rampup(self):
        """The batch-size ramp-up of --rampup-batch-size (megatron_sp.training.rampup), or None."""
        if self.rampup_batch_size is None:
            return None
        from megatron_sp.training.rampup import BatchSizeRampup
        return BatchSizeRampup(*self.rampup_batch_size, self.global_batch_size)

    def end_iteration(self, iteration: int = 0, consumed_samples: int = 0) -> int:
        """The iteration training stops at, from a run's state after --load: --train-iters, or
        with --train-samples the iterations that consume the samples still due (with another
        --global-batch-size or mid-ramp after a resume, as Megatron-LM's update_train_iters)."""
        if self.train_samples is None:
            return self.train_iters
        ramp = self.rampup()
        if ramp is not None:
            return iteration + ramp.train_iters(self.train_samples, consumed_samples)
        return iteration + max(0, self.train_samples - consumed_samples) // self.global_batch_size

    @property
    def counts_samples(self) -> bool:
        """True when the learning-rate schedule is counted in samples (a ramp-up or the
        --lr-*-samples flags; megatron_sp.training.rampup)."""
        return bool(self.rampup_batch_size) or self.lr_decay_samples is not None \
            or bool(self.lr_warmup_samples) or self.lr_wsd_decay_samples is not None


FP8_RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8", "rowwise", "rowwise_with_gw_hp")
"""--fp8-recipe's names: Megatron-LM's four, then torchao's rowwise ones."""


def check_fp8_recipe(recipe: str | None) -> None:
    """ConfigError (one sentence) for a --fp8-recipe that is not in FP8_RECIPES."""
    if recipe is not None and recipe not in FP8_RECIPES:
        raise ConfigError(f"--fp8-recipe {recipe} is not a recipe: use one of "
                          f"{', '.join(FP8_RECIPES)}.")


@dataclass(frozen=True)
class PrecisionConfig:
    """Mixed precision: bf16, fp16 with Megatron-LM's loss scaling, FP8 through Transformer Engine."""

    bf16: bool = False
    """--bf16: bf16 mixed precision (fp32 master weights)."""
    fp16: bool = False
    """--fp16: fp16 mixed precision (fp32 master weights) with Megatron's loss scaling (--loss-
    scale, --initial-loss-scale, ...)."""
    loss_scale: float | None = None
    """--loss-scale: --fp16: a static loss scale (default: dynamic loss scaling)."""
    initial_loss_scale: float = 4294967296.0
    """--initial-loss-scale: --fp16: the dynamic loss scale's start (2**32)."""
    min_loss_scale: float = 1.0
    """--min-loss-scale: --fp16: the dynamic loss scale's floor (1)."""
    loss_scale_window: float = 1000
    """--loss-scale-window: --fp16: steps without overflow before the scale doubles (1000)."""
    hysteresis: int = 2
    """--hysteresis: --fp16: overflows in a row before the scale halves (2)."""
    fp8_format: str | None = None
    """--fp8-format e4m3|hybrid: FP8 through Transformer Engine's fp8_autocast, or through torchao
    in the projections and MLP linears (megatron_sp.training.fp8; fp8_backend)."""
    fp8_recipe: str | None = None
    """--fp8-recipe: Megatron-LM's tensorwise|delayed|blockwise|mxfp8, or torchao's rowwise|
    rowwise_with_gw_hp; None: delayed under Transformer Engine, tensorwise through torchao."""
    fp8_backend: str | None = None
    """Which library runs --fp8-format: "transformer_engine" or "torchao" (the command line resolves
    it with megatron_sp.training.fp8.resolve_backend; None: Transformer Engine where installed)."""
    fp8_margin: int = 0
    """--fp8-margin: FP8 scales divided by 2^margin (both backends)."""
    fp8_interval: int = 1
    """--fp8-interval: deprecated by Transformer Engine 1.8 (passed to older versions)."""
    fp8_amax_history_len: int = 1
    """--fp8-amax-history-len: FP8 amax history length (Transformer Engine)."""
    fp8_amax_compute_algo: str = "most_recent"
    """--fp8-amax-compute-algo: FP8 amax from the history's most recent or max value."""
    fp8_param_gather: bool = False
    """--fp8-param-gather: build the Transformer Engine modules' weights in FP8 (fp8_model_init)."""

    def __post_init__(self):
        if self.fp16 and self.bf16:
            raise ConfigError("--fp16 and --bf16 contradict each other: pass one of them.")
        if self.fp16 and self.loss_scale is None:
            if not 0 < self.min_loss_scale <= self.initial_loss_scale:
                raise ConfigError(f"--min-loss-scale {self.min_loss_scale:g} must be positive "
                                  f"and at most --initial-loss-scale {self.initial_loss_scale:g}.")
            if self.hysteresis < 1 or self.loss_scale_window < 1:
                raise ConfigError("--hysteresis and --loss-scale-window must be at least 1.")
        if self.fp16 and self.loss_scale is not None and self.loss_scale <= 0:
            raise ConfigError(f"--loss-scale must be positive, got {self.loss_scale:g}.")
        if self.fp8_param_gather and self.fp8_format is None:
            raise ConfigError("--fp8-param-gather needs --fp8-format e4m3|hybrid.")
        check_fp8_recipe(self.fp8_recipe)
        if self.fp8_backend not in (None, "transformer_engine", "torchao"):
            raise ConfigError(f"FP8 backend {self.fp8_backend!r}: use transformer_engine or torchao.")

    @property
    def autocast_dtype(self):
        """The dtype of the forward's autocast (bf16 or fp16), or None for fp32."""
        import torch
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else None


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving, loading and the exit conditions (pre-emption signals, intervals, wall time)."""

    save: str | None = None
    """--save: checkpoint folder to save to."""
    load: str | None = None
    """--load: checkpoint folder to resume or start from."""
    save_interval: int | None = None
    """--save-interval: save every N iterations."""
    no_load_optim: bool = False
    """--no-load-optim: do not load optimizer state."""
    no_load_rng: bool = False
    """--no-load-rng: do not load RNG state."""
    finetune: bool = False
    """--finetune: load weights only, reset iteration."""
    use_checkpoint_args: bool = False
    """--use-checkpoint-args: take the model flags from the --load checkpoint's stored config
    (explicit model flags that differ are replaced, with a warning)."""
    exit_signal_handler: bool = False
    """--exit-signal-handler: save and exit on SIGTERM/SIGUSR1."""
    exit_interval: int | None = None
    """--exit-interval: save and exit at iteration N."""
    exit_duration_in_mins: float | None = None
    """--exit-duration-in-mins: save and exit after this much wall time."""
    async_save: bool = False
    """--async-save: write checkpoints in the background (published at the next save)."""
    ckpt_step: int | None = None
    """--ckpt-step: load this iteration of --load instead of the newest (Megatron's)."""
    no_verify_checkpoint: bool = False
    """--no-verify-checkpoint: do not check checkpoint files against the checksums recorded at save
    before loading them."""
    override_opt_param_scheduler: bool = False
    """--override-opt_param-scheduler: on resume, use the learning-rate schedule of the command
    line even where it differs from the checkpoint's (Megatron's)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """--use-checkpoint-opt_param-scheduler: on resume, use the checkpoint's learning-rate schedule
    instead of the command line's (Megatron's)."""
    no_save_optim: bool = False
    """--no-save-optim: checkpoints without optimizer state."""
    no_save_rng: bool = False
    """--no-save-rng: checkpoints without RNG state."""
    exit_on_missing_checkpoint: bool = False
    """--exit-on-missing-checkpoint: stop when --load holds no checkpoint."""
    ckpt_format: str | None = None
    """--ckpt-format: torch_dist (ours: DCP); others refused."""
    force_unlock: bool = False
    """--force-unlock: take the --save lock even when its record names another host (the operator
    is sure that run is gone; docs/checkpoints.md)."""
    overwrite_save: bool = False
    """--overwrite-save: start a new run into a --save that holds another run's checkpoints
    (without it such a run is refused; --load <save> resumes instead)."""
    skip_free_space_check: bool = False
    """--skip-free-space-check: start even when --save has less free space than one checkpoint."""

    def __post_init__(self):
        if self.load and self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                              "contradict each other: pass one of them.")


@dataclass(frozen=True)
class MemoryConfig:
    """Long-context memory techniques: recompute, tiled MLP, chunked loss, activation offload, and
    the memory report."""

    recompute_granularity: str | None = None
    """--recompute-granularity: activation recompute: full layers or the attention core
    (selective)."""
    recompute_method: str | None = None
    """--recompute-method: full recompute: uniform groups or the first N layers (block)."""
    recompute_num_layers: int | None = None
    """--recompute-num-layers: full+uniform: layers per checkpointed group; full+block: layers of
    each stage recomputed (default 1)."""
    mlp_tiles: int | str = "1"
    """--mlp-tiles: run the MLP over N sequence tiles recomputed in backward (or 'auto': ceil(ffn
    width / hidden), none under 2048 tokens), so the [s, ffn] intermediate never exists whole."""
    loss_chunks: int | str = "1"
    """--loss-chunks: output layer + cross entropy over N sequence chunks recomputed in backward
    (or 'auto': ceil(vocab / hidden), none under 2048 tokens), so the [s, vocab] logits never
    exist whole."""
    ulysses_head_chunks: int = 1
    """--ulysses-head-chunks: Ulysses attention over N head chunks in turn, each recomputed in
    backward (UPipe): one chunk's exchange buffers and q, k, v, out live at a time. N must fit
    the heads per sp rank (checked with the model at start-up)."""
    offload_activations: bool = False
    """--offload-activations: keep saved activations of the transformer layers (with full
    recompute: the checkpointed layer inputs) in pinned host memory until backward."""
    offload_pool_gb: float | None = None
    """--offload-pool-gb: GiB of the exact pinned host pool that holds the offloaded activations on
    CUDA (megatron_sp/memory/host_pool.py; default: the planner's count for this rank, with full
    recompute and no pipeline; 0: torch's pinned buffers, each rounded up to a power of two)."""
    report_memory: bool = False
    """--report-memory: print activation bytes saved for backward per rank and layer, peak device
    memory and the model-state bytes per rank (parameters, gradients, optimizer state on device
    and on host), with the log line."""

    def __post_init__(self):
        if self.recompute_granularity != "full" and (self.recompute_method is not None
                                                     or self.recompute_num_layers is not None):
            raise ConfigError("--recompute-method and --recompute-num-layers need "
                              "--recompute-granularity full.")
        for name in ("mlp_tiles", "loss_chunks"):
            value = getattr(self, name)
            if value != "auto" and not (str(value).isdigit() and int(value) >= 1):
                raise ConfigError(f"{_flag(name)} must be a positive integer or 'auto', got "
                                  f"{value!r}.")
            _resolve(self, **{name: value if value == "auto" else int(value)})
        chunks = self.ulysses_head_chunks
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ConfigError(f"--ulysses-head-chunks must be an integer >= 1, got {chunks!r}.")
        pool = self.offload_pool_gb
        if pool is not None and not 0 <= pool < math.inf:
            raise ConfigError(f"--offload-pool-gb must be a finite number of GiB >= 0 (0: torch's "
                              f"pinned buffers; leave it out for the planner's count), got "
                              f"{pool:g}.")


@dataclass(frozen=True)
class LoggingConfig:
    """The log line, metrics files, TensorBoard, wandb and the profiler."""

    log_interval: int = 10
    """--log-interval: print the log line every N iterations."""
    tensorboard_dir: str | None = None
    """--tensorboard-dir: write TensorBoard scalars here."""
    metrics_jsonl: str | None = None
    """--metrics-jsonl: write one JSON object per logged iteration here."""
    debug: bool = False
    """--debug: print the Python traceback with an error message (also MEGATRON_SP_DEBUG=1);
    without it a user error is one line."""
    log_throughput: bool = False
    """--log-throughput: TFLOP/s per GPU in the log line (always printed here)."""
    log_params_norm: bool = False
    """--log-params-norm: the parameters' global L2 norm in the log line."""
    log_num_zeros_in_grad: bool = False
    """--log-num-zeros-in-grad: the number of zero gradient entries in the log line."""
    log_timers_to_tensorboard: bool = False
    """--log-timers-to-tensorboard: timings to TensorBoard (they always go there)."""
    peak_tflops: float | None = None
    """--peak-tflops: device peak for MFU."""
    profile: bool = False
    """--profile: profile iterations --profile-step-start to --profile-step-end."""
    profile_step_start: int = 10
    """--profile-step-start: first profiled iteration."""
    profile_step_end: int = 12
    """--profile-step-end: iteration after the last profiled one."""
    use_pytorch_profiler: bool = False
    """--use-pytorch-profiler: --profile writes a torch.profiler trace to --tensorboard-dir (else
    it marks the nsys capture range on CUDA)."""
    wandb_project: str | None = None
    """--wandb-project: Weights & Biases project (needs wandb)."""
    wandb_exp_name: str | None = None
    """--wandb-exp-name: Weights & Biases run name."""
    wandb_save_dir: str | None = None
    """--wandb-save-dir: Weights & Biases folder."""

    def __post_init__(self):
        if self.profile and self.profile_step_end < self.profile_step_start:
            raise ConfigError(f"--profile-step-end {self.profile_step_end} is before "
                              f"--profile-step-start {self.profile_step_start}.")


SECTIONS = {"parallel": ParallelConfig, "model": ModelFlags, "data": DataConfig,
            "training": TrainingConfig, "precision": PrecisionConfig,
            "checkpoint": CheckpointConfig, "memory": MemoryConfig, "logging": LoggingConfig}


@dataclass(frozen=True)
class JobConfig:
    """One run: every section, the start-up notes, and the command line it was built from."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel layout and the sharding of model state."""
    model: ModelFlags = field(default_factory=ModelFlags)
    """The model flags (preset and overrides)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data, tokenizer and data loader."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Batch, length of training, optimizer, learning-rate schedule, evaluation."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """bf16 / fp16 / FP8."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Save, load and exit conditions."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Recompute, tiling, chunked loss, offload."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Log line, metrics, profiler."""
    notes: tuple[str, ...] = ()
    """Start-up notes on mapped and no-op Megatron-LM flags, said once by rank 0."""
    command_line: Mapping[str, Any] = field(default_factory=dict)
    """Every parsed flag as resolved at the edge, kept read-only for the record (a checkpoint's
    "args", wandb's config); the library reads the sections, never this."""

    def __post_init__(self):
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "command_line", MappingProxyType(dict(self.command_line)))
        self._check_training_split()

    def _check_training_split(self) -> None:
        """Training asked for (--train-iters > 0) needs documents: a --split whose first weight
        is 0 (e.g. 0,100,0) gives the training split none."""
        data, iters = self.data, self.training.train_iters
        if data.mock_data or not iters or data.split_weights()[0] > 0:
            return
        given = (f"--train-samples {self.training.train_samples}"
                 if self.training.train_samples is not None else f"--train-iters {iters}")
        raise ConfigError(f"--split {data.split} gives the training split a weight of 0 (no "
                          f"documents) but {given} asks for training; give the first weight a "
                          f"positive share (e.g. --split 969,30,1).")

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any], *, notes=(), strict: bool = True) -> "JobConfig":
        """Sort flat flag values ({"train_iters": 10, "bf16": True, ...}) into their sections.

        Each field name belongs to one section. strict: a name of no section is a TypeError (a
        typo in code); the command line passes strict=False, its Megatron-only flags being
        mapped or no-ops, and keeps them all in `command_line`.
        """
        known = {f.name: name for name, section in SECTIONS.items()
                 for f in dataclasses.fields(section)}
        unknown = sorted(set(flags) - set(known))
        if strict and unknown:
            raise TypeError(f"no config section has the field(s) {unknown}.")
        values = {name: {} for name in SECTIONS}
        for key, value in flags.items():
            if key in known:
                values[known[key]][key] = value
        sections = {name: SECTIONS[name](**values[name]) for name in SECTIONS}
        return cls(**sections, notes=notes, command_line=flags)

    def flags(self) -> dict[str, Any]:
        """The flat record of the run, as the command line's namespace held it (the checkpoint's
        "args"): every parsed flag, with the values the sections resolved."""
        record = dict(self.command_line)
        for name in SECTIONS:
            for key, value in dataclasses.asdict(getattr(self, name)).items():
                if key in record or not self.command_line:
                    record[key] = value
        record["megatron_notes"] = list(self.notes)
        return record
