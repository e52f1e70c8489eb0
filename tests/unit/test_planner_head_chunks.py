"""The planner counts Ulysses head chunks (--ulysses-head-chunks N, ulysses/attention.py; issue 36).

Saved bytes: a GPTModel with head chunks N at sp = 1 (one process: the chunks apply at sp 1 too)
measured by the SavedTensorAccountant (what --report-memory prints) against activation_bytes with
the same MemoryOptions, per layer and in all, within 10%, and the change from plain Ulysses (the
logsumexp and, for one q per group without RoPE, the fused-qkv view) to within the index tensors;
a UlyssesAttention alone against the chunk terms (its saved input is the chunks' q, k, v slices,
k, v shared by the chunks when there are fewer key/value heads than chunks). The sp 2 case is in
tests/distributed/test_planner_head_chunks_sp2.py. The search: head chunks only when nothing cheaper
fits, the smallest N that does, and the printed flags read back by pretrain_gpt.py.
"""
import sys

import pytest
import torch

from megatron_sp.attention.backends import SDPAAttention
from megatron_sp.memory import MemoryOptions, SavedTensorAccountant
from megatron_sp.memory.accounting import layer_bytes
from megatron_sp.memory.planner import (Hardware, Workload, activation_bytes, head_chunk_choices,
                                        max_feasible_seq, plan, technique_candidates)
from megatron_sp.mesh import ParallelDims
from megatron_sp.models import GPTModel, preset
from megatron_sp.testing import load_script
from megatron_sp.ulysses import UlyssesAttention

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_memory_accounting import _cfg  # noqa: E402

TOL = 0.10
B, S = 2, 96


def _measure(cfg, mem, bf16):
    torch.manual_seed(0)
    model = GPTModel(cfg, memory=mem)
    ids = torch.randint(0, cfg.vocab_size, (B, S))
    acct = SavedTensorAccountant().attach(model)
    with acct.recording(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        model(input_ids=ids, labels=ids).float().mean().backward()
    acct.detach()
    return acct.report()


# GQA (4 kv heads: N = 2, 4 split them; 8 shares them), MQA (one kv head shared), MHA GPT-2
MODELS = {"gqa": ("llama", {}), "mqa": ("llama", {"num_query_groups": 1}), "mha": ("gpt2", {})}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_saved_bytes_with_head_chunks_match_the_measured_at_sp1(model, bf16):
    name, kw = MODELS[model]
    cfg = _cfg(name, **kw)
    e = 2 if bf16 else 4
    plain = _measure(cfg, MemoryOptions(), bf16)
    for n in (2, 4, 8):
        mem = MemoryOptions(ulysses_head_chunks=n)
        measured = _measure(cfg, mem, bf16)
        pred = activation_bytes(cfg, S, B, memory=mem, dtype_bytes=e, residual_bytes=4,
                                device="cpu")
        layers = layer_bytes(measured)
        per_layer = max(layers.values()) - pred["shared"]        # RoPE's cos/sin: under layer 0
        assert abs(pred["layer"] / per_layer - 1) <= TOL, (n, pred["terms"], layers)
        assert abs((pred["layers"] + pred["shared"]) / sum(layers.values()) - 1) <= TOL
        assert abs(pred["total"] / measured["device_bytes"] - 1) <= TOL
        # what the chunks change, to within the int64 head indices (<= 8 * (h + g) per layer)
        base = activation_bytes(cfg, S, B, dtype_bytes=e, residual_bytes=4, device="cpu")
        saved_less = plain["device_bytes"] - measured["device_bytes"]
        assert saved_less == pytest.approx(base["total"] - pred["total"], abs=1), (n, saved_less)
        assert saved_less > 0


@pytest.mark.parametrize("groups,n,shared", [(4, 2, False), (4, 4, False), (2, 4, True),
                                             (1, 8, True)])
def test_ulysses_attention_alone_keeps_the_chunks_slices(groups, n, shared):
    """UlyssesAttention(head_chunks=N) at sp 1 saves its chunks' q slices (all hl heads once) and
    k, v (gl heads each, once: split, or one copy shared), + the int64 head indices; nothing at
    the head layout (out, lse)."""
    b, s, h, d = 2, 64, 8, 16
    # not leaves (the accountant books tensors made from leaves as weight copies)
    leaves = [torch.randn(b, s, n_h, d, requires_grad=True) for n_h in (h, groups, groups)]
    q, k, v = (t * 1.0 for t in leaves)
    attn = UlyssesAttention(SDPAAttention(), None, head_chunks=n)
    acct = SavedTensorAccountant()
    with acct.recording():
        acct.new_pass()
        out = attn(q, k, v)
    out.sum().backward()
    measured = acct.report()["device_bytes"]
    cfg = preset("llama-tiny", num_layers=1, hidden_size=h * d, num_attention_heads=h,
                 num_query_groups=groups, ffn_hidden_size=64, vocab_size=300)
    terms = activation_bytes(cfg, s, b, memory=MemoryOptions(ulysses_head_chunks=n),
                             dtype_bytes=4, device="cpu")["terms"]
    assert measured == terms["sdpa_qkv"] + terms["chunk_index"]
    assert terms["chunk_index"] == 8 * (h + (0 if shared else groups))
    assert terms["sdpa_lse"] == terms["sdpa_out"] == 0


def _llama8b(seq):
    return preset("llama-8b", max_position_embeddings=seq)


def test_plan_takes_head_chunks_only_when_they_help():
    """1 GPU, Llama-8B: at the longest length plain Ulysses (head_chunks=1) fits, the plan has no
    head chunks; one step longer it needs them, and takes the smallest N that fits (every smaller
    valid N does not); the candidates put each rung's chunked forms after it."""
    hw = Hardware(num_gpus=1)
    dims = ParallelDims(1)
    cfg = _llama8b(1024)
    assert head_chunk_choices(cfg, Workload(seq=1024), dims) == [2, 4, 8, 16, 32]
    assert head_chunk_choices(cfg, Workload(seq=1024, head_chunks=1), dims) == []
    assert head_chunk_choices(cfg, Workload(seq=1024, head_chunks=3), dims) == []
    costs = [c for _, c in technique_candidates(cfg, Workload(seq=1024), dims)]
    assert costs == sorted(costs)
    seq, best = max_feasible_seq(_llama8b, hw, Workload(seq=1024, head_chunks=1), step=65536)
    assert best.memory.ulysses_head_chunks == 1
    same = plan(_llama8b(seq), Workload(seq=seq), hw)[0]
    assert same.memory.ulysses_head_chunks == 1 and same.score == best.score
    longer = seq + 65536
    assert not plan(_llama8b(longer), Workload(seq=longer, head_chunks=1), hw)
    chunked = plan(_llama8b(longer), Workload(seq=longer), hw)
    assert chunked, "head chunks let a longer sequence fit"
    n = chunked[0].memory.ulysses_head_chunks
    assert n > 1 and f"--ulysses-head-chunks {n}" in chunked[0].flags()
    for smaller in (c for c in head_chunk_choices(cfg, Workload(seq=1024), dims) if c < n):
        assert not plan(_llama8b(longer), Workload(seq=longer, head_chunks=smaller), hw)


def test_head_chunk_flags_parse_back(monkeypatch):
    """The printed flags of a plan with head chunks, read by pretrain_gpt.py's start-up, give the
    plan's MemoryOptions (head chunks included) and its layout."""
    pretrain_gpt = load_script("pretrain_gpt.py")
    seq = 768 * 1024                   # past plain Ulysses' 0.64M, within the chunks' 0.77M
    p = plan(_llama8b(seq), Workload(seq=seq), Hardware(num_gpus=1))[0]
    assert p.memory.ulysses_head_chunks > 1
    monkeypatch.setenv("WORLD_SIZE", "1")
    job, _ = pretrain_gpt.load_job(["--model", "llama-8b", *p.flags().split(), "--mock-data"])
    assert MemoryOptions.from_config(job.memory) == p.memory
    assert job.training.seq_length == seq
    assert job.parallel.sequence_parallel_size == p.sp


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_step_peak_with_head_chunks_bounds_the_measured_peak(bf16):
    """step_peak_bytes with head chunks against the measured peak of a step (the profiler's memory
    timeline, as in test_planner.py) where attention's backward sets it (16 heads of 64 over a
    hidden size of 64, MLP tiled, loss chunked, full recompute): never more than 3% under, at most
    20% over. (On CPU the measured peak does not fall with N: the index_select backward's
    full-size gradients and the stacked output's gradient are not per chunk.)"""
    from test_planner import predicted_and_measured_peak
    torch.manual_seed(0)
    seq = 2048
    cfg = preset("llama-tiny", num_layers=2, hidden_size=64, num_attention_heads=16,
                 num_query_groups=4, kv_channels=64, ffn_hidden_size=128, vocab_size=256,
                 max_position_embeddings=seq)
    ids = torch.randint(0, 256, (1, seq))
    for n in (2, 8):
        mem = MemoryOptions(recompute_granularity="full", mlp_tiles=4, loss_chunks=4,
                            ulysses_head_chunks=n)
        pred, measured = predicted_and_measured_peak(cfg, mem, ids, bf16)
        assert 0.97 <= pred / measured <= 1.2, (n, pred / measured, pred, measured)
