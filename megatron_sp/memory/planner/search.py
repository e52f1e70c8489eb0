"""The parallel-layout search: each layout of the GPUs, the memory techniques and sharding that fit
it, scored by estimated step time; the longest sequence that fits (docs/design.md §9, §11).

The planner (`plan(cfg, Workload, Hardware)`: the job, the machine; each layout a ParallelDims) adds
a reserve (fixed + a fragmentation fraction) and checks host memory per node (offloaded state and
activations: exact host pools where we allocate, pinned buffers rounded up to powers of two where
torch does). A MoE model's layouts also try each ep (expert_parallel_choices: the divisors of the
experts that divide the stage's ranks, or Workload.expert_parallel_size), tp > 1 with
--sequence-parallel; its model FLOPs, hence MFU, count the active parameters. With ring=True it
also tries layouts with
a ring (cp > 1, stride tp*sp in the rank order): Ulysses sp stays bounded by the head rules, the ring
by nothing but the sequence, which must divide into 2*cp*sp (*tp with --sequence-parallel) shards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from megatron_sp.attention.kernels import attention_kernel
from megatron_sp.memory.options import MemoryOptions, resolve_count
from megatron_sp.memory.planner.communication import comm_bytes_per_step, residual_element_bytes
from megatron_sp.memory.planner.cp_balance import attention_flops, cp_work_balance
from megatron_sp.memory.planner.fp8 import fp8_flops
from megatron_sp.memory.planner.job import GiB, Hardware, Workload, divisors
from megatron_sp.memory.planner.moe import check_moe_layout, is_moe, moe_layer_flags
from megatron_sp.memory.planner.peak import step_peak_bytes
from megatron_sp.memory.planner.state import SHARDING_MODES, layout_state_bytes
from megatron_sp.mesh import ParallelDims, sequence_layout_problem

class SearchProgress:
    """What a search reports as it goes (plan, max_feasible_seq): this one says nothing;
    tools/plan_parallel.py prints a line to stderr every few seconds of a long search."""

    def layout(self, fit: "Plan | None") -> None:
        """One layout tried by plan(): its fastest plan, or None (inadmissible, nothing fits)."""

    def length(self, seq: int, fits: bool) -> None:
        """One sequence length tried by max_feasible_seq, and whether some layout fits it."""


@dataclass
class Plan:
    """One layout with its memory settings and sharding; sizes in GiB per rank unless said. cp: the
    ring's degree (context parallelism; 1: none), the sequence over sp x cp ranks; seq_length,
    max_position_embeddings and global_batch: the job it was planned for (0: not recorded, and
    then not among the flags); documents: packed documents (--reset-attention-mask);
    attention_kernel: the attention kernel the memory model assumes (attention_kernel); ep: a
    mixture-of-experts model's --expert-model-parallel-size (1: every expert on every rank); etp:
    its --expert-tensor-parallel-size, 1 (whole experts on each tp rank, ep folded over the
    stage's dp x cp x sp x tp ranks: what the planner models; None for a dense model), given
    among the flags when tp > 1 (pretrain_gpt.py's default there is tp);
    total_parameters and active_parameters: the model's (GPTConfig.num_parameters and
    num_active_parameters: a MoE model's per token, k of its E experts; set by plan()).

    Cost (set by plan()): score, the estimated seconds per step (step_s), = compute_s (model FLOPs
    at hw.mfu of the peak x technique cost x (1 + pipeline bubble)) + comm_s (communication bytes
    / bandwidth, not overlapped); model_flops, the step's model FLOPs by Megatron-LM's
    num_floating_point_operations (docs/design.md §9: 12 B s L H^2 ((1 + g/a + s/H) q + (F/H)
    gated + V/(2 L H)), forward and backward, recompute not counted; megatron_sp.training.flops;
    a MoE model's F is the active width, k x moe_ffn_hidden_size (+ the shared expert's) in its MoE
    layers: MFU counts the active parameters, as Megatron-LM's does); peak_flops, the job's peak
    FLOP/s (GPUs x bf16 dense peak; with fp8_format the FP8 peak, as the training loop's MFU).
    From them tokens_per_s and mfu. fp8_format / fp8_recipe: the job's --fp8-format (None: no
    FP8) and torchao recipe, among the flags (planner/fp8.py). cp_work_balance: the slowest ring
    rank's attention work over the mean that compute_s assumes (planner/cp_balance.py; 1: none or
    balanced), for the ring layout context_parallel_layout (among the flags when zigzag)."""
    tp: int
    sp: int
    pp: int
    dp: int
    micro_batch: int
    memory: MemoryOptions
    sequence_parallel: bool
    sharding: str
    cpu_offload: bool
    state_device_gb: float
    state_host_gb: float
    activations_gb: float
    activations_host_gb: float
    reserve_gb: float
    total_gb: float
    host_node_gb: float
    comm_gb: dict = field(default_factory=dict)
    cost: float = 1.0
    score: float = 0.0
    cp: int = 1
    seq_length: int = 0
    max_position_embeddings: int = 0
    global_batch: int = 0
    documents: bool = False
    attention_kernel: str = ""
    compute_s: float = 0.0
    comm_s: float = 0.0
    model_flops: float = 0.0
    peak_flops: float = 0.0
    ep: int = 1
    etp: int | None = None
    total_parameters: int = 0
    active_parameters: int = 0
    fp8_format: str | None = None
    fp8_recipe: str = "tensorwise"
    context_parallel_layout: str = "balanced"
    cp_work_balance: float = 1.0

    @property
    def comm_total_gb(self) -> float:
        return sum(v for k, v in self.comm_gb.items() if k != "host")

    @property
    def step_s(self) -> float:
        """Estimated seconds per step (the score): compute_s + comm_s."""
        return self.score

    @property
    def tokens_per_s(self) -> float:
        """The whole job's tokens per second: global_batch x seq_length / step_s (0 unknown)."""
        return self.global_batch * self.seq_length / self.score if self.score > 0 else 0.0

    @property
    def mfu(self) -> float:
        """Estimated model FLOP utilisation: model_flops / (step_s x peak_flops), i.e. the assumed
        hw.mfu discounted by recompute, the pipeline bubble and communication (0 unknown)."""
        return self.model_flops / (self.score * self.peak_flops) \
            if self.score > 0 and self.peak_flops > 0 else 0.0

    def context_flags(self) -> list[str]:
        """How the sequence is split, in Megatron's names: Ulysses alone --sequence-parallel-size
        sp; the ring alone --context-parallel-size cp --cp-comm-type p2p; both (Ulysses inside,
        adjacent ranks; the ring across) --context-parallel-size sp*cp --cp-comm-type a2a+p2p
        --hierarchical-context-parallel-sizes sp cp."""
        if self.cp == 1:
            return [f"--sequence-parallel-size {self.sp}"]
        layout = ["--context-parallel-layout zigzag"] \
            if self.documents and self.context_parallel_layout == "zigzag" else []
        if self.sp == 1:
            return [f"--context-parallel-size {self.cp}", "--cp-comm-type p2p", *layout]
        return [f"--context-parallel-size {self.sp * self.cp}", "--cp-comm-type a2a+p2p",
                f"--hierarchical-context-parallel-sizes {self.sp} {self.cp}", *layout]

    def job_flags(self) -> list[str]:
        """The job the plan was made for: --seq-length, --max-position-embeddings (the planned
        model's, which pretrain_gpt.py would otherwise take from the preset), --micro-batch-size
        and --global-batch-size (the micro-batches per step set the pipeline's in flight);
        --reset-attention-mask when planned for packed documents."""
        parts = []
        if self.seq_length:
            parts += [f"--seq-length {self.seq_length}",
                      f"--max-position-embeddings {self.max_position_embeddings or self.seq_length}"]
        parts.append(f"--micro-batch-size {self.micro_batch}")
        if self.global_batch:
            parts.append(f"--global-batch-size {self.global_batch}")
        if self.documents:
            parts.append("--reset-attention-mask")
        return parts

    def layout_flags(self) -> list[str]:
        """tp (with --sequence-parallel when tp > 1), the context split, pp, expert parallelism
        (--expert-model-parallel-size when ep > 1; a MoE model's --expert-tensor-parallel-size 1
        when tp > 1), and the sharding of model state over dp x sp (x cp); dp is what the
        launcher's world size leaves."""
        parts = [f"--tensor-model-parallel-size {self.tp}", *self.context_flags(),
                 f"--pipeline-model-parallel-size {self.pp}"]
        if self.ep > 1:
            parts.append(f"--expert-model-parallel-size {self.ep}")
        if self.etp is not None and self.tp > 1:       # the run's default would split the experts
            parts.append(f"--expert-tensor-parallel-size {self.etp}")
        if self.sequence_parallel:
            parts.append("--sequence-parallel")
        if self.sharding == "distributed-optimizer":
            parts.append("--use-distributed-optimizer")
        elif self.sharding == "fsdp":
            parts.append("--use-torch-fsdp2")
        if self.cpu_offload:
            parts.append("--optimizer-cpu-offload")
        return parts

    def flag_list(self) -> list[str]:
        """pretrain_gpt.py flags of this plan (Megatron's names), one string per flag and value: the
        job, --bf16 (the planner's activations are bf16), the layout and the memory techniques."""
        return [*self.job_flags(), "--bf16", *self.fp8_flags(), *self.layout_flags(),
                *self.memory_flags()]

    def fp8_flags(self) -> list[str]:
        """--fp8-format and --fp8-recipe when the plan is for FP8 (torchao's linears: --transformer-
        impl local, the layers whose bytes the planner counts)."""
        if self.fp8_format is None:
            return []
        return [f"--fp8-format {self.fp8_format}", f"--fp8-recipe {self.fp8_recipe}",
                "--transformer-impl local"]

    def memory_flags(self) -> list[str]:
        """Recompute (granularity, and under full its method and layers), tiled MLP, chunked loss,
        activation offload: each technique the plan assumes, its count explicit."""
        m, parts = self.memory, []
        if m.recompute_granularity:
            parts.append(f"--recompute-granularity {m.recompute_granularity}")
            if m.full_recompute:
                parts.append(f"--recompute-method {m.recompute_method}")
                parts.append(f"--recompute-num-layers {m.recompute_num_layers}")
        if m.mlp_tiles != 1:
            parts.append(f"--mlp-tiles {m.mlp_tiles}")
        if m.loss_chunks != 1:
            parts.append(f"--loss-chunks {m.loss_chunks}")
        if m.ulysses_head_chunks != 1:
            parts.append(f"--ulysses-head-chunks {m.ulysses_head_chunks}")
        if m.offload_activations:
            parts.append("--offload-activations")
        return parts

    def flags(self) -> str:
        return " ".join(self.flag_list())

    @property
    def sharding_label(self) -> str:
        return {"none": "none", "distributed-optimizer": "distopt", "fsdp": "fsdp2"}[self.sharding] \
            + ("+offload" if self.cpu_offload else "")

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in (
            "tp", "sp", "cp", "pp", "dp", "micro_batch", "global_batch", "seq_length",
            "max_position_embeddings", "sequence_parallel", "sharding", "cpu_offload",
            "state_device_gb", "state_host_gb", "activations_gb", "activations_host_gb",
            "reserve_gb", "total_gb", "host_node_gb", "comm_gb", "score", "documents",
            "attention_kernel", "step_s", "compute_s", "comm_s", "tokens_per_s", "mfu",
            "model_flops", "ep", "etp", "total_parameters", "active_parameters", "fp8_format",
            "fp8_recipe", "context_parallel_layout", "cp_work_balance")}
        out["memory"] = self.memory.to_dict()
        out["flags"] = self.flags()
        return out


# Cheapest first: the planner picks the first that fits for each layout and sharding mode.
TECHNIQUE_LADDER = [
    MemoryOptions(),
    MemoryOptions(loss_chunks="auto"),
    MemoryOptions(loss_chunks="auto", mlp_tiles="auto"),
    MemoryOptions(recompute_granularity="selective", loss_chunks="auto", mlp_tiles="auto"),
    MemoryOptions(recompute_granularity="full", loss_chunks="auto", mlp_tiles="auto"),
    MemoryOptions(recompute_granularity="full", loss_chunks="auto", mlp_tiles="auto",
                  offload_activations=True),
]


TECHNIQUE_COST = [1.0, 1.0, 1.02, 1.05, 1.33, 1.38]   # relative step time (recompute ~ +1/3 forward)


def head_chunk_cost(cfg, seq: int) -> float:
    """The relative step time Ulysses head chunks (--ulysses-head-chunks N > 1) add to a rung:
    each chunk's forward (QKV rows, all-to-alls, attention, out-proj columns) runs again in
    backward, one more forward of the attention block: its share of the step's model FLOPs
    (Megatron-LM's formula: (1 + g/h + s/H) q of the per-layer terms) / 3. Most of the step at
    long context: +0.33 for Llama-8B at 1M tokens."""
    H, h = cfg.hidden_size, cfg.num_attention_heads
    q = cfg.kv_channels * h / H
    attention = (1.0 + cfg.num_query_groups / h + seq / H) * q
    from megatron_sp.training.flops import active_ffn_hidden_size   # a MoE model's active width
    mlp = active_ffn_hidden_size(cfg) / H * (1.5 if cfg.activation == "swiglu" else 1.0)
    vocab = cfg.padded_vocab_size(1) / (2.0 * cfg.num_layers * H)
    return attention / (attention + mlp + vocab) / 3


def head_chunk_choices(cfg, work: Workload, dims: ParallelDims) -> list[int]:
    """The head-chunk counts N > 1 the planner may try on `dims`, smallest first: work.head_chunks
    "auto", every N that fits the heads per tp rank over sp (ulysses.attention.head_chunk_problem);
    an integer N, just it (none when 1); none under FP8 (its linears refuse head chunks, which
    multiply by slices of the QKV weight outside them)."""
    from megatron_sp.ulysses.attention import head_chunk_problem
    if work.fp8_format is not None:
        return []
    hl, gl = cfg.num_attention_heads // dims.tp, cfg.num_query_groups // dims.tp
    if work.head_chunks != "auto":
        n = int(work.head_chunks)
        return [n] if n > 1 and head_chunk_problem(hl, gl, dims.sp, n) is None else []
    return [n for n in range(2, hl // dims.sp + 1)
            if head_chunk_problem(hl, gl, dims.sp, n) is None]


def technique_candidates(cfg, work: Workload,
                         dims: ParallelDims) -> list[tuple[MemoryOptions, float]]:
    """(memory, relative cost) in the order _fit tries them, cheapest first: each rung of
    TECHNIQUE_LADDER, and after it (at its cost + head_chunk_cost, sorted in with the others, a
    tie keeping the rung without chunks first) the rung with each head_chunk_choices N, smallest
    first; so a plan has head chunks only when nothing cheaper fits, with the smallest N that
    fits."""
    chunks = head_chunk_choices(cfg, work, dims)
    extra = head_chunk_cost(cfg, work.seq) if chunks else 0.0
    out = []
    for i, (mem, cost) in enumerate(zip(TECHNIQUE_LADDER, TECHNIQUE_COST)):
        out.append((cost, i, 0, mem))
        out += [(cost + extra, i, n, replace(mem, ulysses_head_chunks=n))
                for n in chunks]
    return [(mem, cost) for cost, _, _, mem in sorted(out, key=lambda t: t[:3])]


# "auto" tiles/chunks are resolved per layout to explicit counts, never fewer than auto's, so that
# one MLP tile holds at most MLP_TILE_TOKENS tokens and one loss chunk at most LOSS_CHUNK_TOKENS
# (a chunk's logits live in bf16, fp32 and as an fp32 gradient: 10 bytes x tokens x vocabulary).
MLP_TILE_TOKENS = 8192


LOSS_CHUNK_TOKENS = 2048


def concrete_memory(cfg, work: Workload, dims: ParallelDims) -> MemoryOptions:
    """work.memory with "auto" tiles and chunks replaced by the counts the planner assumes (see
    above) for b*s/(sp*cp) tokens per rank (b*s/(sp*cp*tp) under --sequence-parallel)."""
    mem, tp = work.memory, dims.tp
    T = work.micro_batch * work.seq // dims.context
    Ts = T // tp if work.sequence_parallel else T
    H, V = cfg.hidden_size, cfg.padded_vocab_size(tp) // tp
    width = cfg.ffn_hidden_size * (2 if cfg.activation == "swiglu" else 1) // tp
    tiles, chunks = mem.mlp_tiles, mem.loss_chunks
    if all(moe_layer_flags(cfg)):
        tiles = 1                                    # --mlp-tiles tiles dense MLPs only
    elif tiles == "auto":
        tiles = min(max(resolve_count("auto", Ts, width, H), math.ceil(T / MLP_TILE_TOKENS)), Ts)
    if chunks == "auto":
        chunks = min(max(resolve_count("auto", T, V, H), math.ceil(T / LOSS_CHUNK_TOKENS)), T)
    return MemoryOptions(**{**mem.to_dict(), "mlp_tiles": tiles, "loss_chunks": chunks})


def sharding_candidates(sharding: str = "auto", cpu_offload: bool | None = None):
    """(mode, offload) pairs the planner tries: `auto` every mode; cpu_offload None tries both."""
    if sharding != "auto" and sharding not in SHARDING_MODES:
        raise ValueError(f"--sharding must be none, distributed-optimizer, fsdp or auto, got "
                         f"{sharding!r}.")
    if sharding == "none" and cpu_offload:
        raise ValueError("--optimizer-cpu-offload needs a sharded mode: use --sharding "
                         "distributed-optimizer, fsdp or auto.")
    modes = SHARDING_MODES if sharding == "auto" else (sharding,)
    offloads = (False, True) if cpu_offload is None else (bool(cpu_offload),)
    return [(m, o) for m in modes for o in offloads if not (m == "none" and o)]


def layouts(hw: Hardware, ring: bool = False) -> list[ParallelDims]:
    """Every (tp, sp, pp, dp) of hw.num_gpus ranks with tp inside one node, tp then sp then pp
    ascending (the planner's order, which breaks ties between equal scores); with ring, then
    every layout with a ring of cp > 1 ranks (tp, sp, cp, pp ascending), after all those without
    one, so that a tie keeps the layout without a ring first."""
    n = hw.num_gpus
    tps = [tp for tp in divisors(min(n, hw.gpus_per_node)) if n % tp == 0]
    plain = [ParallelDims(n, tp=tp, sp=sp, pp=pp)
             for tp in tps
             for sp in divisors(n // tp)
             for pp in divisors(n // (tp * sp))]
    if not ring:
        return plain
    return plain + [ParallelDims(n, tp=tp, sp=sp, pp=pp, cp=cp)
                    for tp in tps
                    for sp in divisors(n // tp)
                    for cp in divisors(n // (tp * sp)) if cp > 1
                    for pp in divisors(n // (tp * sp * cp))]


def _admissible(cfg, work: Workload, dims: ParallelDims) -> bool:
    """Whether the batch splits into micro-batches over dp, the layers over pp, the sequence over
    sp*tp (with a ring 2*cp*sp*tp: its zigzag chunks, megatron_sp.mesh.sequence_layout_problem)
    and the heads over tp and Ulysses sp (cfg.check_parallel, docs/design.md §4; the ring splits
    no heads), with the planner's --sequence-parallel (on whenever tp > 1: a MoE model's layers
    need it; a job that forbids it leaves a MoE model no tp > 1), and a MoE model has an ep
    (expert_parallel_choices)."""
    if work.global_batch % (work.micro_batch * dims.dp) or cfg.num_layers % dims.pp:
        return False
    if sequence_layout_problem(work.seq, dims.sp, dims.tp, sequence_parallel=True, cp=dims.cp):
        return False
    try:
        cfg.check_parallel(dims.tp, dims.sp, dims.pp, sequence_parallel=dims.tp > 1)
    except ValueError:
        return False
    return bool(expert_parallel_choices(cfg, work, dims))


def expert_parallel_choices(cfg, work: Workload, dims: ParallelDims) -> list[int]:
    """The --expert-model-parallel-size values the planner tries on `dims`, ascending: [1] for a
    dense model; work.expert_parallel_size when given and it divides the stage's dp*cp*sp*tp
    ranks (else none); otherwise every divisor of num_experts that divides them (ep folds over
    the whole stage, tp first: mesh.expert_groups)."""
    if not is_moe(cfg):
        return [1]
    stage = dims.tp * dims.sp * dims.cp * dims.dp
    fixed = work.expert_parallel_size
    eps = [fixed] if fixed is not None else divisors(cfg.num_experts)
    return [ep for ep in eps if stage % ep == 0]


def _check_expert_parallel_size(cfg, ep) -> None:
    """A fixed --expert-model-parallel-size (Workload.expert_parallel_size) the model can take, or
    ValueError in one sentence: a positive integer, 1 for a dense model, a divisor of
    num_experts."""
    if ep is None:
        return
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"--expert-model-parallel-size must be a positive integer, got {ep!r}.")
    check_moe_layout(cfg, 1, True, ep)


def _step_parts(p: Plan, work: Workload, hw: Hardware, compute_s: float,
                attention_s: float = 0.0) -> tuple[float, float]:
    """(compute, communication) seconds of one step: compute, its attention part attention_s at
    the ring's slowest rank (x p.cp_work_balance, planner/cp_balance.py), x technique cost, x
    pipeline bubble; and communication (not overlapped: a pessimistic bound, also for the ring's
    point-to-point transfers, which the implementation posts before each block's computation).
    The ring runs at the network's bandwidth once it leaves a node (a ring is as fast as its
    slowest hop)."""
    c = p.sp * p.cp                                   # the context ranks (stride tp; the ring tp*sp)
    node = hw.gpus_per_node
    stage = p.tp * c * p.dp                           # a stage's ranks: ep and edp fold over them
    bw = {"tp": hw.intra_node_gbps,
          "ep": hw.intra_node_gbps if p.ep <= node and node % p.ep == 0 else hw.inter_node_gbps,
          "edp": hw.intra_node_gbps if stage <= node else hw.inter_node_gbps,
          "sp": hw.intra_node_gbps if p.tp * p.sp <= hw.gpus_per_node else hw.inter_node_gbps,
          "cp": hw.intra_node_gbps if p.tp * c <= hw.gpus_per_node else hw.inter_node_gbps,
          "pp": hw.inter_node_gbps if p.tp * c * p.dp < hw.num_gpus else hw.intra_node_gbps,
          "dp": hw.inter_node_gbps if p.tp * c < hw.num_gpus else hw.intra_node_gbps,
          "host": hw.pcie_gbps}
    comm_s = sum(gb * GiB / 1e9 / bw[k] for k, gb in p.comm_gb.items())
    bubble = (p.pp - 1) / max(1, work.micro_batches(p.dp)) if p.pp > 1 else 0.0
    compute_s += attention_s * (p.cp_work_balance - 1)
    return compute_s * p.cost * (1 + bubble), comm_s


def plan(cfg, work: Workload, hw: Hardware, *, sharding: str = "auto",
         cpu_offload: bool | None = None, ring: bool = False,
         progress: SearchProgress | None = None) -> list[Plan]:
    """Feasible (tp, sp, pp, dp) layouts of hw.num_gpus ranks for `work`, with the sharding mode and
    memory settings that fit, best first (one plan per layout: its fastest fitting mode). The
    planner chooses work's memory techniques (TECHNIQUE_LADDER, with Ulysses head chunks as
    work.head_chunks allows: technique_candidates) and --sequence-parallel (on
    whenever tp > 1); sharding "auto" tries every mode, cpu_offload None with and without. ring:
    also layouts with a ring of context parallelism (cp > 1, alone or around Ulysses sp), which
    lets one sequence use more ranks than the head rules allow Ulysses (layouts(hw, ring)).

    Device memory per rank = model state on device + peak activations (step_peak_bytes) + a reserve:
    hw.reserve_gb (CUDA context, NCCL and cuBLAS workspaces) + hw.fragmentation x the modelled bytes
    (the caching allocator's unusable split blocks). Host memory per node = ranks on the node x
    (model state on host + offloaded activations: exact host pools (host_pool.py) for the
    activations without a pipeline and the distributed optimizer's state, pinned buffers rounded
    to powers of two for FSDP2's CPUOffloadPolicy and pipelined activations), at most
    hw.host_budget_gb (the rest: OS, data loader, page cache).
    Activations: bf16 matmul inputs (work.dtype_bytes); the residual stream and norms in fp32 (bf16
    autocast over fp32 weights) except under FSDP2 with bf16 parameters (MixedPrecisionPolicy),
    where the whole forward is bf16. work.documents: packed documents, as segments through the
    block kernels (no s^2 term; the plans' index tensors, plan_index_bytes); each plan names the
    attention kernel it assumes (Plan.attention_kernel).

    Score: estimated step seconds = model FLOPs / (GPUs x peak x mfu), the attention part at the
    ring's slowest rank (x cp_work_balance: work.documents with work.document_lengths or
    work.cp_work_balance, laid out by work.context_parallel_layout; planner/cp_balance.py), x
    technique cost (recompute ~ +1/3) x (1 + pipeline bubble) + communication bytes / bandwidth
    (tp inside a node; sp, pp and dp cross nodes when the layout spans them; GB/s per GPU;
    offloaded state over PCIe). Each plan
    keeps the two parts (Plan.compute_s, Plan.comm_s), the step's model FLOPs (Megatron-LM's
    formula, docs/design.md §9) and the job's peak, whence Plan.tokens_per_s and Plan.mfu.
    progress: told of each layout tried (SearchProgress.layout).

    Mixture of experts (cfg.num_experts; expert tensor parallelism 1, Plan.etp): each layout also
    tries every expert_parallel_choices ep
    (work.expert_parallel_size fixes it; one that does not divide the experts is refused), the
    fastest fitting (mode, offload, ep) kept: larger ep holds fewer experts per rank (state over
    their edp group) and moves more rows by all-to-all (comm "ep"). tp > 1 always comes with
    --sequence-parallel. The model FLOPs count the active parameters (Megatron-LM's MoE formula,
    flops_for_config), so MFU does; Plan.total_parameters / active_parameters say both.

    FP8 (work.fp8_format; planner/fp8.py): the projections' and dense MLP's FLOPs at
    hw.fp8_peak_tflops, the rest at hw.peak_tflops (both x hw.mfu); MFU against the FP8 peak;
    their weights' bf16 copies leave the state, their casts' transients join the step peak.
    """
    from megatron_sp.training.flops import flops_for_config
    _check_expert_parallel_size(cfg, work.expert_parallel_size)
    progress = progress or SearchProgress()
    candidates = sharding_candidates(sharding, cpu_offload)
    flops = flops_for_config(cfg, work.global_batch, work.seq)
    peak = hw.num_gpus * hw.peak_tflops * 1e12
    compute_s = flops / (peak * hw.mfu)
    attention_s = attention_flops(cfg, work.global_batch, work.seq) / (peak * hw.mfu)   # bf16
    if work.fp8_format is not None:
        in_fp8 = min(fp8_flops(cfg, work.global_batch, work.seq), flops)
        fp8_peak = hw.num_gpus * hw.fp8_peak_tflops * 1e12
        compute_s = (flops - in_fp8) / (peak * hw.mfu) + in_fp8 / (fp8_peak * hw.mfu)
        peak = fp8_peak
    plans = []
    for dims in layouts(hw, ring):
        best = _best_fit(cfg, work, dims, hw, candidates, compute_s, attention_s) \
            if _admissible(cfg, work, dims) else None
        progress.layout(best)
        if best is not None:
            best.model_flops, best.peak_flops = flops, peak
            best.total_parameters = cfg.num_parameters()
            best.active_parameters = cfg.num_active_parameters() if is_moe(cfg) \
                else best.total_parameters
            plans.append(best)
    plans.sort(key=lambda q: q.score)
    return plans


def _best_fit(cfg, work: Workload, dims: ParallelDims, hw: Hardware, candidates,
              compute_s: float, attention_s: float = 0.0) -> Plan | None:
    """The fastest of the (sharding mode, offload, ep) candidates that fit one admissible layout,
    with its communication and score; None when none fits (ep: expert_parallel_choices, ascending,
    so that a tie keeps the smaller)."""
    job = replace(work, sequence_parallel=dims.tp > 1)
    ladder = [(concrete_memory(cfg, replace(job, memory=mem), dims), cost)
              for mem, cost in technique_candidates(cfg, job, dims)]
    fits = []
    for ep in expert_parallel_choices(cfg, job, dims):
        for mode, offload in candidates:
            p = _fit(cfg, job, dims, hw, mode, offload, ep, ladder)
            if p is not None:
                p.comm_gb = {k: v / GiB for k, v in comm_bytes_per_step(
                    cfg, replace(job, memory=p.memory), dims, mode, offload, ep).items()}
                p.compute_s, p.comm_s = _step_parts(p, job, hw, compute_s, attention_s)
                p.score = p.compute_s + p.comm_s
                fits.append(p)
    return min(fits, key=lambda q: q.score) if fits else None


def _fit(cfg, work: Workload, dims: ParallelDims, hw: Hardware, mode: str,
         offload: bool, ep: int = 1, ladder=None) -> Plan | None:
    """The first of technique_candidates (the technique ladder, with Ulysses head chunks; ladder:
    them with concrete_memory's counts, as _best_fit computes them once per layout) that fits
    device and host memory, as a Plan."""
    e = work.dtype_bytes
    fp8 = work.fp8_format is not None
    state_device, state_host = layout_state_bytes(cfg, dims, mode, offload, e, ep, fp8)
    r = residual_element_bytes(mode, e)
    if ladder is None:
        ladder = [(concrete_memory(cfg, replace(work, memory=mem), dims), cost)
                  for mem, cost in technique_candidates(cfg, work, dims)]
    for mem, cost in ladder:
        peak = step_peak_bytes(cfg, work.seq, work.micro_batch, tp=dims.tp, sp=dims.sp,
                               pp=dims.pp, sequence_parallel=work.sequence_parallel, memory=mem,
                               dtype_bytes=e, residual_bytes=r,
                               in_flight_micro_batches=work.in_flight(dims), device=hw.device,
                               cp=dims.cp, documents=work.documents,
                               host_pool=dims.pp == 1,   # pretrain_gpt's pool: no pipeline only
                               ep=ep, fp8_recipe=work.fp8_recipe if fp8 else None)
        modelled = state_device + peak["device"]
        reserve = hw.reserve_gb * GiB + hw.fragmentation * modelled
        host_node = hw.ranks_per_node * (state_host + peak["host"])
        if (modelled + reserve) / GiB <= hw.gpu_mem_gb and host_node / GiB <= hw.host_budget_gb:
            return Plan(dims.tp, dims.sp, dims.pp, dims.dp, work.micro_batch, mem,
                        work.sequence_parallel, mode, offload,
                        state_device_gb=state_device / GiB, state_host_gb=state_host / GiB,
                        activations_gb=peak["device"] / GiB, activations_host_gb=peak["host"] / GiB,
                        reserve_gb=reserve / GiB, total_gb=(modelled + reserve) / GiB,
                        host_node_gb=host_node / GiB, cost=cost, cp=dims.cp,
                        seq_length=work.seq, max_position_embeddings=cfg.max_position_embeddings,
                        global_batch=work.global_batch, documents=work.documents,
                        attention_kernel=attention_kernel(hw.device, e, cfg.kv_channels, dims.cp,
                                                          work.documents), ep=ep,
                        etp=1 if is_moe(cfg) else None, fp8_format=work.fp8_format,
                        fp8_recipe=work.fp8_recipe,
                        context_parallel_layout=work.context_parallel_layout,
                        cp_work_balance=cp_work_balance(work, dims.cp))
    return None


def seq_step(hw: Hardware, ring: bool = False) -> int:
    """The granularity of max_feasible_seq: lcm(1024, GPUs), with ring lcm(1024, 2 x GPUs) (a ring
    over every rank cuts the sequence in 2 x GPUs zigzag shards); the same below 1024 GPUs."""
    return math.lcm(1024, (2 if ring else 1) * hw.num_gpus)


def max_feasible_seq(make_cfg, hw: Hardware, work: Workload | None = None, *,
                     step: int | None = None, limit: int = 2 ** 34, sharding: str = "auto",
                     cpu_offload: bool | None = None, ring: bool = False,
                     progress: SearchProgress | None = None,
                     max_step_s: float | None = None) -> tuple[int, Plan | None]:
    """The longest sequence (a multiple of `step`, default seq_step(hw, ring): lcm(1024, GPUs))
    for which plan() finds a layout, by doubling then bisection; make_cfg(seq) builds the model
    config for a length, `work` the rest of the job (its seq is replaced; default one sequence per
    step); ring: layouts with a ring too (plan); progress: told of each layout and each length
    tried (SearchProgress); max_step_s: only lengths whose fastest plan's step_s is at most this
    many seconds count (step time grows with the length, so the search stays a bisection).
    Returns the length and its fastest plan, or (0, None) when not even one step fits.
    binding_limit says what stops the next length."""
    if max_step_s is not None and not max_step_s > 0:
        raise ValueError(f"the step-time bound must be a positive number of seconds, got "
                         f"{max_step_s}.")
    step = step or seq_step(hw, ring)
    work = work or Workload(seq=step)
    progress = progress or SearchProgress()
    found = {}

    def best(k):
        if k not in found:
            plans = plan(make_cfg(k * step), replace(work, seq=k * step), hw, sharding=sharding,
                         cpu_offload=cpu_offload, ring=ring, progress=progress)
            ok = plans and (max_step_s is None or plans[0].score <= max_step_s)
            progress.length(k * step, bool(ok))
            found[k] = plans[0] if ok else None
        return found[k]
    if best(1) is None:
        return 0, None
    lo, hi = 1, 2
    while hi * step <= limit and best(hi) is not None:
        lo, hi = hi, hi * 2
    while hi - lo > 1:                       # invariant: lo fits, hi does not (or passes the limit)
        mid = (lo + hi) // 2
        if best(mid) is not None:
            lo = mid
        else:
            hi = mid
    return lo * step, best(lo)


BINDS = ("device memory", "host memory", "step time", "search limit")


def binding_limit(make_cfg, hw: Hardware, work: Workload | None, seq: int, *,
                  step: int | None = None, limit: int = 2 ** 34, sharding: str = "auto",
                  cpu_offload: bool | None = None, ring: bool = False,
                  progress: SearchProgress | None = None,
                  max_step_s: float | None = None) -> tuple[str, Plan | None]:
    """What stops the next length after max_feasible_seq's answer `seq` (same arguments), one of
    BINDS, with the plan that shows it: "step time" when some layout fits seq + step in memory
    but its fastest step exceeds max_step_s (that plan); else "host memory" when it would fit with
    unlimited host memory per node (the fastest such plan); else "device memory" (None); "search
    limit" when seq + step passes `limit` (None)."""
    step = step or seq_step(hw, ring)
    nxt = seq + step
    if nxt > limit:
        return "search limit", None
    work = replace(work or Workload(seq=nxt), seq=nxt)
    search = dict(sharding=sharding, cpu_offload=cpu_offload, ring=ring, progress=progress)
    if max_step_s is not None:
        plans = plan(make_cfg(nxt), work, hw, **search)
        if plans:
            return "step time", plans[0]
    plans = plan(make_cfg(nxt), work, replace(hw, host_memory_gb=float("inf")), **search)
    return ("host memory", plans[0]) if plans else ("device memory", None)
