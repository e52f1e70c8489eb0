"""The one-process ring rehearsal (context_parallel/rehearsal.py), on CPU.

ring_rehearsal of cp 2 and 4 virtual ranks equals full causal attention under the block-diagonal
document mask (the reference: SDPA in fp32 on the full rows, gradients by autograd), with MHA and
GQA, and documents none / one-token ones / one covering the whole row / hundreds of short ones.
Fresh random inputs per test (the test's seed); tolerances, fp32 with the CPU flash kernel:
forward (what the loss is made of) max abs error 1e-5, dq / dk / dv max abs error 1e-4.
It runs the real plan and block kernels (calls counted), makes no torch.distributed call, and
rehearse_rank_peak has no peak to report on CPU (None).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_sp.attention.documents import document_causal_mask
from megatron_sp.context_parallel import rehearsal, ring
from megatron_sp.context_parallel.rehearsal import (rehearsal_plans, rehearse_rank_peak,
                                                    ring_rehearsal)
from megatron_sp.mesh import LayoutError

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

FWD_TOL, GRAD_TOL = 1e-5, 1e-4
HEADS = {"mha": (4, 4), "gqa": (4, 2)}


def _documents(kind, gen, b, s):
    if kind == "none":
        return None
    if kind == "one-token":                      # one-token documents, then one long one
        ids = torch.arange(s).expand(b, s).clone()
        ids[:, s // 2:] = s
        return ids
    if kind == "whole-row":                      # one document spanning every rank's tokens
        return torch.full((b, s), 5)
    if kind == "hundreds":                       # ~2.5-token documents, ~200 a row
        return (torch.rand(b, s, generator=gen) < 0.4).long().cumsum(1)
    raise ValueError(kind)


def _inputs(gen, b, s, h, g, d):
    q, dout = (torch.randn(b, s, h, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, s, g, d, generator=gen) for _ in range(2))
    return q, k, v, dout


def _grads(fn, q, k, v, dout):
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*qkv)
    out.backward(dout)
    return out.detach(), [t.grad for t in qkv]


def _reference(q, k, v, ids, causal=True):
    b, s = q.shape[:2]
    if ids is None:
        allowed = torch.ones(s, s, dtype=torch.bool)
        allowed = (allowed.tril() if causal else allowed)[None, None]
    else:
        allowed = document_causal_mask(ids, causal=causal)               # [b, 1, s, s]
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=allowed, enable_gqa=True).transpose(1, 2)


def _assert_close(got, want, tol, what):
    err = (got - want).abs().max().item()
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol}"


def _check(q, k, v, dout, cp, ids, causal=True):
    want, want_grads = _grads(lambda *t: _reference(*t, ids, causal), q, k, v, dout)
    got, got_grads = _grads(lambda *t: ring_rehearsal(*t, cp, causal=causal, document_ids=ids),
                            q, k, v, dout)
    assert got.shape == want.shape and got.dtype == q.dtype
    _assert_close(got, want, FWD_TOL, "out")
    for name, x, y in zip(("dq", "dk", "dv"), got_grads, want_grads):
        assert x.dtype == q.dtype
        _assert_close(x, y, GRAD_TOL, name)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("kind", ["none", "one-token", "whole-row", "hundreds"])
def test_rehearsal_equals_full_attention_with_the_document_mask(cp, heads, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    h, g = HEADS[heads]
    b, s, d = 2, 512 if kind == "hundreds" else 64, 16
    q, k, v, dout = _inputs(gen, b, s, h, g, d)
    ids = _documents(kind, gen, b, s)
    if kind == "hundreds":
        assert int(ids[:, -1].min()) >= 150, "fewer documents than meant"
    _check(q, k, v, dout, cp, ids)


def test_rehearsal_of_one_rank_and_without_causality(seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = _inputs(gen, 2, 32, 4, 2, 8)
    _check(q, k, v, dout, 1, None)                                     # cp = 1: plain attention
    ids = (torch.rand(2, 32, generator=gen) < 0.2).long().cumsum(1)
    _check(q, k, v, dout, 2, ids, causal=False)                        # each document's square


def test_rehearsal_runs_the_ring_plan_and_block_kernels(monkeypatch, seed):
    """Every batch of every virtual rank's plan goes through forward_batch once and backward_batch
    once, against the kv block of rank (r - i) mod cp at step i; no torch.distributed call."""
    gen = torch.Generator().manual_seed(seed)
    b, s, cp = 1, 48, 3
    q, k, v, dout = _inputs(gen, b, s, 4, 2, 8)
    ids = (torch.rand(b, s, generator=gen) < 0.15).long().cumsum(1)
    plans = rehearsal_plans(ids, b, s, cp, True)
    calls = {"forward": [], "backward": []}
    real_forward, real_backward = ring.forward_batch, ring.backward_batch

    def forward(q_, k_, v_, batch, **kw):
        calls["forward"].append((id(batch), k_))
        return real_forward(q_, k_, v_, batch, **kw)

    def backward(q_, k_, v_, *args, **kw):
        calls["backward"].append((id(args[3]), k_))
        return real_backward(q_, k_, v_, *args, **kw)

    monkeypatch.setattr(ring, "forward_batch", forward)
    monkeypatch.setattr(ring, "backward_batch", backward)
    import torch.distributed as dist

    def no_distributed(*a, **kw):
        raise AssertionError("the rehearsal made a torch.distributed call")

    for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv", "all_reduce",
                 "barrier", "get_rank", "get_world_size"):
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, no_distributed)
    _, grads = _grads(lambda *t: ring_rehearsal(*t, cp, document_ids=ids, plans=plans),
                      q, k, v, dout)
    # the batches in the lockstep order: step by step, rank by rank, but in forward each rank
    # runs its last step right after the one before (no exchange left to wait for), as it would
    backward = [(r, i) for i in range(cp) for r in range(cp)]
    forward = [(r, i) for i in range(cp - 2) for r in range(cp)] + [
        (r, i) for r in range(cp) for i in (cp - 2, cp - 1)]
    c = s // (2 * cp)
    for kind, order in (("forward", forward), ("backward", backward)):
        want = [(id(batch), r, i) for r, i in order for batch in plans[r].steps[i]]
        assert [c_[0] for c_ in calls[kind]] == [w[0] for w in want], kind
        for (_, held), (_, r, i) in zip(calls[kind], want):
            src = (r - i) % cp
            expect = torch.cat([k[:, src * c:(src + 1) * c],
                                k[:, (2 * cp - 1 - src) * c:(2 * cp - src) * c]], dim=1)
            assert torch.equal(held, expect), f"{kind}: rank {r} step {i} held the wrong block"
    assert all(torch.isfinite(t).all() for t in grads)


def test_rehearsal_refuses_what_the_ring_refuses():
    q = torch.zeros(1, 30, 4, 8)
    k = torch.zeros(1, 30, 2, 8)
    with pytest.raises(LayoutError, match=r"2\*cp = 4 chunks"):
        ring_rehearsal(q, k, k, 2)
    with pytest.raises(ValueError, match=r"multiple of the key/value heads"):
        ring_rehearsal(q[:, :, :3], k, k, 1)
    with pytest.raises(ValueError, match=r"full rows"):
        ring_rehearsal(q[:, :28], k[:, :28], k[:, :28], 2, document_ids=torch.zeros(1, 14).long())


def test_rank_peak_is_none_off_cuda_and_its_rank_runs_alone(seed):
    """No peak off CUDA; the one-rank run it measures on CUDA (random blocks arriving) works."""
    assert rehearse_rank_peak(1, 64, 4, 2, 8, 4, 1, torch.float32, "cpu") is None
    gen = torch.Generator().manual_seed(seed)
    b, s, cp, rank = 1, 96, 4, 2
    ids = (torch.rand(b, s, generator=gen) < 0.1).long().cumsum(1)
    plan = rehearsal_plans(ids, b, s, cp)[rank]
    q, k, v, _ = _inputs(gen, b, s // cp, 4, 2, 8)
    grads = rehearsal._rank_alone(q, k, v, plan, 1 / math.sqrt(8))
    assert [t.shape for t in grads] == [q.shape, k.shape, v.shape]
    assert all(torch.isfinite(t).all() and t.dtype == q.dtype for t in grads)
