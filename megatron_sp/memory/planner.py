"""Memory and communication model of one training step, and the parallel-layout planner
(docs/design.md §9, §11).

Activation bytes per rank (`activation_bytes`) count what OUR implementation saves for backward,
tensor by tensor (derived from the saved-tensor accounting of each op; tests hold it to the measured
bytes within 10%). Per micro-batch, with T = b*s/(sp*cp) tokens per rank (sp Ulysses, cp the ring;
cp = 1 without one), t = tp, hl = h/t, gl = g/t, d the head dim, F the ffn size, V the padded
vocabulary, e the activation element size (4 fp32, 2 bf16), and "/t*" meaning "divided by t under
--sequence-parallel":

  attention block   norm: x T*H/t* + stats (LayerNorm: mean, rstd 2T/t*; RMSNorm: rstd T/t* (fp32),
                    + on CPU x_hat T*H/t*, all fp32; see _norm_bytes)
                    qkv input T*H/t* (under --sequence-parallel the column-parallel layers keep
                    the shard and all-gather it again in backward); SDPA inputs q T*hl*d, k and v T*d*max(gl, sp) each (with sp = 1
                    and no RoPE and one q per group the q saved is the whole fused qkv: T*(hl+2gl)*d),
                    logsumexp T*hl (fp32), SDPA output T*hl*d (only with sp > 1: otherwise it is
                    the out-proj input), out-proj input T*hl*d; with --qk-layernorm the QKV
                    output T*(hl+2gl)*d (qk-norm and RoPE are recomputed from it in backward)
  MLP block         norm as above, fc1 input T*H/t*, SwiGLU: fc1 output 2T*F/t + silu(gate) T*F/t +
                    fc2 input T*F/t (GeLU: 2T*F/t)
  MoE block         (a MoE layer's MLP instead, models/moe.py; cfg.is_moe_layer) each tp rank routes
                    its own Tm = T/t* tokens: N = Tm*k routed rows, E experts of Fm (E/ep on a
                    rank), p the router scores' element size (router_prob_bytes: 4 without
                    autocast, else e, or 4 for CUDA autocast's fp32 softmax). The experts and
                    the rows they see are in the tokens' dtype r: autocast has no rule for the
                    grouped GEMM, so under bf16 autocast over fp32 weights they run in fp32.
                    norm as above;
                    router_input  Tm*H*e under autocast (its linear's bf16 copy), else Tm*H*4
                                  (tokens.float(): the tokens themselves when r = 4)
                    router_probs  top-k indices Tm*k*8 + the softmax over the k Tm*k*p
                                  (--moe-router-pre-softmax: the softmax over all E, Tm*E*p,
                                  instead, + Tm*k*p + Tm*p renormalised; sigmoid: Tm*E*p +
                                  Tm*k*p + Tm*p); + Tm*E*p with the load-balancing loss, + Tm*E*4 +
                                  Tm*4 with the z-loss (fp32 logits, logsumexp)
                    expert_input  N*H*r: the first grouped GEMM's input (the permuted rows)
                    expert_act    N*4*Fm*r (its output [N, 2Fm], silu(gate), the second GEMM's
                                  input) + the int32 offsets E/ep*4
                    combine       N*H*(4 + r) + N*p: unpermute keeps the experts' output in fp32,
                                  the weighted rows (index_add) and the weights
                    token_indices 3*N*8 int64: the permutation and the row -> token index twice
                    shared_expert (Fs: a dense SwiGLU over the Tm tokens) Tm*4*Fs*e + its input
                                  Tm*H*e under autocast (else the tokens themselves: 0 when r = 4,
                                  shared with router_input); its gate + the input's copy Tm*H*e
                                  (autocast) + sigmoid Tm*e + the shared output Tm*H*e
                    ep > 1 (moe/dispatch.py): the experts compute the R rows received instead of
                    the N permuted, R = N under uniform routing (the expectation the model
                    takes; a skewed routing puts more on some ranks), and the regroup keeps 2*R*8
                    more int64 indices (token_indices). Capacity (--moe-expert-capacity-factor)
                    drops nothing under uniform routing (cf >= 1); --moe-pad-expert-input-to-
                    capacity runs the experts over E*C rows (C = ceil(cf*Tm*k/E)) + N*8 slot
                    indices. Never tiled (--mlp-tiles tiles dense MLPs only). A stage's layers:
                    stage_layers, the pipeline stage with the most MoE layers.
  weight copies     aten::linear keeps w^T (CPU) or the autocast bf16 copy (GPU) of each weight: qkv,
                    proj, fc1, fc2 (and the output layer), /t; a MoE layer's router and shared
                    expert (the experts' grouped GEMMs keep the fp32 weights themselves)
  output            final norm + output-layer input T*H/t* (T*H with chunked loss) + fp32 softmax T*V/t (4 bytes) + labels
  RoPE cos, sin     2*T*d, shared by all layers (counted once)

  full recompute    a checkpointed group keeps only its input T*H/t* (uniform: L/n groups; block: n
                    checkpointed layers + L-n full ones)
  selective         drops logsumexp and SDPA output (recomputed)
  tiled MLP         drops the fc1/act terms and fc1/fc2 weight copies
  chunked loss      drops the softmax and the output weight copy
  offload           the layers' saved bytes move to host memory (device: 0 for the layers)
  head chunks       (--ulysses-head-chunks N > 1, models/gpt.py SelfAttention) the attention block
                    (QKV rows, qk-norm, RoPE, Ulysses, out-proj columns) runs over N head chunks,
                    each one checkpoint whose only saved input is the block's input (the qkv
                    input term, shared): no SDPA inputs, logsumexp, SDPA output, out-proj input,
                    qk-norm input or attention weight copies are kept. One layer's attention
                    backward (_layer_backward_peak) holds the input's gradient accumulating over
                    the chunks (T*H*e) + the larger of one chunk's kernel phase (its recomputed
                    local q, k, v, head-layout q, k, v, out, lse, the out gradient and the
                    kernel's buffers, k and v at the kernel T*max(gl, sp*N)*d/N each) and its
                    projection backward (the chunk's QKV gradient and its input gradient T*H*e);
                    the ring's buffers are one chunk's
The ring (context parallelism, cp > 1; docs/design.md §14; alone, or inside Ulysses as Megatron's
a2a+p2p hybrid): outside attention a rank holds T = b*s/(sp*cp) tokens; inside attention its ring
rank's 2c = s/cp zigzag tokens (times b) for hl/sp query heads and max(gl, sp)/sp key/value heads,
so q, k, v at the kernel are T*hl*d and T*max(gl, sp)*d elements, as under Ulysses alone: every term
above holds with this T. The ring's saved global out and lse are the sdpa_out (out [b, s/cp,
hl/sp, d] in e bytes; with sp = 1 it is the out-proj input itself, counted once) and sdpa_lse
(lse fp32 [b, hl/sp, s/cp] = T*hl*4) terms. On top, the ring's buffers in flight
(`ring_buffer_bytes`, per attention layer and rank, with K = T*max(gl, sp)*d elements of k or v of
one block):
  forward           the held kv block and the one being received: 2 x 2K x e
  backward          the same kv blocks, + the block's dk, dv accumulating, the travelling dk, dv
                    (sent, held until their send is done) and the ones being received, all fp32:
                    2 x 2K x e + 3 x 2K x 4
The backward's are added to one layer's attention backward (`_layer_backward_peak`). The forward's
never set the peak: the backward holds the same two kv blocks, and its dq fp32 accumulator is as
large as the forward's fp32 out accumulator, on top of gradients the forward does not have.

The attention kernel (`attention_kernel`: its description, printed with every plan;
`attention_kernel_name`): without a ring and without packed documents SDPA
(F.scaled_dot_product_attention: on CUDA cuDNN attention, else FlashAttention-2, else the
memory-efficient kernel; on CPU aten's CPU flash kernel); a ring's blocks and packed documents run
as segments through the fused block kernels (attention/block_kernels.block_kernel): on CUDA
FlashAttention-2 varlen in fp16/bf16 (a head dim that is a multiple of 8, at most 256), else the
memory-efficient kernel, on CPU aten's CPU flash kernel. Their buffers in one attention backward
(`_layer_backward_peak`), beyond dout, dq, its fp32 accumulator, dk and dv, with q = T*hl*d
elements and GQA meaning more local query heads than key/value heads (`_kernel_gqa_bytes`):
  FlashAttention-2 (SDPA's, varlen)  k, v go in as they are; under GQA its backward expands dk,
                                     dv to the query heads (dk_expanded, dv_expanded): 2 q e
  memory-efficient (block kernel)    k, v repeated to the query heads per segment (a copy even at
                                     one query head per key/value head) and their gradients at the
                                     query heads before the sum: 4 q e (a segment's keys are at
                                     most the held block, so its repeat is at most q)
  CPU flash (SDPA's, per segment)    none: GQA is reduced inside the kernel (measured: the
                                     backward's peak above dq, dk, dv is the same for every g)

Packed documents (Workload.documents; --reset-attention-mask) are segments, never a mask: no
s^2 term anywhere. Their one memory term is the plans' int64 token indices for the varlen kernel
(`plan_index_bytes`; CUDA fp16/bf16 only: the CPU and memory-efficient kernels run per segment on
slices of q, k, v and index nothing), made once per step and shared by every layer:
  cp = 1   blockwise attention: q and k indices of every token, at most 2*b*s (b*s tokens at
           the kernel, with Ulysses too), only with documents (without them SDPA runs, no plan)
  cp > 1   the ring's plan, only with documents (without them every segment runs on views): per
           step at most the indices of its batches' queries and keys, step 0 (the diagonal:
           causal squares A x a and B x b, rectangle B x a) 6c per row, every other step 3c
           ([A B] x a or B x [a b]), c = s/(2cp): at most b*3c*(cp+1) in all (~1.5*b*s); an
           upper bound, as segments of 4096 tokens and up run on views too
  + cu_seqlens (int32, one per segment and batch): not counted; nor the varlen call's packed
    copies of q, out, dout, k, v and its merged rows, bounded by one batch (at most
    segments.PACK_TOKENS = 16K query tokens), not by s.
Each micro-batch in flight keeps its own plan (its autograd nodes hold it until its backward). At cp = 1 documents also move
attention from SDPA to the block kernels: the same FlashAttention-2 count on CUDA in bf16 and the
same CPU kernel on CPU, so there the index tensors are the only difference; on CUDA in fp32 the
memory-efficient kernel's repeated key/value heads come on top. The kv blocks travel without any
document index: the communication is the same.

Korthikanti et al. (16-bit, attention matrix stored): `korthikanti_layer_bytes`.

Element sizes: e for what the matmuls keep (their autocast copies: 2 under --bf16), r for the
residual stream, the checkpointed layer inputs and what the tiles/chunks keep (4 under bf16 autocast
over fp32 weights, 2 when the weights themselves are bf16, as FSDP2's MixedPrecisionPolicy makes
them). `device` picks torch's RMSNorm: "cuda" (the default: the planner plans GPUs) runs the fused
kernel, which keeps the input and rstd; "cpu" runs the composite, which keeps fp32 copies (x, rstd,
x_hat). The per-term model equals the measured saved bytes on CPU in fp32, under bf16 autocast and
with bf16 weights (tests/unit/test_planner.py, device="cpu").

Model state per rank (`model_state_bytes`, docs/design.md §11): fp32 weights (4) + fp32 gradients (4)
+ Adam m, v (8) = 16 bytes/param replicated; --use-distributed-optimizer shards Adam over n = dp x sp
(x cp with a ring: the mesh's dp_sp group is dp x cp x sp);
--use-torch-fsdp2 shards all of it and holds the units in flight unsharded; --optimizer-cpu-offload
moves the sharded optimizer state to host. Under bf16 autocast (not FSDP2) the cast cache and
aten::linear keep a bf16 copy of every weight: + 2 bytes/param (docs/design.md §9's 18), but the
routed experts' (their grouped GEMMs run in fp32 on the weights themselves).
Mixture of experts (params_split_per_rank, expert_shard_ranks): a rank holds E/ep whole experts
of each MoE layer (--expert-model-parallel-size ep, folded over the stage's dp x cp x sp x tp
ranks, tp first; expert tensor parallelism 1: never split over tp), the router and the shared
expert whole on every tp rank; the experts' state is sharded over their expert-data-parallel
group, m = dp*cp*sp*tp/ep ranks (with ep 1 they are ordinary parameters, over n), the rest over n:
16 P_e/m with FSDP2, Adam 8 P_e/m with the distributed optimizer. FSDP2: with ep > 1 each MoE
layer's experts are their own unit inside the layer's (fsdp_expert_units), gathered while they run.

Peak of one step (`step_peak_bytes`): what the forward keeps for backward + the larger of the output
layer's peak (its logits in flight, forward or backward) and one layer's backward (recomputed under
full recompute), each with its working buffers (gradients, the attention kernel's dq accumulator,
one MLP tile, one loss chunk's logits; a MoE layer's largest backward phase, _moe_backward_bytes:
unpermute's fp32 products N*H*8, the shared expert's fc1 gradient, or the experts' weight
gradients, w1's and w2's held together), + the attention plans' index tensors (plan_index_bytes).
Communication (`comm_bytes_per_step`) adds for MoE "ep", the dispatcher's all-to-alls (forward
dispatch + combine, both again in backward and under full recompute: 4 Nx (ep-1)/ep H r per MoE
layer and micro-batch, uniform routing) and "edp", the experts' gradient traffic over their group.
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

import functools
import math
from dataclasses import dataclass, field, replace

from megatron_sp.memory.host_pool import align_up
from megatron_sp.memory.options import MemoryOptions, resolve_count
from megatron_sp.mesh import ParallelDims, sequence_layout_problem

BYTES_PER_PARAM = 16     # fp32 weights 4 + fp32 grads 4 + Adam exp_avg 4 + exp_avg_sq 4


DEVICES = ("cuda", "cpu")
GiB = 2 ** 30


# The job and the machine ------------------------------------------------------------------------

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
    ("cuda" or "cpu": torch's RMSNorm, see _fused_rms_norm)."""
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
        _check_device(self.device)

    @property
    def ranks_per_node(self) -> int:
        return min(self.num_gpus, self.gpus_per_node)

    @property
    def host_budget_gb(self) -> float:
        """Host memory per node the planner may fill."""
        return self.host_memory_gb * (1 - self.host_reserve_fraction)


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}.")


def _fused_rms_norm(device: str) -> bool:
    """Whether torch's RMSNorm runs its fused kernel on `device`: aten::_fused_rms_norm (torch >= 2.8)
    has CUDA and MPS kernels whose backward needs only the input and rstd; elsewhere, and in older
    torch, F.rms_norm is the composite of fp32 ops (pow, mean, rsqrt, two products), which keeps x,
    rstd and x_hat in fp32. On an H200 (torch 2.11, bench/gpu_long_context.py, stop 21) the measured
    peaks were one fp32 [T, H] per RMSNorm under the composite's count."""
    _check_device(device)
    import torch
    return device == "cuda" and hasattr(torch.ops.aten, "_fused_rms_norm")


def _norm_bytes(cfg, Ts, r, device) -> float:
    """Bytes one norm keeps for backward over Ts tokens, its input in r bytes per element: LayerNorm
    (torch's fused kernel on every device) x + mean and rstd; RMSNorm x + fp32 rstd when fused,
    else the composite's fp32 x, rstd and x_hat (also for a 16-bit input, which it upcasts first)."""
    H = cfg.hidden_size
    if cfg.normalization != "RMSNorm":
        return (Ts * H + 2 * Ts) * r
    if _fused_rms_norm(device):
        return Ts * H * r + Ts * 4
    return (Ts * H + Ts + Ts * H) * 4


def _layer_terms(cfg, T, tp, sp, seqpar, e, memory: MemoryOptions, weight_copies=True, r=None,
                 device="cuda", moe=False, ep=1):
    """Saved bytes of one transformer layer, split into named terms (device, not offloaded).

    e: bytes of what the matmuls keep (their autocast copies); r: bytes of the residual stream and
    the norms' input (4 under bf16 autocast over fp32 weights, 2 when the weights themselves are
    bf16); device: whose RMSNorm kernel (_norm_bytes); moe: a MoE layer (cfg.is_moe_layer), whose
    MLP terms are _moe_terms' (ep: --expert-model-parallel-size)."""
    r = e if r is None else r
    H, d, F = cfg.hidden_size, cfg.kv_channels, cfg.ffn_hidden_size
    hl, gl = cfg.num_attention_heads // tp, cfg.num_query_groups // tp
    Ts = T / tp if seqpar else T
    swiglu = cfg.activation == "swiglu"
    rope = cfg.position_embedding_type in ("rope", "yarn")
    norm = _norm_bytes(cfg, Ts, r, device)
    kv = T * d * max(gl, sp)
    if sp == 1 and not rope and hl == gl:
        q = T * (hl + 2 * gl) * d          # q is a view of the fused qkv output
    else:
        q = T * hl * d
    terms = {
        "attn_norm": norm,
        "qkv_input": Ts * H * e,          # under --sequence-parallel only the shard is kept
        "sdpa_qkv": (q + 2 * kv) * e,
        "sdpa_lse": T * hl * 4,           # logsumexp is fp32
        # With sp = 1 the SDPA output already is the out-proj input (same storage); with sp > 1 the
        # head->seq all-to-all makes the out-proj input a new tensor.
        "sdpa_out": T * hl * d * e if sp > 1 else 0,
        "proj_input": T * hl * d * e,
        "mlp_norm": norm,
        "fc1_input": Ts * H * e,
        "mlp_act": (4 * T * F / tp if swiglu else 2 * T * F / tp) * e,
    }
    if getattr(cfg, "qk_layernorm", False):   # qk-norm + RoPE recomputed from the QKV output
        terms["qk_norm_input"] = T * (hl + 2 * gl) * d * e
    if weight_copies:
        fc1 = H * F * (2 if swiglu else 1) / tp
        terms["w_attn"] = (H * (hl + 2 * gl) * d + hl * d * H) * e
        terms["w_mlp"] = (fc1 + F * H / tp) * e
    if memory.selective_recompute:
        terms["sdpa_lse"] = terms["sdpa_out"] = 0
    chunks = getattr(memory, "ulysses_head_chunks", 1)
    if chunks > 1:
        # The block's head chunks each checkpoint everything from the QKV rows to the out-proj
        # columns; their one saved input is the block's input (qkv_input, shared).
        for name in ("sdpa_qkv", "sdpa_lse", "sdpa_out", "proj_input", "qk_norm_input", "w_attn"):
            if name in terms:
                terms[name] = 0
    if moe:                                   # experts instead of the dense MLP (never tiled)
        for name in ("fc1_input", "mlp_act", "w_mlp"):
            terms.pop(name, None)
        terms.update(_moe_terms(cfg, Ts, e, r, device, ep, weight_copies))
    elif memory.mlp_tiles != 1:
        n = resolve_count(memory.mlp_tiles, int(Ts), F * (2 if swiglu else 1) // tp, H)
        if n > 1:
            terms["mlp_act"] = 0
            terms["fc1_input"] = Ts * H * r   # each tile's checkpoint keeps a view of the norm output
            terms.pop("w_mlp", None)
    return terms


# Mixture of experts (models/moe.py) --------------------------------------------------------------

# The MLP block's saved terms, dense or MoE (what the attention phase of one layer's backward no
# longer holds: _layer_backward_peak).
MLP_TERMS = ("mlp_norm", "fc1_input", "mlp_act", "router_input", "router_probs", "expert_input",
             "expert_act", "combine", "token_indices", "shared_expert")


def is_moe(cfg) -> bool:
    """Whether cfg has mixture-of-experts layers (GPTConfig.num_experts)."""
    return getattr(cfg, "num_experts", None) is not None


_MOE_FLAGS: dict = {}      # (layers, experts, moe_layer_freq) -> moe_layer_flags


def moe_layer_flags(cfg) -> tuple[bool, ...]:
    """cfg.is_moe_layer of every layer (all False for a dense model), asked once per pattern (the
    planner asks for them in every candidate it sizes)."""
    freq = getattr(cfg, "moe_layer_freq", None)
    key = (cfg.num_layers, getattr(cfg, "num_experts", None),
           tuple(freq) if isinstance(freq, list) else freq)
    if key not in _MOE_FLAGS:
        _MOE_FLAGS[key] = tuple(is_moe(cfg) and bool(cfg.is_moe_layer(i))
                                for i in range(cfg.num_layers))
    return _MOE_FLAGS[key]


def stage_layers(cfg, pp: int = 1) -> list[int]:
    """Global indices of the layers of the heaviest pipeline stage: of the pp contiguous stages of
    L/pp layers, the one with the most MoE layers (the first on a tie: the first stage for a
    dense model)."""
    return list(_heaviest_stage(moe_layer_flags(cfg), pp))


@functools.lru_cache(maxsize=None)
def _heaviest_stage(flags: tuple[bool, ...], pp: int) -> range:
    per = len(flags) // pp
    stages = [range(i * per, (i + 1) * per) for i in range(pp)]
    return max(stages, key=lambda layers: sum(flags[i] for i in layers))


def _stage_kinds(cfg, num_layers: int) -> list[bool]:
    """Whether each of a stage's num_layers layers is a MoE layer: the heaviest stage when
    num_layers divides the model's layers (stage_layers), else its first num_layers."""
    flags = moe_layer_flags(cfg)
    if cfg.num_layers % num_layers == 0:
        return [flags[i] for i in stage_layers(cfg, cfg.num_layers // num_layers)]
    return list(flags[:num_layers])


def _stage_moe_layers(cfg, pp: int) -> int:
    """MoE layers of the heaviest pipeline stage (stage_layers)."""
    flags = moe_layer_flags(cfg)
    return sum(flags[i] for i in stage_layers(cfg, pp))


def router_prob_bytes(cfg, e: int, r: int, device: str = "cuda") -> int:
    """Element size of the router's saved scores (models/moe.py TopKRouter: tokens.float() @
    weight.float()): fp32 without autocast (e == r); under autocast (e != r) its linear runs in
    bf16, and so do its scores on CPU, while CUDA's autocast runs softmax in fp32 (its fp32 op
    list; a sigmoid stays in bf16)."""
    if e == r:
        return 4
    return 4 if device == "cuda" and cfg.moe_router_score_function == "softmax" else e


def _router_terms(cfg, Tm, e, r, device) -> dict:
    """router_input and router_probs of one MoE layer over Tm tokens (module docstring)."""
    H, E, k = cfg.hidden_size, cfg.num_experts, cfg.moe_router_topk
    p = router_prob_bytes(cfg, e, r, device)
    probs = Tm * k * 8                                 # top-k indices [Tm, k] int64
    if cfg.moe_router_score_function == "sigmoid":      # sigmoid [Tm, E], normalised over the k
        probs += Tm * E * p + (Tm * k * p + Tm * p if k > 1 else 0)
    elif cfg.moe_router_pre_softmax:                    # softmax [Tm, E], top-k of it
        probs += Tm * E * p + (Tm * k * p + Tm * p if cfg.moe_norm_topk_prob else 0)
    else:                                               # softmax over the top-k logits [Tm, k]
        probs += Tm * k * p
    if cfg.moe_aux_loss_coeff > 0 and cfg.moe_router_load_balancing_type != "none":
        sigmoid = cfg.moe_router_score_function == "sigmoid"
        probs += Tm * E * p + (Tm * p if sigmoid and k > 1 else 0)   # the full scores [Tm, E]
    if cfg.moe_z_loss_coeff:
        probs += Tm * E * 4 + Tm * 4                    # fp32 logits, logsumexp [Tm]
    autocast = e != r
    return {"router_input": Tm * H * (e if autocast else 4), "router_probs": probs}


def _expert_rows(cfg, Tm) -> tuple[float, float]:
    """(N, Nx): the routed rows of Tm tokens, N = Tm*k (uniform routing: capacity drops none), and
    the rows the experts compute, Nx = E*C with --moe-pad-expert-input-to-capacity (C =
    ceil(cf*Tm*k/E)), else N; with ep > 1 the rows received, whose uniform expectation is Nx."""
    N = Tm * cfg.moe_router_topk
    if cfg.moe_pad_expert_input_to_capacity:
        return N, cfg.num_experts * math.ceil(cfg.moe_expert_capacity_factor * N / cfg.num_experts)
    return N, N


def _moe_terms(cfg, Tm, e, r, device="cuda", ep=1, weight_copies=False) -> dict:
    """Saved bytes of one MoE layer's MLP block beyond its norm, over the Tm tokens this rank routes
    (T/t* : each tp rank routes its own under --sequence-parallel), by named term (module
    docstring). The experts run in the tokens' dtype r (autocast has no rule for the grouped
    GEMM)."""
    H, E, Fm = cfg.hidden_size, cfg.num_experts, cfg.moe_ffn_hidden_size
    p = router_prob_bytes(cfg, e, r, device)
    N, Nx = _expert_rows(cfg, Tm)
    autocast = e != r
    terms = _router_terms(cfg, Tm, e, r, device)
    indices = 3 * N * 8                       # permutation [N] + row -> token [N] twice, int64
    if cfg.moe_pad_expert_input_to_capacity:
        indices += N * 8                      # each row's slot in the padded [E*C, H] buffer
    if ep > 1:
        indices += 2 * Nx * 8                 # the received rows' regroup order and its inverse
    terms.update({
        "expert_input": Nx * H * r,                      # the first grouped GEMM's input [Nx, H]
        "expert_act": Nx * 4 * Fm * r + E // ep * 4,     # [Nx, 2Fm], silu, fc2 input; offsets
        "combine": N * H * (4 + r) + N * p,              # fp32 output, weighted rows, weights
        "token_indices": indices,
        "shared_expert": _shared_expert_bytes(cfg, Tm, e, r, autocast),
    })
    if weight_copies:       # the router's and shared expert's linears (the experts keep no copy)
        Fs = cfg.moe_shared_expert_intermediate_size or 0
        terms["w_moe"] = (E * H + 3 * H * Fs + (H if cfg.moe_shared_expert_gate else 0)) * e
    return terms


def _shared_expert_bytes(cfg, Tm, e, r, autocast) -> float:
    """The shared expert (a dense SwiGLU of Fs over the Tm tokens; models/moe.py SharedExpertMLP):
    fc1 output [Tm, 2Fs] + silu + fc2 input = Tm*4*Fs*e, + its input (autocast's bf16 copy Tm*H*e;
    without autocast the tokens themselves, shared with router_input when r = 4); the gate
    (--moe-shared-expert-gate) + its input's copy (autocast) + sigmoid Tm*e + the output Tm*H*e."""
    Fs, H = cfg.moe_shared_expert_intermediate_size, cfg.hidden_size
    if not Fs:
        return 0.0
    shared = Tm * 4 * Fs * e + (Tm * H * e if autocast else 0 if r == 4 else Tm * H * r)
    if cfg.moe_shared_expert_gate:
        shared += (Tm * H * e if autocast else 0) + Tm * e + Tm * H * e
    return shared


def activation_bytes(cfg, seq: int, micro_batch: int = 1, *, tp: int = 1, sp: int = 1,
                     sequence_parallel: bool = False, num_layers: int | None = None,
                     memory: MemoryOptions | None = None, dtype_bytes: int = 4,
                     residual_bytes: int | None = None, weight_copies: bool = False,
                     post_process: bool = True, pre_process: bool = True,
                     device: str = "cuda", cp: int = 1, ep: int = 1) -> dict:
    """Predicted bytes saved for backward per rank for one micro-batch (see the module docstring).

    residual_bytes: element size of the residual stream and the norms' saved tensors (default
    dtype_bytes; 4 under bf16 autocast over fp32 weights, where only the matmul inputs are bf16).
    weight_copies: also count the weight copies aten::linear keeps (the accountant reports them
    apart, as weight_copy_bytes). device: "cuda" or "cpu", whose RMSNorm kernel (module
    docstring). cp: the ring's degree (context parallelism; T = b*s/(sp*cp), the ring's saved out
    and lse are the sdpa_out and sdpa_lse terms). ep: --expert-model-parallel-size (MoE layers'
    dispatch; the stage's layers are stage_layers': the one with the most MoE layers). Returns
    {"layer": bytes of the largest layer (not recomputed), "layers": all this stage's layers,
    "output", "embedding", "shared" (RoPE), "host" (offloaded), "total" (device), "terms": {...}
    (of a MoE layer when the stage has one), "by_kind": {"dense" / "moe": (bytes, terms) of each
    kind of layer the stage has}}.
    """
    memory = memory or MemoryOptions()
    e = dtype_bytes
    r = e if residual_bytes is None else residual_bytes
    L = cfg.num_layers if num_layers is None else num_layers
    seqpar = sequence_parallel and tp > 1
    _check_moe_layout(cfg, tp, seqpar, ep)
    T = micro_batch * seq / (sp * cp)
    Ts = T / tp if seqpar else T
    H, d = cfg.hidden_size, cfg.kv_channels
    kinds = _stage_kinds(cfg, L)
    by_kind = {}
    for moe in sorted(set(kinds)):
        terms = _layer_terms(cfg, T, tp, sp, seqpar, e, memory, weight_copies, r, device, moe, ep)
        by_kind["moe" if moe else "dense"] = (sum(terms.values()), terms)
    per_layer = [by_kind["moe" if moe else "dense"][0] for moe in kinds]
    layer = max(kind[0] for kind in by_kind.values())
    terms = by_kind["moe" if "moe" in by_kind else "dense"][1]
    ckpt_input = Ts * H * r
    if memory.full_recompute:
        n = memory.recompute_num_layers
        if memory.recompute_method == "uniform":
            layers = math.ceil(L / n) * ckpt_input
        else:
            k = min(n, L)
            layers = k * ckpt_input + sum(per_layer[k:])
    else:
        layers = sum(per_layer)
    shared = 2 * T * d * 4 if cfg.position_embedding_type in ("rope", "yarn") else 0
    host = 0
    if memory.offload_activations:
        host, layers, shared = layers + shared, 0, 0
    output = 0
    if post_process:
        V = cfg.padded_vocab_size(tp) // tp
        output = _norm_bytes(cfg, Ts, r, device)             # the final norm
        chunks = 1 if memory.loss_chunks == 1 else resolve_count(memory.loss_chunks, int(T), V, H)
        # output-layer input: unchunked, the matmul's (autocast) copy of the shard (of the gathered
        # output when "auto" resolved to one chunk); chunked, each chunk's checkpoint keeps its
        # slice of the (gathered) final-norm output itself
        output += T * H * r if chunks > 1 else (Ts if memory.loss_chunks == 1 else T) * H * e
        if chunks > 1:
            output += micro_batch * seq * 8                  # label chunks: views of the [b, s] labels
        else:
            output += T * V * 4 + T * 9                      # fp32 softmax, int64 labels, bool mask
            if weight_copies:
                output += H * V * e
    embedding = 0
    if pre_process:
        embedding = micro_batch * seq * 8 if tp == 1 else T * 9
        if cfg.position_embedding_type == "learned_absolute":
            embedding += seq * 8
    total = layers + output + embedding + shared
    return {"layer": layer, "layers": layers, "output": output, "embedding": embedding,
            "shared": shared, "host": host, "total": total, "terms": terms, "by_kind": by_kind}


def _check_moe_layout(cfg, tp: int, seqpar: bool, ep: int) -> None:
    """Refuse (ValueError) what our MoE layers cannot run: tp > 1 without --sequence-parallel,
    an ep that does not divide the experts, ep > 1 on a dense model."""
    if not is_moe(cfg):
        if ep != 1:
            raise ValueError(f"--expert-model-parallel-size {ep} needs a mixture-of-experts model "
                             f"(num_experts): use 1 for this dense model.")
        return
    if tp > 1 and not seqpar:
        raise ValueError(f"num_experts={cfg.num_experts} with tp={tp} needs --sequence-parallel "
                         f"(sequence_parallel=True): each tp rank routes its own tokens.")
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or cfg.num_experts % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide num_experts="
                         f"{cfg.num_experts}: choose one of {_divisors(cfg.num_experts)}.")


def korthikanti_layer_bytes(cfg, seq: int, micro_batch: int = 1, tp: int = 1, sp: int = 1,
                            sequence_parallel: bool = False, recompute: str | None = None) -> float:
    """Korthikanti et al. 2022 per-layer bytes with 16-bit activations (docs/design.md §9), divided by sp."""
    s, b, H, a, t = seq, micro_batch, cfg.hidden_size, cfg.num_attention_heads, tp
    if recompute == "full":
        v = 2 * s * b * H / (t if sequence_parallel else 1)
    elif recompute == "selective":
        v = s * b * H * 34 / t
    elif sequence_parallel:
        v = s * b * H / t * (34 + 5 * a * s / H)
    else:
        v = s * b * H * (10 + 24 / t + 5 * a * s / (H * t))
    return v / sp


def ring_buffer_bytes(cfg, T: float, tp: int = 1, sp: int = 1, cp: int = 1,
                      dtype_bytes: int = 2) -> dict:
    """The ring's buffers in flight per attention layer and rank (context_parallel/ring.py), bytes.

    T: the rank's tokens outside attention, b*s/(sp*cp); one kv block is the ring rank's 2c = s/cp
    tokens (times b) of max(gl, sp)/sp key/value heads (after the Ulysses all-to-all; gl = g/tp),
    K = T*max(gl, sp)*d elements each of k and v; e = dtype_bytes.
      forward   the held block and the one being received (posted before the block is computed):
                2 blocks x 2K x e
      backward  the same two kv blocks, + the held block's dk, dv (fp32, accumulating), the
                previous ones travelling on (sent, kept until the send completes) and the ones
                being received: 2 x 2K x e + 3 x 2K x 4
    At step 0 the held block is the saved k, v themselves; from step 1 on it is a received copy,
    hence two blocks beyond what is saved. Returns {"forward", "backward", "block_elements": K};
    zeros without a ring (cp = 1)."""
    if cp == 1:
        return {"forward": 0, "backward": 0, "block_elements": 0}
    gl = cfg.num_query_groups // tp
    K = T * max(gl, sp) * cfg.kv_channels
    forward = 2 * 2 * K * dtype_bytes
    return {"forward": forward, "backward": forward + 3 * 2 * K * 4, "block_elements": K}


# Model state ------------------------------------------------------------------------------------

SHARDING_MODES = ("none", "distributed-optimizer", "fsdp")


def moe_layer_parameters(cfg) -> dict:
    """One MoE layer's MLP parameters by how they are laid out (models/moe.py): "experts", the E
    routed SwiGLU experts, 3*H*Fm each (whole experts, E/ep per rank: split over ep, never over
    tp); "replicated", the router [E, H], the shared expert 3*H*Fs and its gate [1, H] (whole on
    every tp rank); "dense_mlp", the 3*H*F SwiGLU MLP a dense layer has instead. All 0 for a
    dense model."""
    if not is_moe(cfg):
        return {"experts": 0, "replicated": 0, "dense_mlp": 0}
    H, E = cfg.hidden_size, cfg.num_experts
    Fs = cfg.moe_shared_expert_intermediate_size or 0
    return {"experts": E * 3 * H * cfg.moe_ffn_hidden_size,
            "replicated": E * H + 3 * H * Fs + (H if cfg.moe_shared_expert_gate else 0),
            "dense_mlp": 3 * H * cfg.ffn_hidden_size}


def _dense_equivalent_parameters(cfg) -> float:
    """num_parameters() with every MoE layer's MLP counted as the dense MLP it replaces."""
    moe = moe_layer_parameters(cfg)
    moe_layers = sum(moe_layer_flags(cfg))
    per_layer = moe["experts"] + moe["replicated"] - moe["dense_mlp"]   # MoE MLP - dense MLP
    return cfg.num_parameters() - moe_layers * per_layer


def expert_shard_ranks(n: int, tp: int = 1, ep: int = 1) -> int:
    """The ranks the experts' state is sharded (and their gradients reduced) over: with ep > 1
    their expert-data-parallel group, the stage's n*tp ranks / ep (ep folds over dp x cp x sp x
    tp, tp first: mesh.expert_groups); with ep 1 they are ordinary parameters, over the n = dp x
    sp (x cp) ranks like the rest (whole on every tp rank)."""
    if ep == 1:
        return n
    if (n * tp) % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide the {n * tp} ranks of "
                         f"a pipeline stage (dp*cp*sp*tp): choose a divisor of {n * tp}.")
    return n * tp // ep


def params_split_per_rank(cfg, tp: int, pp: int, ep: int = 1) -> tuple[float, float]:
    """(non-expert, expert) parameters held by one rank (params_per_rank's two parts): the routed
    experts of the heaviest stage's MoE layers (stage_layers), E/ep whole experts each; the rest
    as a dense model's (layers over tp and pp, embeddings over tp) with each MoE layer's dense MLP
    replaced by its router and shared expert, replicated over tp."""
    moe = moe_layer_parameters(cfg)
    moe_layers = _stage_moe_layers(cfg, pp)
    dense = _dense_params_per_rank(cfg, _dense_equivalent_parameters(cfg), tp, pp)
    rest = dense + moe_layers * (moe["replicated"] - moe["dense_mlp"] / tp)
    return rest, moe_layers * moe["experts"] / ep


def _dense_params_per_rank(cfg, total: float, tp: int, pp: int) -> float:
    """A dense model of `total` parameters on one rank: layers split over tp and pp; embeddings
    over tp (first and last stage hold them; counted on the heavier stage)."""
    V, H = cfg.padded_vocab_size(tp), cfg.hidden_size
    emb = V * H * (1 if cfg.tie_embeddings else 2)
    layers = total - cfg.vocab_size * H * (1 if cfg.tie_embeddings else 2)
    return layers / (tp * pp) + (emb / tp if pp == 1 else max(emb / tp / 2 * (2 if cfg.tie_embeddings else 1), 0) + 0)


def params_per_rank(cfg, tp: int, pp: int, ep: int = 1) -> float:
    """Parameters held by one rank: layers split over tp and pp; embeddings over tp (first and last
    stage hold them; counted on the heavier stage); a MoE layer's routed experts E/ep whole experts
    per rank, its router and shared expert whole on every tp rank (params_split_per_rank)."""
    return sum(params_split_per_rank(cfg, tp, pp, ep))


def _layer_unit_params(cfg, tp: int, ep: int) -> tuple[float, float]:
    """(dense layer, MoE layer) parameters of one layer's FSDP unit on one tp rank (the final norm
    spread over the layers); a MoE layer's unit holds its experts only with ep 1 (with ep > 1 they
    are their own unit, fsdp_expert_units)."""
    H = cfg.hidden_size
    tables = cfg.vocab_size * H * (1 if cfg.tie_embeddings else 2)
    positions = cfg.max_position_embeddings * H \
        if cfg.position_embedding_type == "learned_absolute" else 0
    dense = (_dense_equivalent_parameters(cfg) - tables - positions) / cfg.num_layers / tp
    moe = moe_layer_parameters(cfg)
    experts = moe["experts"] if ep == 1 else 0
    return dense, dense - moe["dense_mlp"] / tp + moe["replicated"] + experts


def fsdp_units(cfg, tp: int, pp: int, ep: int = 1) -> list[float]:
    """Parameters of each FSDP unit of one (tp, pp) slice, in forward order: the embedding, one unit
    per transformer layer, the output layer (the heavier pipeline stage: the first with pp > 1 when
    embeddings are tied, else the last; the final norm is counted with the output; with MoE layers
    the stage with the most, stage_layers). With ep > 1 a MoE layer's experts are a unit of their
    own inside the layer's (fsdp_expert_units), not counted here."""
    vocab = cfg.padded_vocab_size(tp) * cfg.hidden_size / tp
    dense, moe = _layer_unit_params(cfg, tp, ep)
    flags = moe_layer_flags(cfg)
    layers = [moe if flags[i] else dense for i in stage_layers(cfg, pp)]
    if pp == 1:
        return [vocab] + layers + ([] if cfg.tie_embeddings else [vocab])
    return [vocab] + layers            # first or last stage: one vocabulary-sized unit and its layers


def fsdp_expert_units(cfg, tp: int, pp: int, ep: int = 1) -> list[float]:
    """Parameters of the experts' own FSDP unit inside each unit of fsdp_units (sharding/fsdp.py
    _shard_experts: a MoE layer's E/ep experts with ep > 1, sharded over their edp group), aligned
    with fsdp_units; 0 elsewhere (dense layers, embeddings, ep 1)."""
    experts = moe_layer_parameters(cfg)["experts"] / ep if ep > 1 else 0
    flags = moe_layer_flags(cfg)
    layers = [experts if flags[i] else 0 for i in stage_layers(cfg, pp)]
    return [0] + layers + ([0] if pp == 1 and not cfg.tie_embeddings else [])


def fsdp_in_flight_params(cfg, tp: int, pp: int, ep: int = 1) -> float:
    """Parameters FSDP2 holds unsharded at once: the unit computing and the next one prefetched
    (the largest adjacent pair), + the computing layer's experts unit (ep > 1: gathered when its
    experts run, inside the layer's); with tied embeddings the shared table stays gathered from the
    embedding to the output layer, so it adds to every pair."""
    units, experts = fsdp_units(cfg, tp, pp, ep), fsdp_expert_units(cfg, tp, pp, ep)

    def pairs(u, x):
        return [a + b + max(xa, xb) for a, b, xa, xb in zip(u, u[1:], x, x[1:])] or \
            [a + xa for a, xa in zip(u, x)]
    if cfg.tie_embeddings and pp == 1:
        return units[0] + max(pairs(units[1:], experts[1:]))
    return max(pairs(units, experts))


def model_state_bytes(cfg, tp: int = 1, pp: int = 1, n: int = 1, sharding: str = "none",
                      cpu_offload: bool = False, bf16: bool = True, ep: int = 1) -> dict:
    """Model-state bytes per rank (docs/design.md §11), with P_r = params_per_rank(cfg, tp, pp, ep)
    and n = dp*sp (x cp); with experts P_r = P_n + P_e (params_split_per_rank), the experts'
    state sharded over m = expert_shard_ranks(n, tp, ep) (their edp group, n*tp/ep, when ep > 1)
    and the rest over n, so that below "P_r / n" reads P_n / n + P_e / m:

      none                   device 16 P_r (fp32 weights 4, fp32 grads 4, Adam m, v 8)
      distributed-optimizer  device 4 P_r weights + 4 P_r grads + 8 P_r / n Adam (our weights are
                             fp32: no separate master copy)
      fsdp                   device 16 P_r / n + the units in flight: the two largest adjacent
                             units unsharded (+ the computing layer's experts unit with ep > 1;
                             bf16 params and bf16 grads, 2 + 2 bytes/param under --bf16; 4 + 4 in
                             fp32) + the largest unit's reduce-scatter output (2 / n; 4 / n in
                             fp32; an experts unit's / m) and, with offload, its fp32 shard copied
                             to the device for the all-gather and its fp32 grad shard before the
                             copy to host (4 / n + 4 / n)
      + cpu_offload          the optimizer state and step move to host: 16 P_r / n on host (fp32
                             master shard 4, its grads 4, Adam 8); device keeps 8 P_r (distributed
                             optimizer: weights + grads) or the units in flight only (fsdp)

    Returns {"device", "host", "in_flight"} in bytes.
    """
    if sharding not in SHARDING_MODES:
        raise ValueError(f"sharding must be one of {SHARDING_MODES}, got {sharding!r}.")
    if cpu_offload and sharding == "none":
        raise ValueError("--optimizer-cpu-offload needs --use-distributed-optimizer or "
                         "--use-torch-fsdp2 (the offloaded optimizer state is the sharded one).")
    _check_moe_layout(cfg, 1, True, ep)
    Pn, Pe = params_split_per_rank(cfg, tp, pp, ep)
    m = expert_shard_ranks(n, tp, ep)
    P, shard = Pn + Pe, Pn / n + Pe / m           # this rank's parameters, and its shard of them
    in_flight = 0.0
    if sharding == "none":
        device, host = 16 * P, 0.0
    elif sharding == "distributed-optimizer":
        device, host = (8 * P, 16 * shard) if cpu_offload else (8 * P + 8 * shard, 0.0)
    else:
        e = 2 if bf16 else 4
        largest = max(max(fsdp_units(cfg, tp, pp, ep)) / n,          # a shard of the largest unit
                      max(fsdp_expert_units(cfg, tp, pp, ep)) / m)
        in_flight = fsdp_in_flight_params(cfg, tp, pp, ep) * 2 * e \
            + largest * (e + (8 if cpu_offload else 0))
        device, host = (in_flight, 16 * shard) if cpu_offload else (16 * shard + in_flight, 0.0)
    return {"device": device, "host": host, "in_flight": in_flight}


def pinned_bytes(nbytes: float) -> float:
    """Bytes torch's caching host allocator reserves for one pinned buffer: the next power of two."""
    return float(2 ** math.ceil(math.log2(nbytes))) if nbytes > 0 else 0.0


def _layer_tensor_numels(cfg, tp: int) -> list[float]:
    """Numel of each weight of one layer on one tp rank (norms and biases left out: < 0.1%)."""
    H, d, F = cfg.hidden_size, cfg.kv_channels, cfg.ffn_hidden_size
    h, g = cfg.num_attention_heads, cfg.num_query_groups
    fc1 = H * F * (2 if cfg.activation == "swiglu" else 1)
    return [H * (h + 2 * g) * d / tp, h * d * H / tp, fc1 / tp, F * H / tp]


def _moe_layer_shards(cfg, tp: int, ep: int, n: int, m: int) -> list[float]:
    """This rank's shard of each weight of one MoE layer (norms, the shared expert's gate left
    out): qkv and out-proj (over tp, then n), the router [E, H] and shared expert fc1 [2Fs, H],
    fc2 [H, Fs] (whole over tp, then n), the experts' w1 [E/ep, 2Fm, H] and w2 [E/ep, H, Fm]
    (over m = expert_shard_ranks)."""
    H, E, Fm = cfg.hidden_size, cfg.num_experts, cfg.moe_ffn_hidden_size
    Fs = cfg.moe_shared_expert_intermediate_size or 0
    attention = _layer_tensor_numels(cfg, tp)[:2]
    rest = [E * H] + ([2 * Fs * H, Fs * H] if Fs else [])
    return [x / n for x in attention + rest] + [E // ep * 2 * Fm * H / m, E // ep * H * Fm / m]


def host_state_pinned_bytes(cfg, tp: int, pp: int, n: int, pool: bool = False,
                            ep: int = 1) -> float:
    """Host bytes of the offloaded model state with the pinned rounding: the fp32 weight and
    gradient shards are pinned (FSDP2's CPUOffloadPolicy(pin_memory=True)), each rounded up to a
    power of two; Adam's m and v are plain host tensors (8 bytes/param, exact). pool: the shards
    are blocks of an exact host pool instead (the distributed optimizer's, host_pool.py): each
    aligned to host_pool.ALIGNMENT, no rounding to powers of two. Experts: their shards over m =
    expert_shard_ranks(n, tp, ep) (_moe_layer_shards)."""
    Pn, Pe = params_split_per_rank(cfg, tp, pp, ep)
    m = expert_shard_ranks(n, tp, ep)
    vocab = cfg.padded_vocab_size(tp) * cfg.hidden_size / tp
    tables = 2 if (pp == 1 and not cfg.tie_embeddings) else 1     # embedding (+ output layer)
    dense = [x / n for x in _layer_tensor_numels(cfg, tp)]
    shards = [vocab / n] * tables
    flags = moe_layer_flags(cfg)
    for i in stage_layers(cfg, pp):
        shards += _moe_layer_shards(cfg, tp, ep, n, m) if flags[i] else dense
    one = align_up if pool else pinned_bytes
    pinned = 2 * sum(one(4 * x) for x in shards)                  # weights and grads
    shard = Pn / n + Pe / m
    rest = max(shard - sum(shards), 0)                             # norms, biases: rounding ignored
    return pinned + 2 * 4 * rest + 8 * shard


# Communication ----------------------------------------------------------------------------------

def comm_bytes_per_step(cfg, work: Workload, dims: ParallelDims, sharding: str = "none",
                        cpu_offload: bool = False, ep: int = 1) -> dict:
    """Bytes one rank sends per optimizer step (forward + backward, recompute included), by kind,
    for `work` (its memory techniques, its --sequence-parallel, e = its dtype_bytes) on `dims`.

    tp: ring all-reduce 2(t-1)/t of the message (or all-gather + reduce-scatter (t-1)/t each with
    sequence sharding), 2 per layer forward, 2 backward, (+2 with full recompute); sp: Ulysses
    all-to-all (sp-1)/sp of q, k, v and out forward and backward (+ again under full recompute;
    + again with head chunks, whose k, v are max(gl, sp*N) heads: shared ones sent per chunk);
    pp: activations [b, s/sp, H] each way per micro-batch; dp: model state over dp x sp (n ranks):
    fp32 gradients all-reduced 2(n-1)/n (none; the distributed optimizer's reduce-scatter +
    all-gather moves the same bytes), FSDP2: bf16 parameters all-gathered in forward, in backward
    (and once more under full recompute) and bf16 gradients reduce-scattered, (n-1)/n each;
    host: with --optimizer-cpu-offload, the gradient shard down and the fp32 weight shard back up
    (4 + 4 bytes/param over PCIe, not a network link).

    Mixture of experts (ep = --expert-model-parallel-size): a MoE layer's MLP has no tp
    collective (each tp rank routes its own tokens under --sequence-parallel: 5 of the layer's 10
    units); edp: the experts' share of the dp term (their gradients and FSDP2 gathers over
    expert_shard_ranks: the edp group n*tp/ep with ep > 1, the n ranks with ep 1; dp keeps the
    rest over n); ep: the alltoall dispatcher (moe/dispatch.py dispatch_bytes), per MoE layer and
    micro-batch, under uniform routing, with Tm = T/t* tokens this rank routes and Nx the rows
    its experts compute (Tm*k; E*C padded to capacity), elements in the tokens' dtype r (fp32
    under bf16 autocast: the rows are the residual stream's):
      forward    the dispatch sends the Nx (ep-1)/ep rows bound for other ranks' experts, the
                 combine returns the as many received:       2 Nx (ep-1)/ep H r
      backward   the same two exchanges reversed:           2 Nx (ep-1)/ep H r
    and the forward's again under full recompute (the counts' int64 exchange is not counted).

    With a ring (dims.cp > 1; tokens per rank T = b*s/(sp*cp), so tp, sp and pp above carry the
    rank's T tokens: the hybrid's all-to-alls move the ring rank's tokens over its sp ranks) and
    cp: the ring's point-to-point bytes, per attention layer and rank, with K = T*max(gl, sp)*d
    elements of one k (or v) block [b, s/cp, max(gl, sp)/sp, d] (ring_buffer_bytes):
      forward    (cp-1) kv blocks:                          2 (cp-1) K e
      backward   the kv blocks again + cp fp32 dk, dv blocks: 2 (cp-1) K e + 2 cp K 4
    (tests/distributed/test_ring_attention.py measures exactly these with sp = 1:
    2 (cp-1) kv_elems 4 and 2 (cp-1) kv_elems 4 + cp 2 kv_elems 4 in fp32, and
    context_parallel.hybrid_comm_bytes equals them with sp = a, cp = r); the forward runs again
    under full recompute and under selective recompute (the recomputed attention core is the ring).
    Per step: micro-batches x L/pp layers x (forward x runs + backward).
    """
    tp, sp, pp, dp, cp = dims.tp, dims.sp, dims.pp, dims.dp, dims.cp
    memory, sequence_parallel, e = work.memory, work.sequence_parallel, work.dtype_bytes
    L = cfg.num_layers
    micro = work.micro_batches(dp)
    T = work.tokens_per_rank(dims.context)                        # b*s/(sp*cp)
    H, d = cfg.hidden_size, cfg.kv_channels
    recompute_factor = 1.5 if memory.full_recompute else 1.0    # forward run twice of fwd+bwd pairs
    moe_layers = _stage_moe_layers(cfg, pp)                      # this stage's (heaviest)
    out = {}
    if tp > 1:
        msg = T * H * e
        # Per layer and micro-batch, in units of (t-1)/t * msg: without --sequence-parallel four
        # all-reduces (2 forward, 2 backward) of 2 units each; with it 2 all-gathers + 2
        # reduce-scatters forward, and backward 2 re-gathers + 2 reduce-scatters (column-parallel
        # inputs kept sharded) + 2 all-gathers (row-parallel outputs). A MoE layer: attention's
        # half.
        units = 10 if sequence_parallel else 8
        layer_units = L * units - moe_layers * pp * units / 2        # per stage: / pp
        out["tp"] = micro * layer_units * (tp - 1) / tp * msg * recompute_factor / pp
    if sp > 1:
        hl, gl = cfg.num_attention_heads // tp, cfg.num_query_groups // tp
        # head chunks (N > 1): a key/value head shared by chunks is sent with each of them
        # (max(gl, sp*N) heads in all), and each chunk's forward all-to-alls run again in backward
        chunks = memory.ulysses_head_chunks
        a2a = (sp - 1) / sp * T * d * (2 * hl + 2 * max(gl, sp * chunks)) * e
        out["sp"] = micro * L * 2 * a2a * (recompute_factor + (0.5 if chunks > 1 else 0)) / pp
    if cp > 1:
        out["cp"] = micro * L * ring_layer_bytes(cfg, T, tp, sp, cp, e, memory) / pp
    if pp > 1:
        out["pp"] = micro * 2 * T * H * e / (tp if sequence_parallel else 1)
    if ep > 1 and moe_layers:
        r = _residual_bytes(sharding, e)
        Nx = _expert_rows(cfg, T / tp if sequence_parallel else T)[1]
        out["ep"] = micro * moe_layers * 4 * Nx * (ep - 1) / ep * H * r * recompute_factor
    n = dp * sp * cp
    m = expert_shard_ranks(n, tp, ep)
    Pn, Pe = params_split_per_rank(cfg, tp, pp, ep)
    for kind, params, ranks in (("dp", Pn, n), ("edp", Pe, m)):
        if ranks > 1 and params:
            out[kind] = _gradient_sync_bytes(params, ranks, sharding, e, memory, micro)
    if cpu_offload:
        out["host"] = 8 * (Pn / n + Pe / m)
    return out


def _gradient_sync_bytes(params: float, n: int, sharding: str, e: int, memory: MemoryOptions,
                         micro: int) -> float:
    """Bytes one rank sends per step to keep `params` in sync over n ranks: fp32 gradients
    all-reduced 2(n-1)/n (the distributed optimizer's reduce-scatter + all-gather moves as many);
    FSDP2 e-byte parameters gathered in each forward, backward (and recompute) and gradients
    reduce-scattered once, (n-1)/n each."""
    if sharding == "fsdp":
        gathers = (3 if memory.full_recompute else 2) * micro
        return (gathers + 1) * (n - 1) / n * params * e
    return 2 * (n - 1) / n * params * 4


def _residual_bytes(sharding: str, e: int) -> int:
    """Element size of the residual stream (and of the tokens a MoE layer dispatches): 2 under
    FSDP2 with bf16 parameters (MixedPrecisionPolicy), else 4 (fp32 weights, bf16 autocast)."""
    return 2 if (sharding == "fsdp" and e == 2) else 4


def ring_layer_bytes(cfg, T: float, tp: int, sp: int, cp: int, e: int,
                     memory: MemoryOptions | None = None) -> float:
    """Bytes one rank sends around the ring for one attention layer and micro-batch, forward (run
    twice under full or selective recompute) + backward (comm_bytes_per_step's formula)."""
    if cp == 1:
        return 0.0
    memory = memory or MemoryOptions()
    K = ring_buffer_bytes(cfg, T, tp, sp, cp, e)["block_elements"]
    forward = 2 * (cp - 1) * K * e
    backward = 2 * (cp - 1) * K * e + 2 * cp * K * 4
    runs = 2 if (memory.full_recompute or memory.selective_recompute) else 1
    return forward * runs + backward


# The attention kernel ---------------------------------------------------------------------------

_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16",
                "float": "float32"}
_SDPA_CAPABILITY = (9, 0)   # the GPU the planner's defaults describe (H100/H200: 989 TFLOP/s)


def _torch_dtype(dtype):
    """A torch dtype from one (returned as is), a name ("bf16", "bfloat16", "fp32", ...) or the
    planner's element size (2: bf16, its --bf16; 4: fp32)."""
    import torch
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype not in (2, 4):
            raise ValueError(f"an element size of 2 (bf16) or 4 (fp32) bytes, got {dtype}.")
        return torch.bfloat16 if dtype == 2 else torch.float32
    name = _DTYPE_NAMES.get(str(dtype), str(dtype).replace("torch.", ""))
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"not a dtype: {dtype!r}.")
    return found


@functools.lru_cache(maxsize=None)
def attention_kernel_name(device: str = "cuda", dtype=2, head_dim: int = 128, cp: int = 1,
                          documents: bool = False) -> str:
    """The attention kernel one layer runs (module docstring): "sdpa" (SDPA's own choice, cp = 1
    without documents), else the block kernel of the ring's blocks and the documents' segments,
    attention/block_kernels.block_kernel's "flash" (FlashAttention-2 varlen), "efficient" or
    "cpu" ("math" for a dtype no fused kernel takes). dtype: a torch dtype, a name or the element
    size (2: bf16, 4: fp32)."""
    _check_device(device)
    if cp == 1 and not documents:
        return "sdpa"
    import torch
    from megatron_sp.attention.block_kernels import block_kernel
    return block_kernel(torch.device(device), _torch_dtype(dtype), head_dim)


@functools.lru_cache(maxsize=None)
def attention_kernel(device: str = "cuda", dtype=2, head_dim: int = 128, cp: int = 1,
                     documents: bool = False) -> str:
    """A short description of the attention kernel the plan assumes on `device` (pure: the same
    choice as attention_kernel_name, in block_kernels.KERNEL_DESCRIPTIONS' words), e.g. on CUDA
    in bf16 with a ring "FlashAttention-2 varlen (aten._flash_attention_forward/_backward), ring
    blocks as segments"."""
    kernel = attention_kernel_name(device, dtype, head_dim, cp, documents)
    if kernel == "sdpa":
        from megatron_sp.attention.kernels import sdpa_kernel_plan
        capability = _SDPA_CAPABILITY if device == "cuda" else None
        reason = sdpa_kernel_plan(capability, _torch_dtype(dtype), False, 0.0, 0)[1]
        return f"SDPA without a ring or documents: {reason}"
    from megatron_sp.attention.block_kernels import KERNEL_DESCRIPTIONS
    name = KERNEL_DESCRIPTIONS[kernel].split(", one call")[0]
    what = ("ring blocks and packed documents" if cp > 1 and documents
            else "ring blocks" if cp > 1 else "packed documents")
    return f"{name}, {what} as segments"


def _kernel_gqa_bytes(kernel: str, device: str, q: float, e: int, gqa: bool) -> float:
    """Bytes of the kernel's own key/value head handling in one attention backward (module
    docstring): FlashAttention-2 (SDPA's on CUDA, or varlen) 2 q e under GQA (dk, dv expanded
    to the query heads), the memory-efficient block kernel 4 q e (k, v repeated per segment and
    their gradients at the query heads), aten's CPU flash kernel (SDPA's or per segment) none."""
    if kernel == "math":
        raise ValueError("attention in this dtype has no fused kernel (the math path keeps "
                         "[b, h, sq, sk] scores): plan bf16 (2 bytes) or fp32 (4).")
    if kernel == "cpu" or (kernel == "sdpa" and device == "cpu"):
        return 0.0
    if kernel == "efficient":
        return 4 * q * e
    return 2 * q * e if gqa else 0.0


def plan_index_bytes(seq: int, micro_batch: int = 1, *, cp: int = 1, kernel: str = "flash",
                     documents: bool = False, in_flight_micro_batches: int = 1) -> float:
    """Bytes of the attention plans' int64 token indices per rank (module docstring): only for
    the varlen kernel ("flash") and packed documents (without them every segment runs on views:
    no indices); blockwise attention (cp = 1) at most 2*b*s, the ring's plan (cp > 1) at most
    b*3c*(cp+1) with c = s/(2cp) (segments of 4096 tokens and up run on views and need none:
    an upper bound), once per micro-batch in flight. Linear in s; cu_seqlens not counted."""
    if kernel != "flash" or not documents:
        return 0.0
    b = micro_batch
    indices = 2 * b * seq if cp == 1 else b * 3 * (seq / (2 * cp)) * (cp + 1)
    return 8 * indices * in_flight_micro_batches


# Peak device memory of one step -----------------------------------------------------------------

def _layer_backward_peak(cfg, T, tp, sp, seqpar, e, r, memory: MemoryOptions,
                         device="cuda", cp=1, documents=False, moe=False, ep=1) -> float:
    """Bytes alive during one layer's backward, its own saved tensors included: the larger of
    - the MLP phase: every saved tensor + the residual-stream gradient (Ts*H*r) + the MLP's
      recomputed activations and their gradients (one tile's when tiled) + the tile input's gradient;
      a MoE layer's (moe) + its backward's transients instead (_moe_backward_bytes);
    - the attention kernel's backward: the MLP block's tensors and the out-projection input freed
      (sp > 1; with sp = 1 it is the kernel's saved output), attention's regenerated (selective), +
      the residual gradient + the kernel's buffers: grad of its output, dq and its fp32 accumulator,
      dk, dv, and the kernel's own key/value head handling (_kernel_gqa_bytes, by
      attention_kernel_name(device, e, d, cp, documents): FlashAttention-2 expands dk, dv to the
      local query heads under GQA, the memory-efficient block kernel repeats k, v per segment,
      the CPU kernel neither); with a ring (cp > 1) + its backward buffers in flight
      (ring_buffer_bytes: two kv blocks, three fp32 dk, dv blocks).
    Later phases (the Ulysses all-to-all of dq, dk, dv; the QKV and norm backward) hold less: the
    kernel's buffers and saved q, k, v are freed by then."""
    H, d, F = cfg.hidden_size, cfg.kv_channels, cfg.ffn_hidden_size
    hl, gl = cfg.num_attention_heads // tp, cfg.num_query_groups // tp
    Ts = T / tp if seqpar else T
    swiglu = cfg.activation == "swiglu"
    chunks = getattr(memory, "ulysses_head_chunks", 1)
    plain = MemoryOptions(mlp_tiles=memory.mlp_tiles,          # attention regenerated if selective
                          ulysses_head_chunks=chunks)
    terms = _layer_terms(cfg, T, tp, sp, seqpar, e, plain, weight_copies=False, r=r, device=device,
                         moe=moe, ep=ep)
    saved = sum(terms.values())
    grads = Ts * H * r
    if moe:
        mlp = saved + grads + _moe_backward_bytes(cfg, Ts, e, r, device, ep)
    else:
        width = F * (2 if swiglu else 1) // tp
        tiles = resolve_count(memory.mlp_tiles, int(Ts), width, H) if memory.mlp_tiles != 1 else 1
        Tt = T / tiles                                           # tokens of one tile (gathered)
        act = (4 if swiglu else 2) * Tt * F / tp * e             # fc1 out, act, fc2 in of one tile
        mlp = saved + grads + (2 * act if tiles > 1 else act) + Tt * H * e
    kv = T * d * max(gl, sp)                  # k or v elements at the kernel (as _layer_terms)
    q = T * hl * d
    kernel = attention_kernel_name(device, e, d, cp, documents)
    expanded = _kernel_gqa_bytes(kernel, device, q, e, gqa=hl > max(gl, sp))
    attn_bwd = q * (e + e + 4) + expanded + 2 * kv * e
    ring = ring_buffer_bytes(cfg, T, tp, sp, cp, e)["backward"] if cp > 1 else 0
    if chunks > 1:
        # Head chunks (SelfAttention): across the chunks the block input's gradient accumulates
        # (Ts*H*e); one chunk at a time the larger of its kernel phase (its recomputed local q,
        # k, v; with sp > 1 their head-layout copies; the kernel's saved out and fp32 lse, the
        # out gradient and the kernel's buffers at kvn = T*max(gl, sp*N)*d/N k or v elements)
        # and its projection phase (the QKV gradient and the input gradient T*H*e); under
        # autocast the accumulated bf16 gradient's cast back to the residual's dtype ends it.
        qn, kvn = q / chunks, T * d * max(gl, sp * chunks) / chunks
        local = (qn + 2 * T * d * max(gl // chunks, 1)) * e
        head = (qn + 2 * kvn) * e if sp > 1 else 0
        kernel_phase = (local + head + qn * e + T * hl / chunks * 4
                        + qn * (e + e + 4) + expanded / chunks + 2 * kvn * e)
        projection = local + T * H * e
        attn_bwd = max(Ts * H * e + max(kernel_phase, projection), Ts * H * (e + r) if r != e else 0)
        ring *= max(gl, sp * chunks) / (chunks * max(gl, sp))
    mlp_block = sum(terms.get(name, 0) for name in MLP_TERMS)
    attention = (saved - mlp_block - (terms["proj_input"] if sp > 1 or chunks > 1 else 0)
                 + grads + attn_bwd + ring)
    return max(mlp, attention)


def _moe_backward_bytes(cfg, Tm, e, r, device="cuda", ep=1) -> float:
    """The most one MoE layer's MLP backward holds beyond its saved tensors and the residual
    gradient, over Tm tokens (N routed rows, Nx at the experts: _expert_rows; El = E/ep local
    experts; measured on CPU with LiveTensorPeak, tests/unit/test_planner_moe.py), the largest of
    its phases in backward order:
      shared    the shared expert's, a dense SwiGLU of Fs: at most its fc1 output's gradient
                [Tm, 2Fs] e (its saved activations are freed as their gradients form); then all
                its saved tensors are freed (_shared_expert_bytes) and its tokens' gradient
                (Tm*H*r) stays
      combine   unpermute's backward: index_add frees the weighted rows and gives their gradient
                [N, H] r, whose product with the weights and with the fp32 expert output makes
                two [N, H] fp32 (+ its fp32 cast with 16-bit rows):     N*H*(8 (+4))
      experts   unpermute's saved tensors freed (N*H*(4 + r) + N*p + 2*N*8), + the largest of
                the second GEMM's backward (the expert output's gradient [Nx, H], w2's El*H*Fm
                and its input's [Nx, Fm]), the SwiGLU's (the product's, silu's and up's gradients,
                its saved product freed: 2 [Nx, Fm]) and the first GEMM's (h's gradient [Nx, 2Fm],
                its input's [Nx, H], w1's El*2*Fm*H with w2's still held: their transposes'
                backward runs after it; the SwiGLU's saved 4 [Nx, Fm] freed), all in r."""
    H, Fm, El = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_experts // ep
    N, Nx = _expert_rows(cfg, Tm)
    Fs = cfg.moe_shared_expert_intermediate_size or 0
    shared = Tm * 2 * Fs * e
    after_shared = Tm * H * r - _shared_expert_bytes(cfg, Tm, e, r, e != r) if Fs else 0
    combine = after_shared + N * H * (8 + (4 if r != 4 else 0))
    freed = N * H * (4 + r) + N * router_prob_bytes(cfg, e, r, device) + 2 * N * 8
    gemm2 = Nx * H + El * H * Fm + Nx * Fm
    swiglu = 2 * Nx * Fm
    gemm1 = Nx * 2 * Fm + Nx * H + El * 3 * Fm * H - Nx * 4 * Fm
    experts = after_shared - freed + max(gemm2, swiglu, gemm1) * r
    return max(shared, combine, experts)


def _output_peak(cfg, T, tp, seqpar, e, r, memory: MemoryOptions, saved: float) -> float:
    """Bytes alive at the output layer's peak: its saved tensors + the logits [T, V/tp] in flight
    (+ the gradient of its input). The cross entropy copies the logits (e bytes) to fp32 and keeps
    that copy as its saved softmax, which its backward turns into the gradient in place, cast back
    to e bytes (a new tensor under 16-bit only). Unchunked, `saved` already holds the fp32 softmax:
    the peak adds the logits (forward) or the gradient's cast (backward), T*V*e either way.
    Chunked, `saved` holds only the chunks' inputs: one chunk's logits and fp32 copy (forward and
    recompute), or its fp32 gradient and cast, (e + 4) bytes per element, + one fp32 gradient of
    the output weight [V/tp, H] before it is accumulated (no longer small next to one chunk).
    Measured on CPU with the profiler's memory timeline (tests/unit/test_planner.py); the H200 run
    of bench/gpu_long_context.py agrees (full recompute at 128K)."""
    H = cfg.hidden_size
    V = cfg.padded_vocab_size(tp) // tp
    chunks = 1 if memory.loss_chunks == 1 else resolve_count(memory.loss_chunks, int(T), V, H)
    if chunks > 1:
        return saved + T / chunks * V * (e + 4) + V * H * 4 + T * H * r
    gathered = memory.loss_chunks != 1 or not seqpar      # ("auto" as one chunk: the gathered input)
    return saved + T * V * e + (T if gathered else T / tp) * H * r


def step_peak_bytes(cfg, seq: int, micro_batch: int = 1, *, tp: int = 1, sp: int = 1, pp: int = 1,
                    sequence_parallel: bool = False, memory: MemoryOptions | None = None,
                    dtype_bytes: int = 2, residual_bytes: int = 4, in_flight_micro_batches: int = 1,
                    pinned: bool = True, device: str = "cuda", cp: int = 1,
                    documents: bool = False, host_pool: bool = False, ep: int = 1) -> dict:
    """Peak activation bytes of one step on one rank (the heaviest pipeline stage), and host bytes.

    kept: what the forward leaves for backward (all layers', or only the checkpointed inputs under
    full recompute; on host with offload), times the micro-batches 1F1B keeps in flight; then the
    larger of the output layer's backward and one layer's backward (recomputed first under full
    recompute; its saved tensors come back from host with offload). Host: the offloaded tensors,
    each rounded up to a power of two when pinned (torch's caching host allocator), or with
    host_pool the blocks of the exact host pool (host_pool.py: each aligned to ALIGNMENT bytes, the
    pool's slab; RoPE's cos and sin copied once for all layers). device: "cuda"
    or "cpu", whose RMSNorm kernel (module docstring). cp: the ring's degree (T = b*s/(sp*cp); the
    ring's backward buffers join one layer's attention backward; "ring" in the result gives them).
    documents: packed documents as segments. Over the whole step the attention plans' index
    tensors (plan_index_bytes: the varlen kernel's, ring or documents; "index" in the result) are
    added; "kernel" names the attention kernel (attention_kernel_name). ep:
    --expert-model-parallel-size (MoE layers: each kind of layer the stage has is tried for the
    layer backward).
    """
    memory = memory or MemoryOptions()
    e, r = dtype_bytes, residual_bytes
    seqpar = sequence_parallel and tp > 1
    L = cfg.num_layers // pp
    act = activation_bytes(cfg, seq, micro_batch, tp=tp, sp=sp, sequence_parallel=seqpar,
                           num_layers=L, memory=memory, dtype_bytes=e, residual_bytes=r,
                           device=device, cp=cp, ep=ep)
    T = micro_batch * seq / (sp * cp)
    Ts = T / tp if seqpar else T
    ckpt_input = Ts * cfg.hidden_size * r
    kept = (act["layers"] + act["embedding"] + act["shared"]) * in_flight_micro_batches
    kernel = attention_kernel_name(device, e, cfg.kv_channels, cp, documents)
    index = plan_index_bytes(seq, micro_batch, cp=cp, kernel=kernel, documents=documents,
                             in_flight_micro_batches=in_flight_micro_batches)
    workings = []
    for kind, (layer_bytes, _) in act["by_kind"].items():
        layer_peak = _layer_backward_peak(cfg, T, tp, sp, seqpar, e, r, memory, device, cp,
                                          documents, moe=kind == "moe", ep=ep)
        if memory.full_recompute:
            group = memory.recompute_num_layers if memory.recompute_method == "uniform" else 1
            # the group's input is the first norm's saved input: counted in kept unless offloaded
            workings.append(layer_peak + (group - 1) * act["layer"]
                            - (0 if memory.offload_activations else ckpt_input))
        else:
            workings.append(layer_peak - (0 if memory.offload_activations else layer_bytes))
    working = max(workings)
    output = _output_peak(cfg, T, tp, seqpar, e, r, memory, act["output"])
    on_device = kept + max(output, working) + index
    host = 0.0
    if memory.offload_activations:
        if memory.full_recompute:
            groups = math.ceil(L / memory.recompute_num_layers) \
                if memory.recompute_method == "uniform" else min(memory.recompute_num_layers, L)
            tables = act["host"] - groups * ckpt_input                    # RoPE's cos and sin
            if host_pool:
                host = groups * align_up(ckpt_input) + 2 * align_up(tables / 2)
            else:
                host = groups * (pinned_bytes(ckpt_input) if pinned else ckpt_input) + tables
        else:
            host = act["host"]
        host *= in_flight_micro_batches
    return {"device": on_device, "host": host, "kept": kept, "layer_backward": working,
            "output_backward": output, "activations": act,
            "ring": ring_buffer_bytes(cfg, T, tp, sp, cp, e), "index": index, "kernel": kernel}


# Planner ----------------------------------------------------------------------------------------

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
    FLOP/s (GPUs x bf16 dense peak). From them tokens_per_s and mfu."""
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
        if self.sp == 1:
            return [f"--context-parallel-size {self.cp}", "--cp-comm-type p2p"]
        return [f"--context-parallel-size {self.sp * self.cp}", "--cp-comm-type a2a+p2p",
                f"--hierarchical-context-parallel-sizes {self.sp} {self.cp}"]

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
        return [*self.job_flags(), "--bf16", *self.layout_flags(), *self.memory_flags()]

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
            "model_flops", "ep", "etp", "total_parameters", "active_parameters")}
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
    an integer N, just it (none when 1)."""
    from megatron_sp.ulysses.attention import head_chunk_problem
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


def _divisors(n):
    return [i for i in range(1, n + 1) if n % i == 0]


def layouts(hw: Hardware, ring: bool = False) -> list[ParallelDims]:
    """Every (tp, sp, pp, dp) of hw.num_gpus ranks with tp inside one node, tp then sp then pp
    ascending (the planner's order, which breaks ties between equal scores); with ring, then
    every layout with a ring of cp > 1 ranks (tp, sp, cp, pp ascending), after all those without
    one, so that a tie keeps the layout without a ring first."""
    n = hw.num_gpus
    tps = [tp for tp in _divisors(min(n, hw.gpus_per_node)) if n % tp == 0]
    plain = [ParallelDims(n, tp=tp, sp=sp, pp=pp)
             for tp in tps
             for sp in _divisors(n // tp)
             for pp in _divisors(n // (tp * sp))]
    if not ring:
        return plain
    return plain + [ParallelDims(n, tp=tp, sp=sp, pp=pp, cp=cp)
                    for tp in tps
                    for sp in _divisors(n // tp)
                    for cp in _divisors(n // (tp * sp)) if cp > 1
                    for pp in _divisors(n // (tp * sp * cp))]


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
    eps = [fixed] if fixed is not None else _divisors(cfg.num_experts)
    return [ep for ep in eps if stage % ep == 0]


def _check_expert_parallel_size(cfg, ep) -> None:
    """A fixed --expert-model-parallel-size (Workload.expert_parallel_size) the model can take, or
    ValueError in one sentence: a positive integer, 1 for a dense model, a divisor of
    num_experts."""
    if ep is None:
        return
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"--expert-model-parallel-size must be a positive integer, got {ep!r}.")
    _check_moe_layout(cfg, 1, True, ep)


def _step_seconds(p: Plan, work: Workload, hw: Hardware, compute_s: float) -> float:
    """Estimated seconds per step: the sum of _step_parts."""
    return sum(_step_parts(p, work, hw, compute_s))


def _step_parts(p: Plan, work: Workload, hw: Hardware, compute_s: float) -> tuple[float, float]:
    """(compute, communication) seconds of one step: compute (x technique cost, x pipeline
    bubble) and communication (not overlapped: a pessimistic bound, also for the ring's
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

    Score: estimated step seconds = model FLOPs / (GPUs x peak x mfu) x technique cost (recompute
    ~ +1/3) x (1 + pipeline bubble) + communication bytes / bandwidth (tp inside a node; sp, pp and dp
    cross nodes when the layout spans them; GB/s per GPU; offloaded state over PCIe). Each plan
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
    """
    from megatron_sp.training.flops import flops_for_config
    _check_expert_parallel_size(cfg, work.expert_parallel_size)
    progress = progress or SearchProgress()
    candidates = sharding_candidates(sharding, cpu_offload)
    flops = flops_for_config(cfg, work.global_batch, work.seq)
    peak = hw.num_gpus * hw.peak_tflops * 1e12
    compute_s = flops / (peak * hw.mfu)
    plans = []
    for dims in layouts(hw, ring):
        best = _best_fit(cfg, work, dims, hw, candidates, compute_s) \
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
              compute_s: float) -> Plan | None:
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
                p.compute_s, p.comm_s = _step_parts(p, job, hw, compute_s)
                p.score = p.compute_s + p.comm_s
                fits.append(p)
    return min(fits, key=lambda q: q.score) if fits else None


def _model_state(cfg, dims: ParallelDims, mode: str, offload: bool, e: int,
                 ep: int = 1) -> tuple[float, float]:
    """(device, host) bytes of the model state per rank, sharded over n = dp x sp (x cp: the mesh's
    dp_sp group spans the whole context; docs/design.md §11; experts over expert_shard_ranks);
    under bf16 autocast (not FSDP2) + the cast cache's bf16 copy of every weight, which
    aten::linear saves for backward (docs/design.md §9's 18 bytes/param), but the routed experts':
    their grouped GEMMs run in the tokens' fp32 (autocast has no rule for them) on the weights
    themselves."""
    n = dims.dp * dims.context
    device = model_state_bytes(cfg, dims.tp, dims.pp, n, mode, offload, bf16=e == 2,
                               ep=ep)["device"]
    if mode != "fsdp" and e == 2:
        device += 2 * params_split_per_rank(cfg, dims.tp, dims.pp, ep)[0]
    # the distributed optimizer's offloaded shards are blocks of its exact host pool; FSDP2's
    # CPUOffloadPolicy pins through torch's caching host allocator (powers of two)
    host = host_state_pinned_bytes(cfg, dims.tp, dims.pp, n, pool=mode == "distributed-optimizer",
                                   ep=ep) if offload else 0.0
    return device, host


def _fit(cfg, work: Workload, dims: ParallelDims, hw: Hardware, mode: str,
         offload: bool, ep: int = 1, ladder=None) -> Plan | None:
    """The first of technique_candidates (the technique ladder, with Ulysses head chunks; ladder:
    them with concrete_memory's counts, as _best_fit computes them once per layout) that fits
    device and host memory, as a Plan."""
    e = work.dtype_bytes
    state_device, state_host = _model_state(cfg, dims, mode, offload, e, ep)
    r = _residual_bytes(mode, e)
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
                               ep=ep)
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
                        etp=1 if is_moe(cfg) else None)
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
