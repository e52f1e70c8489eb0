"""Activation bytes one rank saves for backward (docs/design.md §9).


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
                    backward (peak.layer_backward_peak) holds the input's gradient accumulating over
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
The backward's are added to one layer's attention backward (`peak.layer_backward_peak`). The forward's
never set the peak: the backward holds the same two kv blocks, and its dq fp32 accumulator is as
large as the forward's fp32 out accumulator, on top of gradients the forward does not have.

Korthikanti et al. (16-bit, attention matrix stored): `korthikanti_layer_bytes`.

Element sizes: e for what the matmuls keep (their autocast copies: 2 under --bf16), r for the
residual stream, the checkpointed layer inputs and what the tiles/chunks keep (4 under bf16 autocast
over fp32 weights, 2 when the weights themselves are bf16, as FSDP2's MixedPrecisionPolicy makes
them). `device` picks torch's RMSNorm: "cuda" (the default: the planner plans GPUs) runs the fused
kernel, which keeps the input and rstd; "cpu" runs the composite, which keeps fp32 copies (x, rstd,
x_hat). The per-term model equals the measured saved bytes on CPU in fp32, under bf16 autocast and
with bf16 weights (tests/unit/test_planner.py, device="cpu").
"""
from __future__ import annotations

import math

from megatron_sp.memory.options import MemoryOptions, resolve_count
from megatron_sp.memory.planner.job import check_device
from megatron_sp.memory.planner.moe import check_moe_layout, moe_terms, stage_kinds

def fused_rms_norm(device: str) -> bool:
    """Whether torch's RMSNorm runs its fused kernel on `device`: aten::_fused_rms_norm (torch >= 2.8)
    has CUDA and MPS kernels whose backward needs only the input and rstd; elsewhere, and in older
    torch, F.rms_norm is the composite of fp32 ops (pow, mean, rsqrt, two products), which keeps x,
    rstd and x_hat in fp32. On an H200 (torch 2.11, bench/gpu_long_context.py, stop 21) the measured
    peaks were one fp32 [T, H] per RMSNorm under the composite's count."""
    check_device(device)
    import torch
    return device == "cuda" and hasattr(torch.ops.aten, "_fused_rms_norm")


def _norm_bytes(cfg, Ts, r, device) -> float:
    """Bytes one norm keeps for backward over Ts tokens, its input in r bytes per element: LayerNorm
    (torch's fused kernel on every device) x + mean and rstd; RMSNorm x + fp32 rstd when fused,
    else the composite's fp32 x, rstd and x_hat (also for a 16-bit input, which it upcasts first)."""
    H = cfg.hidden_size
    if cfg.normalization != "RMSNorm":
        return (Ts * H + 2 * Ts) * r
    if fused_rms_norm(device):
        return Ts * H * r + Ts * 4
    return (Ts * H + Ts + Ts * H) * 4


def layer_terms(cfg, T, tp, sp, seqpar, e, memory: MemoryOptions, weight_copies=True, r=None,
                 device="cuda", moe=False, ep=1, fp8=False):
    """Saved bytes of one transformer layer, split into named terms (device, not offloaded).

    e: bytes of what the matmuls keep (their autocast copies); r: bytes of the residual stream and
    the norms' input (4 under bf16 autocast over fp32 weights, 2 when the weights themselves are
    bf16); device: whose RMSNorm kernel (_norm_bytes); moe: a MoE layer (cfg.is_moe_layer), whose
    MLP terms are moe_terms' (ep: --expert-model-parallel-size); fp8: the qkv, out-proj, fc1 and fc2
    linears in FP8 (planner/fp8.py: the same saved inputs, no weight copies)."""
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
        if fp8:                               # the FP8 linears save the weight parameter itself
            terms["w_attn"] = terms["w_mlp"] = 0
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
        terms.update(moe_terms(cfg, Ts, e, r, device, ep, weight_copies))
    elif memory.mlp_tiles != 1:
        n = resolve_count(memory.mlp_tiles, int(Ts), F * (2 if swiglu else 1) // tp, H)
        if n > 1:
            terms["mlp_act"] = 0
            terms["fc1_input"] = Ts * H * r   # each tile's checkpoint keeps a view of the norm output
            terms.pop("w_mlp", None)
    return terms


def activation_bytes(cfg, seq: int, micro_batch: int = 1, *, tp: int = 1, sp: int = 1,
                     sequence_parallel: bool = False, num_layers: int | None = None,
                     memory: MemoryOptions | None = None, dtype_bytes: int = 4,
                     residual_bytes: int | None = None, weight_copies: bool = False,
                     post_process: bool = True, pre_process: bool = True,
                     device: str = "cuda", cp: int = 1, ep: int = 1, fp8: bool = False) -> dict:
    """Predicted bytes saved for backward per rank for one micro-batch (see the module docstring).

    residual_bytes: element size of the residual stream and the norms' saved tensors (default
    dtype_bytes; 4 under bf16 autocast over fp32 weights, where only the matmul inputs are bf16).
    weight_copies: also count the weight copies aten::linear keeps (the accountant reports them
    apart, as weight_copy_bytes). device: "cuda" or "cpu", whose RMSNorm kernel (module
    docstring). cp: the ring's degree (context parallelism; T = b*s/(sp*cp), the ring's saved out
    and lse are the sdpa_out and sdpa_lse terms). ep: --expert-model-parallel-size (MoE layers'
    dispatch; the stage's layers are stage_layers': the one with the most MoE layers). fp8: the
    projections and dense MLP in FP8 (planner/fp8.py: no weight copies for them). Returns
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
    check_moe_layout(cfg, tp, seqpar, ep)
    T = micro_batch * seq / (sp * cp)
    Ts = T / tp if seqpar else T
    H, d = cfg.hidden_size, cfg.kv_channels
    kinds = stage_kinds(cfg, L)
    by_kind = {}
    for moe in sorted(set(kinds)):
        terms = layer_terms(cfg, T, tp, sp, seqpar, e, memory, weight_copies, r, device, moe, ep,
                            fp8)
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
