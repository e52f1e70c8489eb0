"""Bytes one rank sends per optimizer step, by kind (tp, sp, cp, pp, dp, ep, edp, host): the
communication term of the planner's step time (no collectives here: those live in the comm.py
modules).

Communication (`comm_bytes_per_step`) adds for MoE "ep", the dispatcher's all-to-alls (forward
dispatch + combine, both again in backward and under full recompute: 4 Nx (ep-1)/ep H r per MoE
layer and micro-batch, uniform routing) and "edp", the experts' gradient traffic over their group.
"""
from __future__ import annotations

from megatron_sp.memory.options import MemoryOptions
from megatron_sp.memory.planner.activations import ring_buffer_bytes
from megatron_sp.memory.planner.job import Workload
from megatron_sp.memory.planner.moe import expert_rows, stage_moe_layers
from megatron_sp.memory.planner.state import expert_shard_ranks, params_split_per_rank
from megatron_sp.mesh import ParallelDims

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
    moe_layers = stage_moe_layers(cfg, pp)                      # this stage's (heaviest)
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
        r = residual_element_bytes(sharding, e)
        Nx = expert_rows(cfg, T / tp if sequence_parallel else T)[1]
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


def residual_element_bytes(sharding: str, e: int) -> int:
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
