"""The job and the machine the planner sizes: `Workload` (one optimizer step apart from the model)
and `Hardware` (GPUs, nodes, bandwidths), and the small helpers every room shares
(docs/design.md §9, §11)."""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_sp.attention.kernels import DEVICES, check_device
from megatron_sp.memory.options import MemoryOptions
from megatron_sp.mesh import ParallelDims

__all__ = ["DEVICES", "GiB", "Hardware", "Workload", "check_device", "divisors"]

GiB = 2 ** 30


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
    the planner choose (expert_parallel_choices), an integer fixes it."""
    seq: int
    global_batch: int = 1
    micro_batch: int = 1
    dtype_bytes: int = 2
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    sequence_parallel: bool = False
    documents: bool = False
    head_chunks: int | str = "auto"
    expert_parallel_size: int | None = None

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
    bf16 dense peak_tflops at an assumed mfu; device, whose kernels the activation model counts
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
    mfu: float = 0.4
    device: str = "cuda"

    def __post_init__(self):
        check_device(self.device)

    @property
    def ranks_per_node(self) -> int:
        return min(self.num_gpus, self.gpus_per_node)

    @property
    def host_budget_gb(self) -> float:
        """Host memory per node the planner may fill."""
        return self.host_memory_gb * (1 - self.host_reserve_fraction)


def divisors(n):
    return [i for i in range(1, n + 1) if n % i == 0]
