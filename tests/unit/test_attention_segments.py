"""Packed documents as segments (attention/segments.py) and the block kernels that run them
(attention/block_kernels.py), on CPU.

- range_segments: one dense rectangle or nothing for keys before queries, causal squares on the
  diagonal, every shared document when not causal; overlapping causal ranges refused.
- ring_plan: over the cp steps every rank's segments cover exactly its rows of the block-diagonal
  causal mask, each (query, key) once, for cp 1-5, with one-token documents, a document spanning
  the whole row (every rank), hundreds of short ones, and none; queries disjoint inside a batch;
  the per-step work balanced without documents and smaller with them.
- blockwise_plan with a sliding window: the windowed block-diagonal mask, once.
- The CUDA kernels' glue (FlashAttention-2 varlen, memory-efficient) run on CPU against stand-ins
  honouring the aten schemas of the torch at hand (argument count and keyword names checked),
  compared with the CPU kernel: forward 1e-5, gradients 1e-4 (fp32). The math path's refusal.
"""
import math

import pytest
import torch

from megatron_sp.attention import block_kernels
from megatron_sp.attention.blockwise import blockwise_plan
from megatron_sp.attention.documents import document_causal_mask
from megatron_sp.attention.lse import backward_math, forward_math
from megatron_sp.attention.segments import (document_bounds, range_segments, ranges_batches,
                                            ring_plan, zigzag_ranges)
from megatron_sp.context_parallel import zigzag_positions
from megatron_sp.errors import ConfigError
from megatron_sp.testing import packed_document_ids

FWD_TOL, GRAD_TOL = 1e-5, 1e-4


def test_range_segments_are_one_rectangle_or_causal_squares():
    bounds = [0, 3, 10, 12, 16]                        # documents [0,3) [3,10) [10,12) [12,16)
    # keys [0, 4) before queries [8, 12): only document [3, 10) meets both
    assert range_segments(bounds, (8, 12), (0, 4), causal=True) == [(8, 10, 3, 4, False)]
    assert range_segments(bounds, (12, 16), (0, 4), causal=True) == []      # no document spans
    assert range_segments(bounds, (0, 4), (8, 12), causal=True) == []       # keys after
    assert range_segments(bounds, (2, 12), (2, 12), causal=True) == [
        (2, 3, 2, 3, True), (3, 10, 3, 10, True), (10, 12, 10, 12, True)]
    assert range_segments(bounds, (0, 4), (8, 12), causal=False) == [(3, 4, 8, 10, False)]
    assert range_segments([0, 16], (8, 12), (0, 4), causal=True) == [(8, 12, 0, 4, False)]
    with pytest.raises(ValueError, match=r"equal or disjoint ranges.*\[2, 6\).*\[4, 8\)"):
        range_segments(bounds, (2, 6), (4, 8), causal=True)


def _documents(kind, gen, b, s):
    return packed_document_ids(kind, gen, b, s)


def _cover(batches, b, q_pos, k_pos):
    """[b, nq, nk] counts of how often each (local query, local key) is computed, and checks
    that the queries of a batch never overlap within a row."""
    seen = torch.zeros(b, len(q_pos), len(k_pos), dtype=torch.int64)
    for batch in batches:
        once = torch.zeros(b, len(q_pos), dtype=torch.int64)
        for rows, q0, q1, k0, k1 in batch.rows(b):
            block = torch.ones(q1 - q0, k1 - k0, dtype=torch.int64)
            seen[rows, q0:q1, k0:k1] += block.tril() if batch.causal else block
            once[rows, q0:q1] += 1
        assert once.max() <= 1, "a batch's queries overlap"
    return seen


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("kind", ["none", "one-token", "whole-row", "hundreds", "random"])
def test_ring_plan_covers_the_document_causal_mask_once(cp, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    b, c = 2, 20 if kind == "hundreds" else 3
    s = 2 * cp * c
    ids = _documents(kind, gen, b, s)
    allowed = (torch.ones(b, s, s, dtype=torch.bool).tril() if ids is None
               else document_causal_mask(ids)[:, 0])                     # [b, s, s]
    bounds = document_bounds(ids)
    for r in range(cp):
        plan = ring_plan(bounds, b, s, cp, r, causal=True)
        q_pos = zigzag_positions(s, cp, r)
        work = []
        for i, batches in enumerate(plan.steps):
            k_pos = zigzag_positions(s, cp, (r - i) % cp)
            seen = _cover(batches, b, q_pos, k_pos)
            want = allowed[:, q_pos][:, :, k_pos].long()
            assert torch.equal(seen, want), f"rank {r} step {i}: wrong or repeated pairs"
            assert plan.work[i] == int(want.sum())
            work.append(plan.work[i])
        if ids is None:        # the zigzag balance: every step the same work but the diagonal's
            assert work[1:] == [2 * b * c * c] * (cp - 1)
            assert work[0] == b * (c * (c + 1) + c * c)


def test_ring_plan_with_hundreds_of_documents_computes_a_small_fraction():
    gen = torch.Generator().manual_seed(0)
    b, s, cp = 1, 8192, 4
    ids = (torch.rand(b, s, generator=gen) < 1 / 32).long().cumsum(1)   # ~256 documents
    plain = sum(sum(ring_plan(None, b, s, cp, r, True).work) for r in range(cp))
    docs = sum(sum(ring_plan(document_bounds(ids), b, s, cp, r, True).work) for r in range(cp))
    assert plain == s * (s + 1) // 2
    assert docs < plain / 50, (docs, plain)


@pytest.mark.parametrize("kind", ["none", "hundreds", "random"])
def test_blockwise_window_plan_covers_the_windowed_mask_once(kind, seed):
    gen = torch.Generator().manual_seed(seed)
    b, s, block, window = 2, 40, 8, 11
    ids = _documents(kind, gen, b, s)
    allowed = (torch.ones(b, s, s, dtype=torch.bool).tril() if ids is None
               else document_causal_mask(ids)[:, 0])
    pos = torch.arange(s)
    allowed &= (pos[:, None] - pos[None, :] < window)
    seen = torch.zeros(b, s, s, dtype=torch.int64)
    for batch, w in blockwise_plan(ids, s, block, True, window):
        for rows, q0, q1, k0, k1 in batch.rows(b):
            cell = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
            cell = cell.tril() if batch.causal else cell
            if w is not None:
                cell &= (pos[q0:q1, None] - pos[None, k0:k1] < w)
            seen[rows, q0:q1, k0:k1] += cell.long()
    assert torch.equal(seen, allowed.long())


# The CUDA kernels' glue, against stand-ins -----------------------------------------------------

def _check_schema(name, args, kwargs):
    """The call fits aten::<name>'s schema on this torch: positional count and keyword names."""
    schema = getattr(torch.ops.aten, name).default._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    assert len(args) <= len(positional), f"{name}: {len(args)} positional arguments"
    names = {a.name for a in schema.arguments}
    assert set(kwargs) <= names, f"{name}: unknown keywords {set(kwargs) - names}"
    required = [a.name for a in positional if not a.has_default_value()]
    assert len(args) >= len(required), f"{name}: missing {required[len(args):]}"


def _segments_of(cu):
    return list(zip(cu[:-1].tolist(), cu[1:].tolist()))


def _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug, *, scale):
    if cu_q is None:                    # one segment on views: [b, L, heads, d], lse [b, h, L]
        assert cu_k is None and q.dim() == 4 and q.stride(-1) == 1 and max_q == q.shape[1]
        o, l = forward_math(q, k, v, is_causal, scale, None)
        return o, l, torch.zeros(2), torch.empty(0), torch.empty(0)
    assert q.dim() == 3 and k.shape[1] <= q.shape[1] and q.is_contiguous()   # GQA as is
    assert cu_q.dtype == cu_k.dtype == torch.int32 and dropout_p == 0.0
    out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0])       # lse [h, Tq]
    for (a0, a1), (b0, b1) in zip(_segments_of(cu_q), _segments_of(cu_k)):
        assert a1 - a0 <= max_q and b1 - b0 <= max_k
        o, l = forward_math(q[None, a0:a1], k[None, b0:b1], v[None, b0:b1], is_causal, scale,
                             None)
        out[a0:a1], lse[:, a0:a1] = o[0], l[0]
    return out, lse, torch.zeros(2), torch.empty(0), torch.empty(0)


def _flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
                    rng_state, unused, *, scale):
    if cu_q is None:
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.is_contiguous()
        return backward_math(q, k, v, out, dout, lse, is_causal, scale, None)
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (a0, a1), (b0, b1) in zip(_segments_of(cu_q), _segments_of(cu_k)):
        gq, gk, gv = backward_math(q[None, a0:a1], k[None, b0:b1], v[None, b0:b1],
                                    out[None, a0:a1], dout[None, a0:a1], lse[None, :, a0:a1],
                                    is_causal, scale, None)
        dq[a0:a1] += gq[0]
        dk[b0:b1] += gk[0]
        dv[b0:b1] += gv[0]
    return dq, dk, dv


def _efficient_forward(q, k, v, bias, compute_lse, dropout_p, is_causal, *, scale):
    assert q.shape[1] == k.shape[1] and bias is None and compute_lse      # heads expanded
    o, l = forward_math(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal,
                         scale, None)
    padded = torch.zeros(*l.shape[:2], -(-l.shape[2] // 32) * 32)
    padded[:, :, :l.shape[2]] = l
    return o.transpose(1, 2), padded, torch.zeros(()), torch.zeros(())


def _efficient_backward(dout, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_mask,
                        is_causal, *, scale):
    assert lse.shape[-1] % 32 == 0 and lse.shape[-1] >= q.shape[2]
    grads = backward_math(*(t.transpose(1, 2) for t in (q, k, v, out, dout)),
                           lse[:, :, :q.shape[2]], is_causal, scale, None)
    return tuple(t.transpose(1, 2) for t in grads) + (None,)


STAND_INS = {"_flash_attention_forward": _flash_forward,
             "_flash_attention_backward": _flash_backward,
             "_scaled_dot_product_efficient_attention": _efficient_forward,
             "_scaled_dot_product_efficient_attention_backward": _efficient_backward}


@pytest.fixture
def cuda_stand_ins(monkeypatch):
    calls = []

    def aten(name):
        def call(*args, **kwargs):
            _check_schema(name, args, kwargs)
            calls.append(name)
            return STAND_INS[name](*args, **kwargs)
        return call

    monkeypatch.setattr(block_kernels, "_aten", aten)
    return calls


def _run_ring_rank(q, k, v, dout, batches_of_steps, kernel, scale):
    """One rank of a ring of one step per held block, through forward_batch / backward_batch."""
    b, n, h, d = q.shape
    out = torch.zeros(b, n, h, d)
    lse = torch.full((b, n, h), float("-inf"))
    for batches in batches_of_steps:
        for batch in batches:
            block_kernels.forward_batch(q, k, v, batch, scale=scale, out=out, lse=lse,
                                        kernel=kernel)
    dq, dk, dv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
    for batches in batches_of_steps:
        for batch in batches:
            block_kernels.backward_batch(q, k, v, out, dout, lse, batch, scale=scale, dq=dq,
                                         dk=dk, dv=dv, kernel=kernel)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("kind", ["none", "random", "hundreds"])
def test_cuda_kernel_glue_matches_the_cpu_kernel(cuda_stand_ins, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    b, s, h, g, d = 2, 48, 4, 2, 8
    q, dout = (torch.randn(b, s, h, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, s, g, d, generator=gen) for _ in range(2))
    ids = _documents(kind, gen, b, s)
    bounds = document_bounds(ids)
    # a two-chunk rank against a two-chunk block: the ring's shape of work (cp 2, rank 1, src 0)
    steps = [ranges_batches(bounds, zigzag_ranges(2, 1, s // 4), zigzag_ranges(2, 1, s // 4),
                            True),
             ranges_batches(bounds, zigzag_ranges(2, 1, s // 4), zigzag_ranges(2, 0, s // 4),
                            True)]
    n = s // 2
    qs, ds = q[:, :n].contiguous(), dout[:, :n].contiguous()
    ks, vs = k[:, :n].contiguous(), v[:, :n].contiguous()
    scale = 1 / math.sqrt(d)
    want = _run_ring_rank(qs, ks, vs, ds, steps, "cpu", scale)
    for kernel in ("flash", "efficient"):
        cuda_stand_ins.clear()
        got = _run_ring_rank(qs, ks, vs, ds, steps, kernel, scale)
        assert cuda_stand_ins, f"{kernel}: the stand-ins were never called"
        finite = torch.isfinite(want[1])
        assert torch.equal(torch.isfinite(got[1]), finite), f"{kernel}: lse rows differ"
        for name, x, y, tol in zip(["out", "lse", "dq", "dk", "dv"], got, want,
                                   [FWD_TOL, FWD_TOL, GRAD_TOL, GRAD_TOL, GRAD_TOL]):
            x, y = (t.masked_fill(~torch.isfinite(t), 0) for t in (x, y))
            err = (x - y).abs().max().item()
            assert err <= tol, f"{kernel} {name}: max error {err:.3g} > {tol}"
    batches = [batch for step in steps for batch in step]
    cuda_stand_ins.clear()                 # varlen: one call per batch, not per segment
    _run_ring_rank(qs, ks, vs, ds, steps, "flash", scale)
    assert cuda_stand_ins.count("_flash_attention_forward") == len(batches)
    assert cuda_stand_ins.count("_flash_attention_backward") == len(batches)
    if kind == "hundreds":       # short documents share calls
        assert len(batches) < sum(len(batch.segments) for batch in batches)


def test_batches_stay_within_the_token_budget(monkeypatch):
    """A batch packs at most PACK_TOKENS query tokens (a larger segment alone), so a varlen call's
    copies stay bounded; the segments are all still there."""
    from megatron_sp.attention import segments
    monkeypatch.setattr(segments, "PACK_TOKENS", 16)
    monkeypatch.setattr(segments, "ALONE_TOKENS", 24)
    bounds = [[0, 5, 30, 34, 40, 52, 64]]               # documents of 5, 25, 4, 6, 12, 12 tokens
    batches = ranges_batches(bounds, [(0, 0, 64)], [(0, 0, 64)], True)
    sizes = [[q1 - q0 for _, q0, q1, _, _ in batch.segments] for batch in batches]
    assert sizes == [[25], [5, 4, 6], [12], [12]], sizes     # 25 >= ALONE_TOKENS: alone
    plain = ranges_batches(None, [(0, 0, 8), (16, 8, 8)], [(0, 0, 8), (16, 8, 8)], True)
    assert [len(batch.segments) for batch in plain] == [1, 1, 1]   # no documents: each alone


def test_math_path_refuses_a_long_block_on_an_accelerator():
    q = torch.zeros(1, 4096, 1, 8, device="meta")
    with pytest.raises(ConfigError, match=r"a 4096 x 4096 attention block .* fp32 math path"):
        block_kernels._check_math(q, q)
    block_kernels._check_math(q[:, :2048], q[:, :2048])                   # 2048 x 2048 allowed


def test_block_kernel_choice_per_device_and_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert block_kernels.block_kernel(cpu, torch.bfloat16, 128) == "cpu"
    assert block_kernels.block_kernel(cuda, torch.bfloat16, 128) == "flash"
    assert block_kernels.block_kernel(cuda, torch.float16, 100) == "efficient"   # d % 8 != 0
    assert block_kernels.block_kernel(cuda, torch.float32, 128) == "efficient"
    assert block_kernels.block_kernel(cuda, torch.float64, 128) == "math"


def test_pretrain_refuses_a_head_size_the_cuda_block_kernels_cannot_take():
    """pretrain_gpt's start-up check on CUDA: the ring (or SDPA's packed documents) with a head
    size that is not a multiple of 8 is one sentence naming the --kv-channels that works."""
    from types import SimpleNamespace

    from megatron_sp.models import GPTConfig
    from megatron_sp.cli import startup_checks
    odd = GPTConfig(num_layers=1, hidden_size=48, num_attention_heads=4, vocab_size=64)   # d 12
    ring = SimpleNamespace(cp_size=2)
    assert startup_checks.block_kernel_problem(odd, ring) == (
        "ring attention (--context-parallel-size 2) runs the fused block kernels "
        "(FlashAttention-2 varlen, the memory-efficient kernel), which need a head size that is a "
        "multiple of 8, got 12: use --kv-channels 16.")
    assert "--attention-backend te / flash-attn" in startup_checks.block_kernel_problem(
        odd, SimpleNamespace(cp_size=1))
    even = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=64)  # d 16
    assert startup_checks.block_kernel_problem(even, ring) is None
