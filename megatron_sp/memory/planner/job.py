"""The job and the machine the planner sizes: `Workload` (one optimizer step apart from the model)
and `Hardware` (GPUs, nodes, bandwidths), and the small helpers every room shares
(docs/design.md §9, §11)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from megatron_sp.attention.kernels import DEVICES, check_device
from megatron_sp.memory.options import MemoryOptions
from megatron_sp.mesh import ParallelDims

__all__ = ["DEVICES", "GiB", "Hardware", "Workload", "check_device", "divisors"]

GiB = 2 ** 30


def _check_int(value, what: str, low: int) -> None:
    """ValueError (one sentence) unless `value` is an integer >= low."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}.")


# FP8 through torchao, as the planner models it (megatron_sp/memory/planner/fp8.py).
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def check_fp8(fmt, recipe) -> None:
    """ValueError (one sentence) for a format or recipe the torchao path does not run."""
    if fmt is not None and fmt not in FP8_FORMATS:
        raise ValueError(f"FP8 format {fmt!r} (--fp8-format) is not one of {FP8_FORMATS}.")
    if recipe not in FP8_RECIPES:
        raise ValueError(f"FP8 recipe {recipe!r} (--fp8-recipe) is not one of {FP8_RECIPES} "
                         f"(torchao's, the ones the planner models).")

@dataclass(frozen=True)
class Workload:
    """One optimizer step apart from the model: global_batch sequences of seq tokens, in micro-
    batches of micro_batch; dtype_bytes, the element size of what the matmuls keep (2: bf16
    autocast); memory, the techniques (recompute, MLP tiles, loss chunks, activation offload);
    sequence_parallel, Megatron's tp sequence sharding (--sequence-parallel); documents, packed
    documents (--reset-attention-mask: segments, whose one memory term is plan_index_bytes);
    head_chunks, the Ulysses head chunks the planner may add to memory (--ulysses-head-chunks):
    "auto" the smallest that fits when nothing cheaper does, an integer just that one (1: none);
    expert_parallel_size, a mixture-of-experts model's --expert-model-parallel-size: None lets
    the planner choose (expert_parallel_choices), an integer fixes it; fp8_format, --fp8-format
    (None: no FP8) with fp8_recipe, torchao's --fp8-recipe: the projections and dense MLP in FP8
    (planner/fp8.py). A ring's packed documents (planner/cp_balance.py): context_parallel_layout,
    --context-parallel-layout (balanced or zigzag); document_lengths, the documents' lengths in
    corpus order (tokens), whose cp_work_balance the planner estimates for each ring, or
    cp_work_balance, that figure stated (>= 1; e.g. a run's logged one); neither: balanced. Both
    need documents."""
    seq: int
    global_batch: int = 1
    micro_batch: int = 1
    dtype_bytes: int = 2
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    sequence_parallel: bool = False
    documents: bool = False
    head_chunks: int | str = "auto"
    expert_parallel_size: int | None = None
    fp8_format: str | None = None
    fp8_recipe: str = "tensorwise"
    context_parallel_layout: str = "balanced"
    document_lengths: tuple | None = None
    cp_work_balance: float | None = None

    def __post_init__(self):
        check_fp8(self.fp8_format, self.fp8_recipe)
        self._check_documents()
        if self.fp8_format is not None and self.head_chunks not in ("auto", 1):
            raise ValueError(f"Workload.head_chunks {self.head_chunks} (--ulysses-head-chunks) "
                             f"with fp8_format (--fp8-format): the FP8 linears refuse head "
                             f"chunks; leave one of the two out.")
        for name, flag, low in (("seq", "--seq-length", 0), ("global_batch", "--global-batch-size", 1),
                                ("micro_batch", "--micro-batch-size", 1)):
            _check_int(getattr(self, name), f"Workload.{name} ({flag})", low)
        if self.global_batch % self.micro_batch:
            raise ValueError(f"Workload.global_batch {self.global_batch} (--global-batch-size) is "
                             f"not a multiple of micro_batch {self.micro_batch} "
                             f"(--micro-batch-size): no layout can split it into micro-batches.")

    def _check_documents(self) -> None:
        """ValueError (one sentence) for a ring layout, document lengths or balance figure the
        planner cannot use; the lengths kept as a tuple."""
        from megatron_sp.context_parallel.balance import LAYOUTS
        if self.context_parallel_layout not in LAYOUTS:
            raise ValueError(f"Workload.context_parallel_layout {self.context_parallel_layout!r} "
                             f"(--context-parallel-layout) is not one of {LAYOUTS}.")
        lengths, balance = self.document_lengths, self.cp_work_balance
        if lengths is not None and balance is not None:
            raise ValueError("Workload.document_lengths and cp_work_balance both given: state the "
                             "documents' lengths or the balance figure, not both.")
        if (lengths is not None or balance is not None) and not self.documents:
            raise ValueError("Workload.document_lengths / cp_work_balance describe packed "
                             "documents: set documents (--reset-attention-mask) too.")
        if balance is not None and (isinstance(balance, bool)
                                    or not isinstance(balance, numbers.Real)
                                    or not 1 <= balance < math.inf):
            raise ValueError(f"Workload.cp_work_balance (--cp-work-balance) is the slowest ring "
                             f"rank's work over the mean, a finite number >= 1, got {balance!r}.")
        if lengths is not None:
            lengths = tuple(lengths)
            if not lengths or any(isinstance(m, bool) or not isinstance(m, numbers.Integral)
                                  or m < 1 for m in lengths):
                raise ValueError("Workload.document_lengths must be a non-empty sequence of "
                                 "positive integer token counts.")
            object.__setattr__(self, "document_lengths", tuple(int(m) for m in lengths))

    def tokens_per_rank(self, sp: int) -> float:
        """T = b*s/sp: the tokens of one micro-batch each rank holds outside attention, sp the
        ranks one sequence is split over (sp*cp with a ring: pass ParallelDims.context)."""
        return self.micro_batch * self.seq / sp

    def micro_batches(self, dp: int) -> int:
        """Micro-batches per step on each data-parallel rank."""
        return self.global_batch // (self.micro_batch * dp)

    def in_flight(self, dims: ParallelDims) -> int:
        """Micro-batches 1F1B keeps in flight on the first stage: min(pp, micro-batches), >= 1."""
        return max(1, min(dims.pp, self.micro_batches(dims.dp)))


@dataclass(frozen=True)
class Hardware:
    """The machine: num_gpus of gpu_mem_gb (GiB) each, gpus_per_node to a node with host_memory_gb
    (of which host_reserve_fraction is left to the OS, data loader and page cache); the device
    reserve, reserve_gb (CUDA context, NCCL and cuBLAS workspaces) + fragmentation x the modelled
    bytes; bandwidths in GB/s per GPU (NVLink inside a node, the network across, PCIe to the host);
    bf16 dense peak_tflops (fp8_peak_tflops: FP8's, H100/H200 1979) at an assumed mfu; device, whose
    kernels the activation model counts
    ("cuda" or "cpu": torch's RMSNorm, see fused_rms_norm)."""
    num_gpus: int
    gpu_mem_gb: float = 80.0
    gpus_per_node: int = 8
    host_memory_gb: float = 2048.0
    host_reserve_fraction: float = 0.10
    reserve_gb: float = 4.0
    fragmentation: float = 0.10
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    pcie_gbps: float = 25.0
    peak_tflops: float = 989.0
    fp8_peak_tflops: float = 1979.0
    mfu: float = 0.4
    device: str = "cuda"

    def __post_init__(self):
        check_device(self.device)
        _check_int(self.num_gpus, "Hardware.num_gpus (--num-gpus)", 1)
        _check_int(self.gpus_per_node, "Hardware.gpus_per_node (--gpus-per-node)", 1)
        for name in ("gpu_mem_gb", "host_memory_gb", "intra_node_gbps", "inter_node_gbps",
                     "pcie_gbps", "peak_tflops", "fp8_peak_tflops"):
            value = getattr(self, name)
            ample = name == "host_memory_gb" and value == math.inf   # binding_limit's "ample"
            if not (0 < value < math.inf or ample):
                raise ValueError(f"Hardware.{name} must be a positive finite number, got "
                                 f"{value!r}.")
        for name, low_open in (("mfu", True), ("fragmentation", False),
                               ("host_reserve_fraction", False)):
            value = getattr(self, name)
            if not ((0 < value <= 1) if low_open else (0 <= value < 1)):
                raise ValueError(f"Hardware.{name} is a fraction in "
                                 f"{'(0, 1]' if low_open else '[0, 1)'}, got {value!r}.")
        if not 0 <= self.reserve_gb < math.inf:
            raise ValueError(f"Hardware.reserve_gb must be a finite number >= 0, got "
                             f"{self.reserve_gb!r}.")

    @property
    def ranks_per_node(self) -> int:
        return min(self.num_gpus, self.gpus_per_node)

    @property
    def host_budget_gb(self) -> float:
        """Host memory per node the planner may fill."""
        return self.host_memory_gb * (1 - self.host_reserve_fraction)


def divisors(n):
    return [i for i in range(1, n + 1) if n % i == 0]
