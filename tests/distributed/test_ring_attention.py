"""Ring attention on 4 gloo ranks, one spawn: rings of cp = 4 (all ranks) and cp = 2 (strided
groups [0, 2] and [1, 3], so ring order is group order, not global rank order).

Every rank draws the same full q, k, v (same seed), zigzag-splits them, runs ring_attention, and
gathers every rank's output and gradients over its ring; zigzag-merged, they must equal full
causal attention (SDPA, fp32) on one rank: forward 1e-5, gradients 1e-4. MHA and GQA with 2 kv
heads (cp = 4 > 2 kv heads), causal and not, and packed documents (the reference then has a
block-diagonal causal mask; one-token documents, a document spanning a whole row, and a 512-token
row of ~3-token documents, hundreds of them, at cp 4 and 2).
The bytes the ring sends are checked exactly: forward 2 (cp-1) x (kv elements per rank) x element
size; backward (cp-1) kv blocks plus cp fp32 dk, dv blocks; with documents too (the segments are
planned from the full rows' ids every rank has: nothing but the kv blocks travels).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_sp import comm_stats
from megatron_sp.attention.documents import document_causal_mask
from megatron_sp.context_parallel import COMM_KIND, ring_attention, zigzag_merge, zigzag_split
from megatron_sp.testing import packed_document_ids, run_distributed

WORLD = 4
FWD_TOL, GRAD_TOL = 1e-5, 1e-4
B, S, D = 2, 32, 8
S_LONG = 512                                                        # hundreds of documents
CASES = [(4, 4, True, False), (4, 2, True, False), (4, 1, True, False), (2, 2, False, False),
         (4, 2, True, True), (2, 1, False, True)]                   # (h, g, causal, documents)


def _rings(rank):
    """{cp: this rank's ring group}; new_group is called by every rank, in the same order."""
    rings = {4: dist.new_group(list(range(WORLD)))}
    for members in ([0, 2], [1, 3]):
        group = dist.new_group(members)
        if rank in members:
            rings[2] = group
    return rings


def _documents(gen):
    """[B, S] ids: random boundaries in row 0 (one-token documents at both ends), one document
    spanning the whole of row 1."""
    ids = (torch.rand(B, S, generator=gen) < 0.2).long().cumsum(1)
    ids[0, 0], ids[0, -1] = -1, ids[0, -2] + 1
    ids[1] = 5
    return ids


def _reference(q, k, v, dout, causal, docs=None):
    """Full attention and its gradients on one rank (SDPA, GQA by enable_gqa; with documents a
    block-diagonal (causal) mask)."""
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = None if docs is None else document_causal_mask(docs, causal=causal)  # [b, 1, s, s]
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in qkv), attn_mask=mask,
                                         is_causal=causal and mask is None,
                                         enable_gqa=True).transpose(1, 2)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in qkv]


def _gather_merge(t, group, cp):
    """Every ring rank's zigzag tensor, gathered over the ring and merged back to [b, s, ...]."""
    parts = [torch.empty_like(t) for _ in range(cp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return zigzag_merge(parts, cp)


def _check_case(rank, group, cp, h, g, causal, documents, seed, s=S):
    r = dist.get_rank(group)
    gen = torch.Generator().manual_seed(seed + 100 * h + 10 * g + causal)
    q, k, v, dout = (torch.randn(B, s, n, D, generator=gen) for n in (h, g, g, h))
    docs = None
    if documents == "hundreds":     # ~3-token documents, dozens in every rank's chunks
        docs = packed_document_ids("hundreds", gen, B, s)
    elif documents:
        docs = _documents(gen)
    want = _reference(q, k, v, dout, causal, docs)
    mine = [zigzag_split(t, cp, r).requires_grad_() for t in (q, k, v)]
    comm_stats.reset()
    out = ring_attention(*mine, group, causal=causal, document_ids=docs)   # the full rows' ids
    sent_forward = comm_stats.snapshot().get(COMM_KIND, 0)
    comm_stats.reset()
    out.backward(zigzag_split(dout, cp, r))
    sent_backward = comm_stats.snapshot().get(COMM_KIND, 0)
    kv_elems = mine[1].numel()                                  # k (or v) elements per rank
    # with or without documents only the kv blocks travel (the plan comes from the full rows)
    assert sent_forward == 2 * (cp - 1) * kv_elems * 4, (sent_forward, cp, kv_elems)
    assert sent_backward == 2 * (cp - 1) * kv_elems * 4 + cp * 2 * kv_elems * 4, sent_backward
    errors = {}
    got = [out.detach()] + [t.grad for t in mine]
    for name, tol, t, ref in zip(["out", "dq", "dk", "dv"], [FWD_TOL] + [GRAD_TOL] * 3, got, want):
        full = _gather_merge(t, group, cp)
        assert full.shape == ref.shape and not torch.isnan(full).any(), name
        errors[name] = (full - ref).abs().max().item()
        assert errors[name] <= tol, (f"cp={cp} h={h} g={g} causal={causal} {name}: "
                                     f"max error {errors[name]:.3g} > {tol}")
    return errors


def _ring_checks(rank, world, seed):
    torch.manual_seed(seed)
    rings = _rings(rank)
    results = {}
    for cp in (4, 2):
        for h, g, causal, documents in CASES:
            results[(cp, h, g, causal, documents)] = _check_case(rank, rings[cp], cp, h, g, causal,
                                                                 documents, seed)
        results[(cp, 4, 2, True, "hundreds")] = _check_case(rank, rings[cp], cp, 4, 2, True,
                                                            "hundreds", seed, s=S_LONG)
    return results


@pytest.mark.timeout(240)
def test_ring_attention_matches_full_attention(seed):
    results = run_distributed(_ring_checks, WORLD, seed)
    for rank_result in results:
        assert len(rank_result) == 2 * (len(CASES) + 1)
        for case, errors in rank_result.items():
            assert errors["out"] <= FWD_TOL and max(errors.values()) <= GRAD_TOL, (case, errors)
