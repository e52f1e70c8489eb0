"""The planner counts Ulysses head chunks (--ulysses-head-chunks N, models/gpt.py SelfAttention;
issue 36).

Saved bytes: a GPTModel with head chunks N at sp = 1 (one process: the chunks apply at sp 1 too)
measured by the SavedTensorAccountant (what --report-memory prints) against activation_bytes with
the same MemoryOptions, per layer and in all, within 10%, and the change from the plain block
(its q, k, v, logsumexp and out-proj input) exactly; a SelfAttention alone saves its input and
nothing else. The step peak against the measured peak of live tensors. The sp 2 case is in
tests/distributed/test_planner_head_chunks_sp2.py. The search: head chunks only when nothing
cheaper fits, the smallest N that does, and the printed flags read back by pretrain_gpt.py.
"""
import sys

import pytest
import torch

from megatron_sp.attention.backends import SDPAAttention
from megatron_sp.memory import MemoryOptions, SavedTensorAccountant
from megatron_sp.memory.accounting import LiveTensorPeak, layer_bytes
from megatron_sp.memory.planner import (Hardware, Workload, activation_bytes, head_chunk_choices,
                                        max_feasible_seq, plan, step_peak_bytes,
                                        technique_candidates)
from megatron_sp.mesh import ParallelDims
from megatron_sp.models import GPTModel, preset
from megatron_sp.testing import load_script

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
        # what the chunks change, exactly
        base = activation_bytes(cfg, S, B, dtype_bytes=e, residual_bytes=4, device="cpu")
        saved_less = plain["device_bytes"] - measured["device_bytes"]
        assert saved_less == pytest.approx(base["total"] - pred["total"], abs=1), (n, saved_less)
        assert saved_less > 0


@pytest.mark.parametrize("groups,n", [(4, 2), (4, 4), (2, 4), (1, 8)])
def test_head_chunked_block_saves_only_its_input(groups, n):
    """SelfAttention(head_chunks=N) at sp 1 saves its input for backward and nothing else: the
    planner's qkv_input term, with the SDPA, logsumexp, out-proj input and attention weight-copy
    terms 0; whole groups per chunk or a share of one group's query heads (fp32)."""
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models.gpt import SelfAttention
    b, s, h, d = 2, 64, 8, 16
    cfg = preset("llama-tiny", num_layers=1, hidden_size=h * d, num_attention_heads=h,
                 num_query_groups=groups, ffn_hidden_size=64, vocab_size=300)
    block = SelfAttention(cfg, ParallelMesh.single(), SDPAAttention(), False, head_chunks=n)
    x = torch.randn(b, s, h * d) * 1.0
    x.requires_grad_()
    acct = SavedTensorAccountant()
    with acct.recording():
        acct.new_pass()
        out = block(x * 1.0)          # not a leaf (the accountant books leaves' copies as weights)
    out.sum().backward()
    report = acct.report()
    terms = activation_bytes(cfg, s, b, memory=MemoryOptions(ulysses_head_chunks=n),
                             dtype_bytes=4, device="cpu", weight_copies=True)["terms"]
    assert report["device_bytes"] == terms["qkv_input"] == b * s * h * d * 4
    assert report.get("weight_copy_bytes", 0) == 0
    assert all(terms[k] == 0 for k in ("sdpa_qkv", "sdpa_lse", "sdpa_out", "proj_input", "w_attn"))


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


def _live_peak(model, ids, bf16):
    """The most bytes of live tensors during one training step beyond what existed before it
    (gradients preexist, as in every step after the first): LiveTensorPeak, which sees tensors,
    not a kernel's internal scratch."""
    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids.roll(-1, 1)).float().mean()
        loss.backward()
    step()
    with LiveTensorPeak() as tracker:
        step()
    return tracker.peak


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_step_peak_with_head_chunks_bounds_the_measured_peak(bf16):
    """step_peak_bytes with head chunks against the measured peak of live tensors in a step where
    attention's backward sets it (16 heads of 64 over a hidden size of 64, MLP tiled, loss chunked,
    full recompute): never more than 3% under, at most 25% over, and falling with N as the
    measured one does. (The profiler's peak adds the CPU attention kernel's internal scratch,
    about 2.9 MB here whatever N; on CUDA the flash kernel's scratch is its fp32 dq accumulator,
    a tensor the planner counts.)"""
    torch.manual_seed(0)
    seq = 2048
    cfg = preset("llama-tiny", num_layers=2, hidden_size=64, num_attention_heads=16,
                 num_query_groups=4, kv_channels=64, ffn_hidden_size=128, vocab_size=256,
                 max_position_embeddings=seq)
    ids = torch.randint(0, 256, (1, seq))
    figures = []
    for n in (2, 8):
        mem = MemoryOptions(recompute_granularity="full", mlp_tiles=4, loss_chunks=4,
                            ulysses_head_chunks=n)
        model = GPTModel(cfg, memory=mem)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        measured = _live_peak(model, ids, bf16)
        pred = step_peak_bytes(cfg, seq, 1, memory=mem, dtype_bytes=2 if bf16 else 4,
                               residual_bytes=4, device="cpu")["device"]
        assert 0.97 <= pred / measured <= 1.25, (n, pred / measured, pred, measured)
        figures.append((pred, measured))
    (pred2, measured2), (pred8, measured8) = figures
    assert measured8 < 0.8 * measured2 and pred8 < 0.8 * pred2, figures
