"""ParallelConfig: the parallel layout (tp, pp, Ulysses sp, Megatron's context parallelism, experts)
and how model state is sharded and reduced (docs/design.md §3, §11, §14)."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_sp.config.section import field_flag as _flag
from megatron_sp.config.section import resolve_fields as _resolve
from megatron_sp.errors import ConfigError


def _example_hierarchy(n: int) -> str:
    """A valid --hierarchical-context-parallel-sizes for --context-parallel-size n: "2 {n/2}"."""
    return f"2 {n // 2}" if n % 2 == 0 else f"1 {n}"


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel layout and how model state is sharded and reduced (docs/design.md §3, §11)."""

    tensor_model_parallel_size: int = 1
    """--tensor-model-parallel-size"""
    pipeline_model_parallel_size: int = 1
    """--pipeline-model-parallel-size"""
    sequence_parallel_size: int = 1
    """--sequence-parallel-size; set from the context-parallel flags under --cp-comm-type a2a or
    a2a+p2p (_resolve_context)."""
    sequence_parallel: bool = False
    """--sequence-parallel; False at tp 1, as Megatron-LM (nothing to shard)."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """--num-layers-per-virtual-pipeline-stage"""
    decoder_first_pipeline_num_layers: int | None = None
    """--decoder-first-pipeline-num-layers"""
    decoder_last_pipeline_num_layers: int | None = None
    """--decoder-last-pipeline-num-layers"""
    distributed_backend: str | None = None
    """--distributed-backend"""
    distributed_timeout_minutes: float = 10.0
    """--distributed-timeout-minutes"""
    use_distributed_optimizer: bool = False
    """--use-distributed-optimizer"""
    use_torch_fsdp2: bool = False
    """--use-torch-fsdp2"""
    optimizer_cpu_offload: bool = False
    """--optimizer-cpu-offload"""
    overlap_grad_reduce: bool = False
    """--overlap-grad-reduce"""
    overlap_param_gather: bool = False
    """--overlap-param-gather"""
    grad_bucket_size_mb: float = 25.0
    """--grad-bucket-size-mb"""
    grad_reduce_in_bf16: bool = False
    """--grad-reduce-in-bf16"""
    context_parallel_size: int = 1
    """--context-parallel-size"""
    cp_comm_type: str = "p2p"
    """--cp-comm-type"""
    hierarchical_context_parallel_sizes: tuple[int, ...] | None = None
    """--hierarchical-context-parallel-sizes"""
    context_parallel_layout: str = "balanced"
    """--context-parallel-layout"""
    expert_model_parallel_size: int = 1
    """--expert-model-parallel-size"""
    expert_tensor_parallel_size: int | None = None
    """--expert-tensor-parallel-size; None until GPTModel resolves it."""

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
