"""Memory and communication model of one training step, and the parallel-layout planner.

Activation bytes per rank (`activation_bytes`) count what OUR implementation saves for backward,
tensor by tensor (derived from the saved-tensor accounting of each op; tests hold it to the measured
bytes within 10%). Per micro-batch, with T = b*s/sp tokens per rank, t = tp, hl = h/t, gl = g/t, d the
head dim, F the ffn size, V the padded vocabulary, e the activation element size (4 fp32, 2 bf16),
and "/t*" meaning "divided by t under --sequence-parallel":

  attention block   norm: x T*H/t* + stats (RMSNorm: rstd T/t* + x_hat T*H/t*; LayerNorm: mean, rstd 2T/t*)
                    qkv input T*H/t* (under --sequence-parallel the column-parallel layers keep
                    the shard and all-gather it again in backward); SDPA inputs q T*hl*d, k and v T*d*max(gl, sp) each (with sp = 1
                    and no RoPE and one q per group the q saved is the whole fused qkv: T*(hl+2gl)*d),
                    logsumexp T*hl (fp32), SDPA output T*hl*d (only with sp > 1: otherwise it is
                    the out-proj input), out-proj input T*hl*d
  MLP block         norm as above, fc1 input T*H/t*, SwiGLU: fc1 output 2T*F/t + silu(gate) T*F/t +
                    fc2 input T*F/t (GeLU: 2T*F/t)
  weight copies     aten::linear keeps w^T (CPU) or the autocast bf16 copy (GPU) of each weight: qkv,
                    proj, fc1, fc2 (and the output layer), /t
  output            final norm + output-layer input T*H/t* (T*H with chunked loss) + fp32 softmax T*V/t (4 bytes) + labels
  RoPE cos, sin     2*T*d, shared by all layers (counted once)

  full recompute    a checkpointed group keeps only its input T*H/t* (uniform: L/n groups; block: n
                    checkpointed layers + L-n full ones)
  selective         drops logsumexp and SDPA output (recomputed)
  tiled MLP         drops the fc1/act terms and fc1/fc2 weight copies
  chunked loss      drops the softmax and the output weight copy
  offload           the layers' saved bytes move to host memory (device: 0 for the layers)

Korthikanti et al. (16-bit, attention matrix stored): `korthikanti_layer_bytes`.

Model state per rank: fp32 master weights (4) + fp32 gradients (4) + Adam m, v (8) = 16 bytes/param,
plus a bf16 working copy of the weights under autocast is transient (cast per op, counted above as
weight copies). DESIGN 9's 18 bytes/param assumes separate bf16 weights; we keep fp32 params with
bf16 autocast, so 16.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_sp.memory.options import MemoryOptions, resolve_count

BYTES_PER_PARAM = 16     # fp32 weights 4 + fp32 grads 4 + Adam exp_avg 4 + exp_avg_sq 4


def _layer_terms(cfg, T, tp, sp, seqpar, e, memory: MemoryOptions, weight_copies=True):
    """Saved bytes of one transformer layer, split into named terms (device, not offloaded)."""
    H, d, F = cfg.hidden_size, cfg.kv_channels, cfg.ffn_hidden_size
    hl, gl = cfg.num_attention_heads // tp, cfg.num_query_groups // tp
    Ts = T / tp if seqpar else T
    rms = cfg.normalization == "RMSNorm"
    swiglu = cfg.activation == "swiglu"
    rope = cfg.position_embedding_type == "rope"
    norm = (Ts * H + Ts + Ts * H) if rms else (Ts * H + 2 * Ts)
    kv = T * d * max(gl, sp)
    if sp == 1 and not rope and hl == gl:
        q = T * (hl + 2 * gl) * d          # q is a view of the fused qkv output
    else:
        q = T * hl * d
    terms = {
        "attn_norm": norm * e,
        "qkv_input": Ts * H * e,          # under --sequence-parallel only the shard is kept
        "sdpa_qkv": (q + 2 * kv) * e,
        "sdpa_lse": T * hl * 4,           # logsumexp is fp32
        # With sp = 1 the SDPA output already is the out-proj input (same storage); with sp > 1 the
        # head->seq all-to-all makes the out-proj input a new tensor.
        "sdpa_out": T * hl * d * e if sp > 1 else 0,
        "proj_input": T * hl * d * e,
        "mlp_norm": norm * e,
        "fc1_input": Ts * H * e,
        "mlp_act": (4 * T * F / tp if swiglu else 2 * T * F / tp) * e,
    }
    if weight_copies:
        fc1 = H * F * (2 if swiglu else 1) / tp
        terms["w_attn"] = (H * (hl + 2 * gl) * d + hl * d * H) * e
        terms["w_mlp"] = (fc1 + F * H / tp) * e
    if memory.selective_recompute:
        terms["sdpa_lse"] = terms["sdpa_out"] = 0
    if memory.mlp_tiles != 1:
        n = resolve_count(memory.mlp_tiles, int(Ts), F * (2 if swiglu else 1) // tp, H)
        if n > 1:
            terms["mlp_act"] = 0
            terms.pop("w_mlp", None)
    return terms


def activation_bytes(cfg, seq: int, micro_batch: int = 1, *, tp: int = 1, sp: int = 1,
                     sequence_parallel: bool = False, num_layers: int | None = None,
                     memory: MemoryOptions | None = None, dtype_bytes: int = 4,
                     weight_copies: bool = False, post_process: bool = True,
                     pre_process: bool = True) -> dict:
    """Predicted bytes saved for backward per rank for one micro-batch (see the module docstring).

    weight_copies: also count the weight copies aten::linear keeps (the accountant reports them
    apart, as weight_copy_bytes). Returns {"layer": bytes of one layer (not recomputed), "layers": all this stage's layers,
    "output", "embedding", "shared" (RoPE), "host" (offloaded), "total" (device), "terms": {...}}.
    """
    memory = memory or MemoryOptions()
    e = dtype_bytes
    L = cfg.num_layers if num_layers is None else num_layers
    seqpar = sequence_parallel and tp > 1
    T = micro_batch * seq / sp
    Ts = T / tp if seqpar else T
    H, d = cfg.hidden_size, cfg.kv_channels
    terms = _layer_terms(cfg, T, tp, sp, seqpar, e, memory, weight_copies)
    layer = sum(terms.values())
    ckpt_input = Ts * H * e
    if memory.full_recompute:
        n = memory.recompute_num_layers
        if memory.recompute_method == "uniform":
            layers = math.ceil(L / n) * ckpt_input
        else:
            k = min(n, L)
            layers = k * ckpt_input + (L - k) * layer
    else:
        layers = L * layer
    shared = 2 * T * d * 4 if cfg.position_embedding_type == "rope" else 0
    host = 0
    if memory.offload_activations:
        host, layers, shared = layers + shared, 0, 0
    output = 0
    if post_process:
        V = cfg.padded_vocab_size(tp) // tp
        rms = cfg.normalization == "RMSNorm"
        output = ((Ts * H + Ts + Ts * H) if rms else (Ts * H + 2 * Ts)) * e
        chunks = 1 if memory.loss_chunks == 1 else resolve_count(memory.loss_chunks, int(T), V, H)
        output += (T if chunks > 1 else Ts) * H * e   # output-layer input (the shard, unchunked)
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
            "shared": shared, "host": host, "total": total, "terms": terms}


def korthikanti_layer_bytes(cfg, seq: int, micro_batch: int = 1, tp: int = 1, sp: int = 1,
                            sequence_parallel: bool = False, recompute: str | None = None) -> float:
    """Korthikanti et al. 2022 per-layer bytes with 16-bit activations (DESIGN 9), divided by sp."""
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


# Model state and communication ------------------------------------------------------------------

def params_per_rank(cfg, tp: int, pp: int) -> float:
    """Parameters held by one rank: layers split over tp and pp; embeddings over tp (first and last
    stage hold them; counted on the heavier stage)."""
    total = cfg.num_parameters()
    V, H = cfg.padded_vocab_size(tp), cfg.hidden_size
    emb = V * H * (1 if cfg.tie_embeddings else 2)
    layers = total - cfg.vocab_size * H * (1 if cfg.tie_embeddings else 2)
    return layers / (tp * pp) + (emb / tp if pp == 1 else max(emb / tp / 2 * (2 if cfg.tie_embeddings else 1), 0) + 0)


def comm_bytes_per_step(cfg, seq: int, global_batch: int, micro_batch: int, tp: int, sp: int, pp: int,
                        dp: int, sequence_parallel: bool, memory: MemoryOptions, e: int = 2) -> dict:
    """Bytes one rank sends per optimizer step (forward + backward, recompute included), by kind.

    tp: ring all-reduce 2(t-1)/t of the message (or all-gather + reduce-scatter (t-1)/t each with
    sequence sharding), 2 per layer forward, 2 backward, (+2 with full recompute); sp: Ulysses
    all-to-all (sp-1)/sp of q, k, v and out forward and backward (+ again under full recompute);
    pp: activations [b, s/sp, H] each way per micro-batch; dp: gradients all-reduced over dp x sp,
    fp32, 2(n-1)/n.
    """
    L = cfg.num_layers
    micro = global_batch // (micro_batch * dp)
    T = micro_batch * seq / sp
    H, d = cfg.hidden_size, cfg.kv_channels
    recompute_factor = 1.5 if memory.full_recompute else 1.0    # forward run twice of fwd+bwd pairs
    out = {}
    if tp > 1:
        msg = T * H * e
        # Per layer and micro-batch, in units of (t-1)/t * msg: without --sequence-parallel four
        # all-reduces (2 forward, 2 backward) of 2 units each; with it 2 all-gathers + 2
        # reduce-scatters forward, and backward 2 re-gathers + 2 reduce-scatters (column-parallel
        # inputs kept sharded) + 2 all-gathers (row-parallel outputs).
        units = 10 if sequence_parallel else 8
        out["tp"] = micro * L * units * (tp - 1) / tp * msg * recompute_factor / pp
    if sp > 1:
        hl, gl = cfg.num_attention_heads // tp, cfg.num_query_groups // tp
        a2a = (sp - 1) / sp * T * d * (2 * hl + 2 * max(gl, sp)) * e
        out["sp"] = micro * L * 2 * a2a * recompute_factor / pp
    if pp > 1:
        out["pp"] = micro * 2 * T * H * e / (tp if sequence_parallel else 1)
    n = dp * sp
    if n > 1:
        out["dp"] = 2 * (n - 1) / n * params_per_rank(cfg, tp, pp) * 4
    return out


@dataclass
class Plan:
    tp: int
    sp: int
    pp: int
    dp: int
    micro_batch: int
    memory: MemoryOptions
    sequence_parallel: bool
    weights_gb: float
    activations_gb: float
    offloaded_gb: float
    total_gb: float
    comm_gb: dict = field(default_factory=dict)

    @property
    def comm_total_gb(self) -> float:
        return sum(self.comm_gb.values())

    def flags(self) -> str:
        m = self.memory
        parts = [f"--tensor-model-parallel-size {self.tp}", f"--sequence-parallel-size {self.sp}",
                 f"--pipeline-model-parallel-size {self.pp}", f"--micro-batch-size {self.micro_batch}"]
        if self.sequence_parallel:
            parts.append("--sequence-parallel")
        if m.recompute_granularity:
            parts.append(f"--recompute-granularity {m.recompute_granularity}")
            if m.full_recompute:
                parts.append(f"--recompute-method {m.recompute_method} --recompute-num-layers "
                             f"{m.recompute_num_layers}")
        if m.mlp_tiles != 1:
            parts.append(f"--mlp-tiles {m.mlp_tiles}")
        if m.loss_chunks != 1:
            parts.append(f"--loss-chunks {m.loss_chunks}")
        if m.offload_activations:
            parts.append("--offload-activations")
        return " ".join(parts)


# Cheapest first: the planner picks the first that fits for each layout.
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


def _divisors(n):
    return [i for i in range(1, n + 1) if n % i == 0]


def plan(cfg, seq: int, global_batch: int, num_gpus: int, gpu_mem_gb: float = 80.0, *,
         gpus_per_node: int = 8, intra_node_gbps: float = 450.0, inter_node_gbps: float = 50.0,
         reserve_gb: float = 4.0, dtype_bytes: int = 2, micro_batch: int = 1,
         peak_tflops: float = 989.0, mfu: float = 0.4) -> list[Plan]:
    """Feasible (tp, sp, pp, dp) layouts with the cheapest memory settings that fit, best first.

    Score: estimated step seconds = model FLOPs / (GPUs x peak x mfu) x technique cost (recompute
    ~ +1/3) x (1 + pipeline bubble) + communication bytes / bandwidth (tp inside a node; sp, pp and dp
    cross nodes when the layout spans them; GB/s per GPU). Each plan carries .score (seconds).
    """
    plans = []
    for tp in _divisors(min(num_gpus, gpus_per_node)):
        for sp in _divisors(num_gpus // tp):
            for pp in _divisors(num_gpus // (tp * sp)):
                dp = num_gpus // (tp * sp * pp)
                if global_batch % (micro_batch * dp) or cfg.num_layers % pp:
                    continue
                try:
                    cfg.check_parallel(tp, sp, pp)
                except ValueError:
                    continue
                if seq % (sp * tp):
                    continue
                seqpar = tp > 1
                weights = params_per_rank(cfg, tp, pp) * BYTES_PER_PARAM
                for mem, cost in zip(TECHNIQUE_LADDER, TECHNIQUE_COST):
                    act = activation_bytes(cfg, seq, micro_batch, tp=tp, sp=sp,
                                           sequence_parallel=seqpar, num_layers=cfg.num_layers // pp,
                                           memory=mem, dtype_bytes=dtype_bytes, weight_copies=False)
                    # 1F1B keeps up to pp micro-batches in flight on the first stage
                    inflight = max(1, min(pp, global_batch // (micro_batch * dp)))
                    # full recompute: one layer's activations exist again during its backward
                    working = 0.0
                    if mem.full_recompute:
                        one = activation_bytes(cfg, seq, micro_batch, tp=tp, sp=sp,
                                               sequence_parallel=seqpar, num_layers=1,
                                               memory=MemoryOptions(mlp_tiles=mem.mlp_tiles),
                                               dtype_bytes=dtype_bytes, post_process=False,
                                               pre_process=False)
                        working = one["layer"] * mem.recompute_num_layers
                    total = weights + act["total"] * inflight + working
                    if total / 2**30 + reserve_gb <= gpu_mem_gb:
                        comm = comm_bytes_per_step(cfg, seq, global_batch, micro_batch, tp, sp, pp, dp,
                                                   seqpar, mem, dtype_bytes)
                        plans.append(Plan(tp, sp, pp, dp, micro_batch, mem, seqpar, weights / 2**30,
                                          act["total"] * inflight / 2**30,
                                          act["host"] * inflight / 2**30, total / 2**30 + reserve_gb,
                                          {k: v / 2**30 for k, v in comm.items()}))
                        plans[-1].cost = cost
                        break

    from megatron_sp.flops import flops_for_config
    compute_s = flops_for_config(cfg, global_batch, seq) / (num_gpus * peak_tflops * 1e12 * mfu)

    def score(p: Plan):
        """Estimated seconds per step: compute (x technique cost, x pipeline bubble) + communication
        (not overlapped: a pessimistic bound)."""
        bw = {"tp": intra_node_gbps,
              "sp": intra_node_gbps if p.tp * p.sp <= gpus_per_node else inter_node_gbps,
              "pp": inter_node_gbps if p.tp * p.sp * p.dp < num_gpus else intra_node_gbps,
              "dp": inter_node_gbps if p.tp * p.sp < num_gpus else intra_node_gbps}
        comm_s = sum(gb / bw[k] for k, gb in p.comm_gb.items())
        bubble = (p.pp - 1) / max(1, global_batch // (p.micro_batch * p.dp)) if p.pp > 1 else 0.0
        return compute_s * p.cost * (1 + bubble) + comm_s
    plans.sort(key=score)
    for p in plans:
        p.score = score(p)
    return plans
