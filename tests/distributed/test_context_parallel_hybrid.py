"""The Ulysses x ring hybrid (context_parallel.hybrid) on 4 gloo ranks, one spawn: a=2 x r=2
(Ulysses groups [0, 1], [2, 3]; ring groups [0, 2], [1, 3]) and the degenerate a=4 x r=1 (Ulysses
alone) and a=1 x r=4 (ring alone). (Larger compositions run in the whole model on 8 ranks:
tests/distributed/test_context_parallel.py.)

Every rank draws the same full q, k, v, dout (seeded, fresh per case), keeps its tokens
(hybrid_split), runs hybrid_attention forward and backward, and all-gathers output and gradients
over the cp group; merged (hybrid_merge) they must equal full causal attention on one rank (SDPA,
fp32): output 1e-5, dq, dk, dv 1e-4. Heads: MHA h=4 and GQA with g=2 and g=1 kv heads (a=2:
split and replicated; a=4: replicated twice and four times). The bytes sent are checked exactly
against the per-rank counts derived here (and hybrid_comm_bytes):

    n = s/(a r) tokens per rank, g_e = max(g, a) kv heads after replication
    all-to-all, forward and backward each   (a-1)/a * b n d (h + 2 g_e)  +  (a-1)/a * b n d h
    ring forward                            2 (r-1) b n g_e d
    ring backward                           2 (r-1) b n g_e d + 2 r b n g_e d (fp32), 0 if r = 1
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_sp import comm_stats
from megatron_sp.context_parallel import COMM_KIND as RING_KIND
from megatron_sp.context_parallel.hybrid import (check_hybrid_length, hybrid_attention,
                                                 hybrid_comm_bytes, hybrid_group_ranks,
                                                 hybrid_merge, hybrid_positions, hybrid_split)
from megatron_sp.mesh import LayoutError
from megatron_sp.testing import run_distributed
from megatron_sp.ulysses import COMM_KIND as A2A_KIND

FWD_TOL, GRAD_TOL = 1e-5, 1e-4
B, D = 2, 8
HEADS = [(4, 4), (4, 2), (4, 1)]                      # (h, g): MHA, GQA split / replicated


def _groups(rank, world, layouts):
    """{(a, r): (ulysses group, ring group)} for this rank; every rank creates every group, in the
    same order. A group of one rank is None. The whole world is one group object, shared."""
    whole = dist.new_group(list(range(world)))
    made = {}
    for a, r in layouts:
        ulysses_groups, ring_groups = hybrid_group_ranks(a, r)
        mine = []
        for groups in (ulysses_groups, ring_groups):
            found = None
            for members in groups:
                if len(members) == 1:
                    group = None
                elif len(members) == world:
                    group = whole
                else:
                    group = dist.new_group(members)
                if rank in members:
                    found = group
            mine.append(found)
        made[(a, r)] = tuple(mine)
    return whole, made


def _reference(q, k, v, dout):
    """Full causal attention and its gradients on one rank (SDPA, GQA by enable_gqa)."""
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in qkv), is_causal=True,
                                         enable_gqa=True).transpose(1, 2)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in qkv]


def _expected_bytes(s, h, g, a, r):
    """Per-rank bytes derived from what the implementation sends (fp32 everywhere)."""
    n, g_e = s // (a * r), max(g, a)
    a2a = ((a - 1) * B * n * D * (h + 2 * g_e) // a + (a - 1) * B * n * D * h // a) * 4
    ring_fwd = 2 * (r - 1) * B * n * g_e * D * 4
    ring_bwd = ring_fwd + (2 * r * B * n * g_e * D * 4 if r > 1 else 0)
    return {"a2a_forward": a2a, "a2a_backward": a2a, "ring_forward": ring_fwd,
            "ring_backward": ring_bwd}


def _check_case(rank, world, whole, groups, a, r, s, h, g, seed):
    u, j = rank % a, rank // a
    assert groups[0] is None or dist.get_rank(groups[0]) == u
    assert groups[1] is None or dist.get_rank(groups[1]) == j
    gen = torch.Generator().manual_seed(seed + 1000 * a + 100 * r + 10 * h + g)
    q, k, v, dout = (torch.randn(B, s, heads, D, generator=gen) for heads in (h, g, g, h))
    want = _reference(q, k, v, dout)

    # the positions helper and the split agree, and the split covers the sequence once
    positions = hybrid_positions(s, a, r, u, j)
    assert torch.equal(hybrid_split(torch.arange(s).view(1, s), a, r, u, j)[0], positions)
    every = [torch.empty_like(positions) for _ in range(world)]
    dist.all_gather(every, positions, group=whole)
    assert sorted(torch.cat(every).tolist()) == list(range(s))
    assert torch.equal(hybrid_merge(every, a, r, dim=0), torch.arange(s))

    mine = [hybrid_split(t, a, r, u, j).requires_grad_() for t in (q, k, v)]
    comm_stats.reset()
    out = hybrid_attention(*mine, *groups)
    forward = comm_stats.snapshot()
    comm_stats.reset()
    out.backward(hybrid_split(dout, a, r, u, j))
    backward = comm_stats.snapshot()
    sent = {"a2a_forward": forward.get(A2A_KIND, 0), "a2a_backward": backward.get(A2A_KIND, 0),
            "ring_forward": forward.get(RING_KIND, 0), "ring_backward": backward.get(RING_KIND, 0)}
    expected = _expected_bytes(s, h, g, a, r)
    assert sent == expected == hybrid_comm_bytes(B, s, h, g, D, a, r), (a, r, h, g, sent, expected)

    errors = {}
    got = [out.detach()] + [t.grad for t in mine]
    for name, tol, t, ref in zip(["out", "dq", "dk", "dv"], [FWD_TOL] + [GRAD_TOL] * 3, got, want):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=whole)
        full = hybrid_merge(parts, a, r)
        assert full.shape == ref.shape and not torch.isnan(full).any(), name
        errors[name] = (full - ref).abs().max().item()
        assert errors[name] <= tol, (f"a={a} r={r} h={h} g={g} {name}: max error "
                                     f"{errors[name]:.3g} > {tol}")
    return errors, sent


def _hybrid_checks(rank, world, layouts, s, heads, seed):
    torch.manual_seed(seed)
    whole, groups = _groups(rank, world, layouts)
    results = {}
    for a, r in layouts:
        for h, g in heads:
            results[(a, r, h, g)] = _check_case(rank, world, whole, groups[(a, r)], a, r, s, h, g,
                                                seed)
    # refusals, raised before any communication (so every rank raises, none hangs)
    a, r = layouts[0]
    u_group, r_group = groups[(a, r)]
    x = torch.randn(1, 6, 6, D)
    try:
        hybrid_attention(x, torch.randn(1, 6, 3, D), torch.randn(1, 6, 3, D), u_group, r_group)
        raise AssertionError("h=6, g=3 over a=2 was not refused")
    except LayoutError as e:
        results["heads_refused"] = str(e)
    try:
        hybrid_attention(torch.randn(1, 3, 4, D), *(torch.randn(1, 3, 2, D),) * 2, u_group, r_group)
        raise AssertionError("3 tokens per rank were not refused")
    except LayoutError as e:
        results["length_refused"] = str(e)
    return results


def _assert_results(results, layouts, heads):
    for rank_result in results:
        for a, r in layouts:
            for h, g in heads:
                errors, _ = rank_result[(a, r, h, g)]
                assert errors["out"] <= FWD_TOL and max(errors.values()) <= GRAD_TOL, errors
        assert "3 key/value heads" in rank_result["heads_refused"], rank_result["heads_refused"]
        assert "multiple of 2*r*a" in rank_result["length_refused"], rank_result["length_refused"]
    # every rank of a layout sends the same bytes (the layout is balanced)
    for key in results[0]:
        if isinstance(key, tuple):
            assert len({str(res[key][1]) for res in results}) == 1, key


@pytest.mark.timeout(240)
def test_hybrid_attention_4_ranks(seed):
    layouts = [(2, 2), (4, 1), (1, 4)]
    results = run_distributed(_hybrid_checks, 4, layouts, 32, HEADS, seed)
    _assert_results(results, layouts, HEADS)
    # the formula in N, H terms (docs/design.md §14): a=2 x r=2, MHA, forward
    n, H = 32 // 4, 4 * D
    sent = results[0][(2, 2, 4, 4)][1]
    assert sent["a2a_forward"] == (2 - 1) / 2 * (2 + 2) * B * 32 * H / 4 * 4
    assert sent["ring_forward"] == 2 * (2 - 1) * B * 32 * H / 4 * 4 == 2 * B * n * 4 * D * 4


def test_hybrid_layout_without_processes():
    assert hybrid_group_ranks(2, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert hybrid_positions(16, 2, 2, 1, 0).tolist() == [12, 13, 14, 15]
    assert hybrid_positions(16, 2, 2, 1, 1).tolist() == [8, 9, 10, 11]
    assert hybrid_positions(8, 4, 1, 2, 0).tolist() == [4, 5]          # r = 1: contiguous
    assert check_hybrid_length(48, 2, 3) == 8
    with pytest.raises(LayoutError, match=r"length of 20 does not fit: use a multiple of "
                                          r"2\*r\*a = 8, e.g. 16\."):
        hybrid_positions(20, 2, 2, 0, 0)
    t = torch.randn(2, 48, 3)
    parts = [hybrid_split(t, 2, 3, rank % 2, rank // 2) for rank in range(6)]
    assert torch.equal(hybrid_merge(parts, 2, 3), t)
