"""Model-state bytes per rank: weights, gradients and optimizer state under each sharding mode
(docs/design.md §11).

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
"""
from __future__ import annotations

import math

from megatron_sp.memory.host_pool import align_up
from megatron_sp.memory.planner.fp8 import fp8_linear_parameters
from megatron_sp.memory.planner.moe import (check_moe_layout, is_moe, moe_layer_flags, stage_layers,
                                            stage_moe_layers)
from megatron_sp.mesh import ParallelDims

BYTES_PER_PARAM = 16     # fp32 weights 4 + fp32 grads 4 + Adam exp_avg 4 + exp_avg_sq 4


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
    moe_layers = stage_moe_layers(cfg, pp)
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
    check_moe_layout(cfg, 1, True, ep)
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


def layout_state_bytes(cfg, dims: ParallelDims, mode: str, offload: bool, e: int,
                 ep: int = 1, fp8: bool = False) -> tuple[float, float]:
    """(device, host) bytes of the model state per rank, sharded over n = dp x sp (x cp: the mesh's
    dp_sp group spans the whole context; docs/design.md §11; experts over expert_shard_ranks);
    under bf16 autocast (not FSDP2) + the cast cache's bf16 copy of every weight, which
    aten::linear saves for backward (docs/design.md §9's 18 bytes/param), but the routed experts':
    their grouped GEMMs run in the tokens' fp32 (autocast has no rule for them) on the weights
    themselves; nor, with fp8, the FP8 linears' (planner/fp8.py: cast from the weights in each
    forward and backward, no copy kept)."""
    n = dims.dp * dims.context
    device = model_state_bytes(cfg, dims.tp, dims.pp, n, mode, offload, bf16=e == 2,
                               ep=ep)["device"]
    if mode != "fsdp" and e == 2:
        device += 2 * params_split_per_rank(cfg, dims.tp, dims.pp, ep)[0]
        if fp8:
            flags = moe_layer_flags(cfg)
            device -= 2 * fp8_linear_parameters(cfg, dims.tp,
                                                [flags[i] for i in stage_layers(cfg, dims.pp)])
    # the distributed optimizer's offloaded shards are blocks of its exact host pool; FSDP2's
    # CPUOffloadPolicy pins through torch's caching host allocator (powers of two)
    host = host_state_pinned_bytes(cfg, dims.tp, dims.pp, n, pool=mode == "distributed-optimizer",
                                   ep=ep) if offload else 0.0
    return device, host


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
