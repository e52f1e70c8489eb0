"""Peak device memory of one step: what the forward keeps, one layer's backward with the attention
kernel's buffers, the output layer, and the attention plans' index tensors (docs/design.md §9, §14).

The attention kernel (`attention_kernel`: its description, printed with every plan;
`attention_kernel_name`): without a ring and without packed documents SDPA
(F.scaled_dot_product_attention: on CUDA cuDNN attention, else FlashAttention-2, else the
memory-efficient kernel; on CPU aten's CPU flash kernel); a ring's blocks and packed documents run
as segments through the fused block kernels (attention/block_kernels.block_kernel): on CUDA
FlashAttention-2 varlen in fp16/bf16 (a head dim that is a multiple of 8, at most 256), else the
memory-efficient kernel, on CPU aten's CPU flash kernel. Their buffers in one attention backward
(`layer_backward_peak`), beyond dout, dq, its fp32 accumulator, dk and dv, with q = T*hl*d
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

Peak of one step (`step_peak_bytes`): what the forward keeps for backward + the larger of the output
layer's peak (its logits in flight, forward or backward) and one layer's backward (recomputed under
full recompute), each with its working buffers (gradients, the attention kernel's dq accumulator,
one MLP tile, one loss chunk's logits; a MoE layer's largest backward phase, moe.moe_backward_bytes:
unpermute's fp32 products N*H*8, the shared expert's fc1 gradient, or the experts' weight
gradients, w1's and w2's held together), + the attention plans' index tensors (plan_index_bytes).
"""
from __future__ import annotations

import math

from megatron_sp.attention.kernels import attention_kernel_name
from megatron_sp.memory.host_pool import align_up
from megatron_sp.memory.options import MemoryOptions, resolve_count
from megatron_sp.memory.planner.activations import activation_bytes, layer_terms, ring_buffer_bytes
from megatron_sp.memory.planner.fp8 import fp8_transient_bytes
from megatron_sp.memory.planner.moe import MLP_TERMS, moe_backward_bytes
from megatron_sp.memory.planner.state import pinned_bytes

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


def layer_backward_peak(cfg, T, tp, sp, seqpar, e, r, memory: MemoryOptions,
                         device="cuda", cp=1, documents=False, moe=False, ep=1) -> float:
    """Bytes alive during one layer's backward, its own saved tensors included: the larger of
    - the MLP phase: every saved tensor + the residual-stream gradient (Ts*H*r) + the MLP's
      recomputed activations and their gradients (one tile's when tiled) + the tile input's gradient;
      a MoE layer's (moe) + its backward's transients instead (moe_backward_bytes);
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
    terms = layer_terms(cfg, T, tp, sp, seqpar, e, plain, weight_copies=False, r=r, device=device,
                         moe=moe, ep=ep)
    saved = sum(terms.values())
    grads = Ts * H * r
    if moe:
        mlp = saved + grads + moe_backward_bytes(cfg, Ts, e, r, device, ep)
    else:
        width = F * (2 if swiglu else 1) // tp
        tiles = resolve_count(memory.mlp_tiles, int(Ts), width, H) if memory.mlp_tiles != 1 else 1
        Tt = T / tiles                                           # tokens of one tile (gathered)
        act = (4 if swiglu else 2) * Tt * F / tp * e             # fc1 out, act, fc2 in of one tile
        mlp = saved + grads + (2 * act if tiles > 1 else act) + Tt * H * e
    kv = T * d * max(gl, sp)                  # k or v elements at the kernel (as layer_terms)
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


def _mlp_tile_tokens(cfg, T, Ts, tp, memory: MemoryOptions) -> float:
    """The tokens one dense MLP tile's linears see (T untiled; layer_backward_peak's tiles)."""
    if memory.mlp_tiles == 1:
        return T
    width = cfg.ffn_hidden_size * (2 if cfg.activation == "swiglu" else 1) // tp
    return T / resolve_count(memory.mlp_tiles, int(Ts), width, cfg.hidden_size)


def step_peak_bytes(cfg, seq: int, micro_batch: int = 1, *, tp: int = 1, sp: int = 1, pp: int = 1,
                    sequence_parallel: bool = False, memory: MemoryOptions | None = None,
                    dtype_bytes: int = 2, residual_bytes: int = 4, in_flight_micro_batches: int = 1,
                    pinned: bool = True, device: str = "cuda", cp: int = 1,
                    documents: bool = False, host_pool: bool = False, ep: int = 1,
                    fp8_recipe: str | None = None) -> dict:
    """Peak activation bytes of one step on one rank (the heaviest pipeline stage), and host bytes.

    kept: what the forward leaves for backward (all layers', or only the checkpointed inputs under
    full recompute; on host with offload), times the micro-batches 1F1B keeps in flight; then the
    larger of the output layer's backward and one layer's backward (recomputed first under full
    recompute; its saved tensors come back from host with offload). Host: the offloaded tensors,
    each rounded up to a power of two when pinned (torch's caching host allocator), or with
    host_pool the blocks of the exact host pool (host_pool.py: each aligned to ALIGNMENT bytes, the
    pool's slab; RoPE's cos and sin copied once for all layers). device: "cuda" or "cpu", whose
    RMSNorm kernel (activations.py's docstring). cp: the ring's degree (T = b*s/(sp*cp); the
    ring's backward buffers join one layer's attention backward; "ring" in the result gives them).
    documents: packed documents as segments. Over the whole step the attention plans' index
    tensors (plan_index_bytes: the varlen kernel's, ring or documents; "index" in the result) are
    added; "kernel" names the attention kernel (attention_kernel_name). ep:
    --expert-model-parallel-size (MoE layers: each kind of layer the stage has is tried for the
    layer backward). fp8_recipe: the projections and dense MLP in FP8 with this torchao recipe
    (planner/fp8.py; None: not): no weight copies kept for them, and one FP8 linear's backward
    transients (fp8_transient_bytes, "fp8" in the result) on top of the layer backward.
    """
    memory = memory or MemoryOptions()
    e, r = dtype_bytes, residual_bytes
    seqpar = sequence_parallel and tp > 1
    L = cfg.num_layers // pp
    act = activation_bytes(cfg, seq, micro_batch, tp=tp, sp=sp, sequence_parallel=seqpar,
                           num_layers=L, memory=memory, dtype_bytes=e, residual_bytes=r,
                           device=device, cp=cp, ep=ep, fp8=fp8_recipe is not None)
    T = micro_batch * seq / (sp * cp)
    Ts = T / tp if seqpar else T
    ckpt_input = Ts * cfg.hidden_size * r
    kept = (act["layers"] + act["embedding"] + act["shared"]) * in_flight_micro_batches
    kernel = attention_kernel_name(device, e, cfg.kv_channels, cp, documents)
    index = plan_index_bytes(seq, micro_batch, cp=cp, kernel=kernel, documents=documents,
                             in_flight_micro_batches=in_flight_micro_batches)
    workings = []
    fp8 = {}
    for kind, (layer_bytes, _) in act["by_kind"].items():
        layer_peak = layer_backward_peak(cfg, T, tp, sp, seqpar, e, r, memory, device, cp,
                                          documents, moe=kind == "moe", ep=ep)
        if fp8_recipe is not None:
            fp8[kind] = fp8_transient_bytes(cfg, T, tp, e, fp8_recipe, device, kind == "moe",
                                            _mlp_tile_tokens(cfg, T, Ts, tp, memory))
            layer_peak += fp8[kind]
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
            "ring": ring_buffer_bytes(cfg, T, tp, sp, cp, e), "index": index, "kernel": kernel,
            "fp8": max(fp8.values(), default=0.0)}
