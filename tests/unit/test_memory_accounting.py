"""Saved-tensor accounting on one rank: each technique removes exactly the terms the planner says, the
planner's activation model equals the measured bytes, and the techniques leave loss and gradients equal
to the plain model (with dropout too)."""
import pytest
import torch

from megatron_sp.memory import MemoryOptions, measure_saved_bytes, recompute_plan, resolve_count
from megatron_sp.memory.planner import (Hardware, Workload, activation_bytes,
                                        korthikanti_layer_bytes, plan)
from megatron_sp.models import GPTModel, preset
from megatron_sp.models.init import init_parameters
from megatron_sp.tensor_parallel import RNGTracker

CFGS = {
    "llama": dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                  ffn_hidden_size=96, vocab_size=300),
    "gpt2": dict(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=300,
                 max_position_embeddings=128),
}


def _cfg(name, **kw):
    return preset("llama-tiny" if name == "llama" else "gpt2-tiny", **{**CFGS[name], **kw})


def _run(cfg, mem, b=2, s=96, tracker=None):
    model = GPTModel(cfg, memory=mem, rng_tracker=tracker)
    init_parameters(model, seed=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    loss, report = measure_saved_bytes(model, ids, labels, reduce="mean")
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, report


MEMS = [MemoryOptions(), MemoryOptions(recompute_granularity="full"),
        MemoryOptions(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
        MemoryOptions(recompute_granularity="selective"), MemoryOptions(mlp_tiles=4),
        MemoryOptions(mlp_tiles="auto"), MemoryOptions(loss_chunks=3), MemoryOptions(loss_chunks="auto"),
        MemoryOptions(offload_activations=True),
        MemoryOptions(recompute_granularity="full", mlp_tiles=2, loss_chunks=2, offload_activations=True)]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_planner_matches_measured_and_techniques_are_exact(name):
    cfg = _cfg(name)
    l0, g0, _ = _run(cfg, MemoryOptions())
    for mem in MEMS:
        loss, grads, rep = _run(cfg, mem)
        assert abs(loss - l0) <= 1e-5 * abs(l0), mem
        for n, g in grads.items():
            assert (g - g0[n]).abs().max() <= 1e-4, (mem, n)
        pred = activation_bytes(cfg, 96, 2, memory=mem, device="cpu")
        assert abs(pred["total"] / rep["device_bytes"] - 1) <= 0.10, (mem, pred["total"], rep)
        if mem.offload_activations:
            # offload copies views of one storage separately: host bytes are within 25%
            assert rep["host_bytes"] > 0 and abs(pred["host"] / rep["host_bytes"] - 1) <= 0.25


def test_tiling_and_chunking_remove_their_terms():
    cfg = _cfg("llama")
    b, s, F, V = 2, 96, cfg.ffn_hidden_size, cfg.padded_vocab_size()
    base = _run(cfg, MemoryOptions(), b, s)[2]
    tiled = _run(cfg, MemoryOptions(mlp_tiles=4), b, s)[2]
    chunked = _run(cfg, MemoryOptions(loss_chunks=4), b, s)[2]
    # SwiGLU keeps fc1 output [s, 2F], silu(gate) [s, F], fc2 input [s, F] per layer: 4*s*F fp32
    per_layer = base["by_label"]["layer 1"] - tiled["by_label"]["layer 1"]
    assert per_layer == 4 * b * s * F * 4
    # the fp32 softmax [s, V] and int64 labels + bool mask go; label views of the [b, s] labels stay
    out = base["by_label"]["output"] - chunked["by_label"]["output"]
    assert out == b * s * V * 4 + b * s * 9 - b * s * 8


def test_auto_tiles_keep_a_minimum_of_tokens(monkeypatch):
    """`auto`: ceil(width / hidden) tiles, but none under MIN_TILE_TOKENS tokens (so 1, the plain
    path, on short sequences); explicit counts are taken as given, never above the length."""
    from megatron_sp.memory import options
    assert options.MIN_TILE_TOKENS == 2048
    assert resolve_count("auto", 96, 32000, 512) == 1                       # short: plain
    assert resolve_count("auto", 8192, 128256, 2048) == 4                    # llama-1b at 8K
    assert resolve_count("auto", 1 << 20, 128256, 2048) == 63                # at 1M: width rule
    assert resolve_count("auto", 4096, 128256, 2048, tokens=2 * 4096) == 4   # batch counts
    assert resolve_count("auto", 8192, 8192 * 2, 2048) == 4                  # tiles of a SwiGLU MLP
    assert resolve_count(3, 96, 32000, 512) == 3 and resolve_count(500, 96, 32000, 512) == 96
    # with a small minimum, "auto" tiles a short sequence: exact, and the planner still holds
    monkeypatch.setattr(options, "MIN_TILE_TOKENS", 16)
    cfg = _cfg("llama")
    l0, g0, _ = _run(cfg, MemoryOptions())
    mem = MemoryOptions(mlp_tiles="auto", loss_chunks="auto")
    assert resolve_count("auto", 96, cfg.padded_vocab_size(), cfg.hidden_size, tokens=192) > 1
    loss, grads, rep = _run(cfg, mem)
    assert abs(loss - l0) <= 1e-5 * abs(l0)
    assert all((g - g0[n]).abs().max() <= 1e-4 for n, g in grads.items())
    pred = activation_bytes(cfg, 96, 2, memory=mem, device="cpu")
    assert abs(pred["total"] / rep["device_bytes"] - 1) <= 0.10, (pred["total"], rep)


def test_dropout_replayed_under_recompute():
    cfg = _cfg("llama", hidden_dropout=0.2, attention_dropout=0.2)
    l0, g0, _ = _run(cfg, MemoryOptions(), tracker=RNGTracker(3, tp_rank=0))
    for mem in (MemoryOptions(recompute_granularity="full"),
                MemoryOptions(recompute_granularity="selective"),
                MemoryOptions(recompute_granularity="full", mlp_tiles=3, loss_chunks=2)):
        loss, grads, _ = _run(cfg, mem, tracker=RNGTracker(3, tp_rank=0))
        assert loss == pytest.approx(l0, rel=1e-6)
        assert all((grads[n] - g0[n]).abs().max() <= 1e-5 for n in grads)


def test_recompute_plan_megatron_meanings():
    full = dict(recompute_granularity="full")
    assert recompute_plan(4, MemoryOptions(**full, recompute_num_layers=2)) == [(0, 2, True), (2, 4, True)]
    assert recompute_plan(5, MemoryOptions(**full, recompute_num_layers=2)) == [
        (0, 2, True), (2, 4, True), (4, 5, True)]
    assert recompute_plan(4, MemoryOptions(**full, recompute_method="block", recompute_num_layers=1)) \
        == [(0, 1, True), (1, 4, False)]
    assert recompute_plan(4, MemoryOptions()) == [(0, 4, False)]
    with pytest.raises(ValueError):
        MemoryOptions(recompute_granularity="partial")
    with pytest.raises(ValueError):
        MemoryOptions(mlp_tiles=0)


def test_planner_lists_layouts_for_8b_at_4m_tokens():
    cfg = preset("llama-8b")
    plans = plan(cfg, Workload(seq=4 * 2**20, global_batch=1), Hardware(num_gpus=64, gpu_mem_gb=80))
    assert plans, "an 8B model at 4M tokens fits 64 x 80 GB with sp and recompute"
    best = plans[0]
    assert best.tp * best.sp * best.pp * best.dp == 64 and best.total_gb <= 80
    assert korthikanti_layer_bytes(cfg, 8192, tp=8, sequence_parallel=True) > 0
