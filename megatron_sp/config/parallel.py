"""ParallelConfig: the parallel layout (tp, pp, Ulysses sp, Megatron's context parallelism, experts)
and how model state is sharded and reduced (docs/design.md §3, §11, §14)."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_sp.config.section import _flag, _resolve
from megatron_sp.errors import ConfigError


def _example_hierarchy(n: int) -> str:
    """A valid --hierarchical-context-parallel-sizes for --context-parallel-size n: "2 {n/2}"."""
    return f"2 {n // 2}" if n % 2 == 0 else f"1 {n}"


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
