"""The planner on mixture-of-experts models (issue 37 item 5): total and active parameters against
the published counts, expert state per rank by hand for each sharding mode and ep, the MoE layer's
saved bytes against the measured ones (fp32, bf16 autocast, bf16 weights) and its step peak, the
dispatcher's bytes against moe/dispatch.py's formula, MFU on the active parameters, and the plans'
flags through pretrain_gpt.py's parser."""
import json
import shlex
import sys
from dataclasses import replace

import pytest
import torch

from megatron_sp.cli.arguments import build_parser
from megatron_sp.cli.build import job_config
from megatron_sp.memory import MemoryOptions, SavedTensorAccountant
from megatron_sp.memory.planner import (Hardware, Workload, _model_state, activation_bytes,
                                        comm_bytes_per_step, expert_parallel_choices,
                                        host_state_pinned_bytes, model_state_bytes,
                                        params_split_per_rank, plan, step_peak_bytes)
from megatron_sp.mesh import ParallelDims
from megatron_sp.models import GPTConfig, GPTModel, preset
from megatron_sp.models.moe import _grouped_mm_probe
from megatron_sp.moe.dispatch import dispatch_bytes
from megatron_sp.testing import load_script

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_planner import _measured_peak  # noqa: E402

plan_parallel = load_script("tools/plan_parallel.py")


def _moe(**kw):
    """H 64, L 2, 8 heads / 4 groups (d 8), E 4 experts of Fm 32, top-2, a shared expert of Fs 48
    behind its gate, V 256 untied; every layer a MoE layer (ffn_hidden_size 96 unused)."""
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                  ffn_hidden_size=96, vocab_size=256, normalization="RMSNorm", activation="swiglu",
                  position_embedding_type="rope", add_bias_linear=False, tie_embeddings=False,
                  num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
                  moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True)
    return GPTConfig(**{**fields, **kw})


# Parameters ---------------------------------------------------------------------------------------

def test_parameter_counts_match_the_published_figures():
    """Qwen3-30B-A3B (HF model card: 30.5B in total, 3.3B activated, 29.9B non-embedding), by hand
    from its shapes: per layer qkv 2048 (32 + 2*4) 128, out-proj 32*128*2048, 2 RMSNorms + the
    qk-norms, router 128*2048, 128 experts of 3*2048*768 (8 active); two vocabulary tables of
    151936 x 2048 and the final norm. Qwen1.5-MoE-A2.7B (14.3B, 2.7B activated) and
    Mixtral-8x7B (46.7B, 12.9B per token) within the published rounding."""
    cfg = preset("qwen3-30b-a3b")
    H, V, L = 2048, 151936, 48
    attention = H * (32 + 2 * 4) * 128 + 32 * 128 * H + 2 * H + 2 * 128
    expert = 3 * H * 768
    total = L * (attention + 128 * H + 128 * expert) + 2 * V * H + H
    active = total - L * (128 - 8) * expert
    assert cfg.num_parameters() == total == 30_532_122_624
    assert cfg.num_active_parameters() == active == 3_353_032_704
    assert cfg.num_routed_expert_parameters() == L * 128 * expert
    assert 30.5e9 <= total < 30.6e9 and 3.3e9 <= active < 3.4e9
    assert 29.9e9 <= total - 2 * V * H < 30.0e9
    for name, (published_total, published_active) in {"qwen1.5-moe-a2.7b": (14.3, 2.7),
                                                      "mixtral-8x7b": (46.7, 12.9)}.items():
        c = preset(name)
        assert round(c.num_parameters() / 1e9, 1) == published_total, name
        assert round(c.num_active_parameters() / 1e9, 1) == published_active, name
    dense = preset("llama-tiny")
    assert dense.num_active_parameters() == dense.num_parameters()
    assert dense.num_routed_expert_parameters() == 0


# Model state per rank --------------------------------------------------------------------------

def test_expert_state_per_rank_by_hand_for_each_mode_and_ep():
    """_moe() per layer: attention qkv 8192 + out-proj 4096 + 2 norms 128 = 12416, router 256 +
    shared expert 9216 + gate 64 = 9536 (whole on every tp rank), experts 4 x 6144 = 24576 (E/ep
    per rank, never split over tp); P = 2 x 46528 + 2 x 256 x 64 + 64 = 125888.
    tp 2, n = dp 2, ep 2 (stage 4 ranks, edp 2): non-expert P_n = (2 x 12416 + 64)/2 + 2 x 9536 +
    2 x 8192 = 47904, experts P_e = 2 x 24576/2 = 24576; the experts' state over edp = 2, the rest
    over n = 2: a shard of 23952 + 12288 = 36240. FSDP2 units (tp rank): vocab 8192, each layer
    6224 + 9536 = 15760 with its own experts unit of 12288 inside (ep > 1): in flight the two
    layers + one experts unit, 43808 params at 2 + 2 bytes, + the largest reduce-scatter output
    (a layer's 15760 / n at 2 bytes; offloaded + 8 bytes/param of its fp32 shard and grad).
    ep 1 on the same ranks: every expert whole on each rank (P_e 49152), sharded over n = 2 like
    the rest (dp x sp, not the tp ranks)."""
    cfg = _moe()
    assert cfg.num_parameters() == 125888
    assert params_split_per_rank(cfg, tp=2, pp=1, ep=2) == (47904, 24576)
    shard = 47904 / 2 + 24576 / 2
    in_flight = 43808 * 4 + 15760 / 2 * 2
    expect = {("none", False): (16 * 72480, 0),
              ("distributed-optimizer", False): (8 * 72480 + 8 * shard, 0),
              ("distributed-optimizer", True): (8 * 72480, 16 * shard),
              ("fsdp", False): (16 * shard + in_flight, 0),
              ("fsdp", True): (43808 * 4 + 15760 / 2 * 10, 16 * shard)}
    for (mode, offload), (device, host) in expect.items():
        got = model_state_bytes(cfg, tp=2, pp=1, n=2, sharding=mode, cpu_offload=offload, ep=2)
        assert (got["device"], got["host"]) == (device, host), (mode, offload, got)
    assert expect["fsdp", False][0] == 770832 and shard == 36240
    # ep 1: whole experts everywhere, over n
    assert params_split_per_rank(cfg, tp=2, pp=1, ep=1) == (47904, 49152)
    assert model_state_bytes(cfg, tp=2, n=2, sharding="distributed-optimizer", ep=1)["device"] == \
        8 * 97056 + 8 * (47904 + 49152) / 2
    fsdp1 = model_state_bytes(cfg, tp=2, n=2, sharding="fsdp", ep=1)
    assert fsdp1["in_flight"] == 2 * 40336 * 4 + 40336 / 2 * 2       # a layer's unit holds them
    # ep 4 over tp 2 x n 2: one expert per rank, edp 1 (its state whole)
    assert model_state_bytes(cfg, tp=2, n=2, sharding="distributed-optimizer", ep=4)["device"] == \
        8 * (47904 + 12288) + 8 * (47904 / 2 + 12288)
    # bf16 autocast: + 2 bytes for every weight but the experts' (their GEMMs keep the fp32 ones)
    dims = ParallelDims(4, tp=2)
    assert _model_state(cfg, dims, "none", False, 2, ep=2)[0] == 16 * 72480 + 2 * 47904
    # offloaded shards pinned, each rounded up to a power of two: vocab 2 x 4096 fp32 -> 16384 B;
    # per layer qkv 2048 -> 8192, proj 1024 -> 4096, router 128 -> 512, shared fc1 3072 -> 16384,
    # fc2 1536 -> 8192, w1 4096 -> 16384, w2 2048 -> 8192; norms and gates (144) exact; Adam exact
    pinned = 2 * (2 * 16384 + 2 * (8192 + 4096 + 512 + 16384 + 8192 + 16384 + 8192))
    assert host_state_pinned_bytes(cfg, 2, 1, 2, ep=2) == pinned + 8 * 144 + 8 * shard == 604416
    for bad, match in ((3, "does not divide num_experts=4"), (8, "does not divide num_experts")):
        with pytest.raises(ValueError, match=match):
            model_state_bytes(cfg, tp=2, n=2, ep=bad)
    with pytest.raises(ValueError, match="does not divide the 2 ranks of a pipeline stage"):
        model_state_bytes(cfg, tp=1, n=2, ep=4)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        model_state_bytes(preset("llama-tiny"), ep=2)


# Activations: predicted against measured ----------------------------------------------------------

MOE_VARIANTS = {   # the routers of the presets and the losses (all on the tiny shapes of _moe)
    "qwen3": dict(moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False),
    "qwen2-moe": dict(moe_router_pre_softmax=True),
    "sigmoid-losses": dict(moe_router_score_function="sigmoid", moe_aux_loss_coeff=0.01,
                           moe_z_loss_coeff=1e-3, moe_shared_expert_gate=False),
    "every-2nd-layer": dict(num_layers=4, moe_layer_freq=2, moe_aux_loss_coeff=0.01,
                            moe_router_load_balancing_type="seq_aux_loss"),
}
MEMS = [MemoryOptions(), MemoryOptions(recompute_granularity="full"),
        MemoryOptions(recompute_granularity="selective", loss_chunks=2)]


@pytest.mark.parametrize("weights", ["fp32", "autocast", "bf16"])
def test_moe_activation_model_equals_measured_bytes(weights, seed):
    """Saved bytes of one step of a MoE GPTModel (SavedTensorAccountant, as the dense test) equal
    activation_bytes within 2% (or the label views the chunked loss keeps, b*s*8, counted apart)
    in fp32, under bf16 autocast over fp32 weights (the router's linear and the shared expert in
    bf16, the experts in the tokens' fp32) and with bf16 weights, on random tokens (the test's
    seed: the saved bytes do not depend on the routing without capacity on one rank). The model
    is exact: each layer's bytes (the accountant's per-layer labels) within 64 bytes (the router
    losses' scalars and per-sequence counts), the step's within the dense test's 2%. ep > 1 is
    not measurable on one rank (the planner takes the uniform-routing expectation of the
    received rows)."""
    gen = torch.Generator().manual_seed(seed)           # this test's draw (MEGATRON_SP_TEST_SEED)
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    _grouped_mm_probe(torch.device("cpu"), dtype)       # its one-time probe tensors kept out
    e, r = (4, 4) if weights == "fp32" else (2, 4) if weights == "autocast" else (2, 2)
    for name, fields in MOE_VARIANTS.items():
        cfg = _moe(**fields)
        for mem in MEMS:
            model = GPTModel(cfg, memory=mem).to(dtype)
            ids = torch.randint(0, cfg.vocab_size, (2, 96), generator=gen)
            acct = SavedTensorAccountant().attach(model)
            with acct.recording(), torch.autocast("cpu", torch.bfloat16,
                                                  enabled=weights == "autocast"):
                model(input_ids=ids, labels=ids).float().mean().backward()
            report = acct.report()
            pred = activation_bytes(cfg, 96, 2, memory=mem, dtype_bytes=e, residual_bytes=r,
                                    device="cpu")
            measured = report["device_bytes"]
            assert abs(pred["total"] - measured) <= max(0.02 * measured, 2 * 96 * 8), \
                (name, mem, pred["total"], measured)
            if mem == MemoryOptions():          # each layer alone: exact to the losses' scalars
                for i in range(cfg.num_layers):
                    kind = "moe" if cfg.is_moe_layer(i) else "dense"
                    layer = report["by_label"][f"layer {i}"]
                    layer -= pred["shared"] if i == 0 else 0    # RoPE's tables: the first layer's
                    assert abs(pred["by_kind"][kind][0] - layer) <= 64, (name, i, layer, pred)


def test_moe_terms_by_hand():
    """One MoE layer of _moe() over T = 192 tokens in fp32 (N = 384 routed rows): router input
    T H 4, top-2 indices and softmax T 2 (8 + 4), the permuted rows N H 4, the grouped GEMMs' h
    [N, 64] + silu + product N 4 Fm 4 and the offsets E 4, the combine's fp32 output, weighted
    rows and weights N H 8 + N 4, three int64 index vectors 3 N 8, the shared expert T 4 Fs 4 +
    gate T 4 + its output T H 4 (its input is the router's, the tokens themselves); ep 2 adds the
    regroup's 2 N 8; under --sequence-parallel tp 2 a rank routes T/2 tokens."""
    cfg = _moe()
    T, H, N = 192, 64, 384
    terms = activation_bytes(cfg, 96, 2, dtype_bytes=4)["terms"]
    expect = {"router_input": T * H * 4, "router_probs": T * 2 * 12, "expert_input": N * H * 4,
              "expert_act": N * 4 * 32 * 4 + 4 * 4, "combine": N * H * 8 + N * 4,
              "token_indices": 3 * N * 8, "shared_expert": T * 4 * 48 * 4 + T * 4 + T * H * 4}
    assert {k: terms[k] for k in expect} == expect
    assert "fc1_input" not in terms and "mlp_act" not in terms
    ep2 = activation_bytes(cfg, 96, 2, dtype_bytes=4, ep=2)["terms"]
    assert ep2["token_indices"] - terms["token_indices"] == 2 * N * 8
    assert ep2["expert_act"] - terms["expert_act"] == -2 * 4
    half = activation_bytes(cfg, 96, 2, tp=2, sequence_parallel=True, dtype_bytes=4)["terms"]
    assert half["expert_input"] == N / 2 * H * 4 and half["router_input"] == T / 2 * H * 4
    with pytest.raises(ValueError, match="needs --sequence-parallel"):
        activation_bytes(cfg, 96, 2, tp=2)


# (tokens, fields): the phase of the MoE backward that sets its peak
BACKWARD_PHASES = {
    "combine": (1024, dict(moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False)),
    "combine, top-8": (512, dict(num_experts=16, moe_router_topk=8,
                                 moe_shared_expert_intermediate_size=None,
                                 moe_shared_expert_gate=False)),
    "shared expert": (1024, dict(moe_shared_expert_intermediate_size=512,
                                 moe_shared_expert_gate=False)),
    "shared expert, gated": (1024, dict(moe_shared_expert_intermediate_size=256)),
    "expert weights": (64, dict(num_experts=16, moe_shared_expert_intermediate_size=None,
                                moe_shared_expert_gate=False)),
    "expert weights, shared": (16, dict(num_experts=16)),
}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_moe_backward_transients_equal_the_measured_ones(autocast, seed):
    """_moe_backward_bytes against the most a MoEMLP's backward holds above what its forward left
    (LiveTensorPeak from before the forward, the layer's input kept alive as the norm output
    is), each phase setting it once: unpermute's fp32 products, the shared expert's fc1 gradient
    (then its saved tensors freed), the experts' weight gradients (few tokens, many experts).
    Within [-1%, +10%]: the model is exact but for autocast's bf16 halves of the shared expert
    (its backward's casts free some of them earlier than counted)."""
    from megatron_sp.memory.accounting import LiveTensorPeak
    from megatron_sp.memory.planner import _moe_backward_bytes
    from megatron_sp.models.moe import MoEMLP
    gen = torch.Generator().manual_seed(seed)
    _grouped_mm_probe(torch.device("cpu"), torch.float32)
    for name, (T, fields) in BACKWARD_PHASES.items():
        cfg = _moe(hidden_size=128, moe_ffn_hidden_size=128, **fields)
        mlp = MoEMLP(cfg.moe_config(), 128)
        for p in mlp.parameters():
            p.grad = torch.zeros_like(p)                     # every step after the first
        x = torch.randn(1, T, 128, generator=gen).requires_grad_()
        grad = torch.randn(1, T, 128, generator=gen)
        with LiveTensorPeak() as live:
            tokens = x * 1.0                                 # the norm output, kept alive
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                y = mlp(tokens)
            after_forward = live.peak = live.live
            y.backward(grad)
        measured = live.peak - after_forward
        pred = _moe_backward_bytes(cfg, T, 2 if autocast else 4, 4, "cpu")
        assert 0.99 <= pred / measured <= 1.10, (name, pred / measured, pred, measured)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_moe_step_peak_is_an_upper_bound_of_the_measured_peak(bf16):
    """step_peak_bytes of a MoE model against the profiler's peak of a step (as the dense test:
    at most 3% under, at most 35% over); the layer backward's MoE phases (the combine's fp32
    products, the experts' weight gradients) set it without recompute. Under autocast the bf16
    copies of the non-expert weights (model state in the planner) are taken off the measured
    peak; the experts have none."""
    torch.manual_seed(0)
    seq = 512
    for fields, mem in ((dict(moe_shared_expert_intermediate_size=None,
                              moe_shared_expert_gate=False), MemoryOptions()),
                        ({}, MemoryOptions(recompute_granularity="full")),
                        (dict(num_experts=16, moe_router_topk=8), MemoryOptions(loss_chunks=4))):
        cfg = _moe(hidden_size=128, ffn_hidden_size=384, moe_ffn_hidden_size=128, vocab_size=512,
                   max_position_embeddings=seq, **fields)
        model = GPTModel(cfg, memory=mem)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        ids = torch.randint(0, 512, (1, seq))
        copies = 2 * params_split_per_rank(cfg, 1, 1)[0] if bf16 else 0
        measured = _measured_peak(model, ids, bf16) - copies
        pred = step_peak_bytes(cfg, seq, 1, memory=mem, dtype_bytes=2 if bf16 else 4,
                               residual_bytes=4, device="cpu")["device"]
        assert 0.97 <= pred / measured <= 1.35, (fields, mem, pred / measured, pred, measured)


# Communication ---------------------------------------------------------------------------------

def test_ep_bytes_equal_dispatch_bytes_under_uniform_routing():
    """comm_bytes_per_step's "ep" = per step, MoE layers x micro-batches x dispatch_bytes of every
    rank (the same on each) for uniform counts [ep, E]: each source sends Tm k / E rows to every
    expert, Tm = b s/(sp cp) (/tp under --sequence-parallel), in the tokens' fp32 (bf16 autocast);
    full recompute runs the forward's two exchanges again (dispatch_bytes(backward=False)). The
    dp term splits: the non-expert parameters' fp32 gradients over n = dp x sp, the experts' over
    their edp group (n tp / ep)."""
    cfg = _moe(num_layers=4, moe_layer_freq=2, num_experts=8)            # MoE layers 0 and 2
    seq, b, H, k, E = 256, 2, 64, 2, 8
    for tp, sp, dp, ep, mem in ((1, 1, 4, 2, MemoryOptions()), (2, 2, 2, 4, MemoryOptions()),
                                (1, 2, 4, 8, MemoryOptions(recompute_granularity="full"))):
        dims = ParallelDims(tp * sp * dp, tp=tp, sp=sp)
        work = Workload(seq, global_batch=4 * dp * b, micro_batch=b, memory=mem,
                        sequence_parallel=tp > 1)
        Tm = b * seq / sp / tp
        counts = torch.full((ep, E), int(Tm * k / E), dtype=torch.int64)
        per_layer = {dispatch_bytes(counts, rank, H, 4) for rank in range(ep)}
        assert len(per_layer) == 1
        forward_again = dispatch_bytes(counts, 0, H, 4, backward=False) \
            if mem.full_recompute else 0
        got = comm_bytes_per_step(cfg, work, dims, "none", ep=ep)
        assert got["ep"] == 4 * 2 * (per_layer.pop() + forward_again), (tp, sp, ep)
        Pn, Pe = params_split_per_rank(cfg, tp, 1, ep)
        n, m = sp * dp, sp * dp * tp // ep
        assert got["dp"] == 2 * (n - 1) / n * Pn * 4
        assert got.get("edp", 0) == (2 * (m - 1) / m * Pe * 4 if m > 1 else 0)
    assert "ep" not in comm_bytes_per_step(cfg, work, dims, "none", ep=1)


# The planner -----------------------------------------------------------------------------------

def test_moe_plans_count_mfu_on_active_parameters_and_choose_ep():
    """plan() on a MoE model: each plan's MFU = model FLOPs with Megatron's MoE formula (the MLP
    term at the active width k Fm + Fs, by hand) / (s/step x GPUs x peak), below what the total
    width E Fm + Fs would give; ep among the divisors of the experts that divide the stage's
    ranks; tp > 1 always with --sequence-parallel; to_dict carries ep and both parameter counts.
    A fixed ep (Workload.expert_parallel_size) is kept or refused in one sentence."""
    seq = 4096
    cfg = _moe(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4,
               ffn_hidden_size=512, num_experts=8, moe_ffn_hidden_size=128, vocab_size=2048,
               max_position_embeddings=seq)
    work, hw = Workload(seq, global_batch=8), Hardware(8, gpu_mem_gb=6, peak_tflops=500, mfu=0.5)
    L, H, a, g, d = 4, 256, 8, 4, 32
    V = cfg.padded_vocab_size(1)

    def flops(F):
        return 12 * 8 * seq * L * H ** 2 * ((1 + g / a + seq / H) * d * a / H + F / H * 1.5
                                            + V / (2 * L * H))
    active = flops(2 * 128 + 48)
    plans = plan(cfg, work, hw)
    fixed = plan(cfg, replace(work, expert_parallel_size=4), hw)
    assert len(plans) > 3 and fixed
    assert all(p.ep == 4 and (p.tp * p.sp * p.cp * p.dp) % 4 == 0 for p in fixed)
    for p in plans + fixed:
        assert p.model_flops == pytest.approx(active, rel=1e-12)
        assert p.mfu == pytest.approx(active / (p.step_s * 8 * 500e12))
        assert p.mfu < 0.5 and p.model_flops < flops(8 * 128 + 48)      # not on all E experts
        stage = p.tp * p.sp * p.cp * p.dp
        assert 8 % p.ep == 0 and stage % p.ep == 0
        assert p.sequence_parallel == (p.tp > 1)
        assert ("--expert-model-parallel-size" in p.flags()) == (p.ep > 1)
        d_ = p.to_dict()
        assert (d_["ep"], d_["total_parameters"], d_["active_parameters"]) == \
            (p.ep, cfg.num_parameters(), cfg.num_active_parameters())
        if p.ep > 1:
            assert p.comm_gb["ep"] > 0
    assert expert_parallel_choices(cfg, work, ParallelDims(6, tp=2)) == [1, 2]
    with pytest.raises(ValueError, match="--expert-model-parallel-size 3 does not divide "
                                         "num_experts=8: choose one of"):
        plan(cfg, replace(work, expert_parallel_size=3), hw)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        plan(preset("llama-tiny"), Workload(1024, expert_parallel_size=2), Hardware(2))


def _flag_argv(p):
    return [tok for flag in p.flag_list() for tok in shlex.split(flag)]


def test_qwen3_moe_plans_flags_parse_back_to_their_layout():
    """Qwen3-30B-A3B on 64 GPUs: each listed plan's flags (--model qwen3-30b-a3b + its own)
    parse through pretrain_gpt.py's parser and JobConfig to its tp, Ulysses sp, pp, ep,
    --sequence-parallel, --expert-tensor-parallel-size 1 with tp > 1 (the whole experts the plan
    assumes, not the run's default etp = tp) and memory; a plan with ep > 1 is among them; no plan tiles the MLP
    (--mlp-tiles tiles dense MLPs only)."""
    seq = 32768
    plans = plan(preset("qwen3-30b-a3b", max_position_embeddings=seq),
                 Workload(seq, global_batch=64), Hardware(64))
    assert plans and any(p.ep > 1 for p in plans[:6]) and any(p.tp > 1 for p in plans[:6])
    # every layer MoE: nothing to tile, even on the rungs that tile a dense model's MLP
    assert all(p.memory.mlp_tiles == 1 for p in plans)
    assert any(p.memory.recompute_granularity == "full" for p in plans)
    parser = build_parser()
    for p in plans[:6]:
        args, unknown = parser.parse_known_args(["--model", "qwen3-30b-a3b"] + _flag_argv(p))
        assert not unknown, unknown
        assert (args.tensor_model_parallel_size, args.sequence_parallel_size,
                args.pipeline_model_parallel_size, args.expert_model_parallel_size) == \
            (p.tp, p.sp, p.pp, p.ep)
        assert args.sequence_parallel == (p.tp > 1) and args.bf16
        assert args.expert_tensor_parallel_size == (1 if p.tp > 1 else None)
        job = job_config(args)
        assert job.parallel.expert_model_parallel_size == p.ep
        assert MemoryOptions.from_config(job.memory) == p.memory


def test_cli_prints_active_parameters_and_an_ep_column(capsys):
    """tools/plan_parallel.py on a MoE preset: the model line gives the total and the active
    parameters, the table an ep column (--expert-model-parallel-size fixes it), --json both
    counts and each plan's ep; an ep that does not divide the experts is refused in one line."""
    main = plan_parallel.main
    argv = ["--model", "qwen1.5-moe-a2.7b", "--seq-length", "16384", "--num-gpus", "16",
            "--global-batch-size", "16", "--no-ring", "--top", "3"]
    assert main(argv + ["--expert-model-parallel-size", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("model: 14.32B parameters, 2.69B active (top-4 of 60 experts")
    header = next(line for line in lines if line.split()[:1] == ["#"])
    assert header.split()[:7] == ["#", "tp", "sp", "pp", "dp", "ep", "sharding"]
    rows = [line for line in lines if line[:3].strip().isdigit()]
    assert len(rows) == 3 and all(row.split()[5] == "4" for row in rows)
    assert max(len(line) for line in lines) <= 120
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["parameters"], data["active_parameters"]) == (14_315_784_192, 2_689_173_504)
    assert all(p["active_parameters"] == data["active_parameters"] and p["ep"] >= 1
               for p in data["plans"])
    with pytest.raises(SystemExit, match="--expert-model-parallel-size 7 does not divide "
                                         "num_experts=60"):
        main(argv + ["--expert-model-parallel-size", "7"])
