"""Ulysses on 8 gloo ranks, one spawn: sp groups of 2, 4 and 8 built inside it.

Every rank draws the same full-sequence inputs (same seed), takes its contiguous chunk, and
compares Ulysses against local attention (SDPA) on the full sequence, sliced to its chunk; every
chunk of every rank is checked this way. fp32 tolerances: forward 1e-5, gradients 1e-4; the
all-to-all pair and byte counters are checked exactly.
"""
import torch
import torch.distributed as dist

from megatron_sp import comm_stats
from megatron_sp.attention import SDPAAttention
from megatron_sp.mesh import ParallelMesh
from megatron_sp.testing import run_distributed
from megatron_sp.ulysses import (COMM_KIND, UlyssesAttention, head_to_seq_all_to_all,
                                 head_to_seq_qkv_all_to_all, seq_to_head_all_to_all,
                                 seq_to_head_qkv_all_to_all)

WORLD = 8
FWD_TOL, GRAD_TOL = 1e-5, 1e-4
B, S, D = 2, 32, 8


def _contiguous_sp_groups(rank, world, sizes=(2, 4, 8)):
    """{sp: this rank's group} with groups of consecutive ranks; new_group is called by all ranks."""
    mine = {}
    for sp in sizes:
        for start in range(0, world, sp):
            group = dist.new_group(list(range(start, start + sp)))
            if start <= rank < start + sp:
                mine[sp] = group
    return mine


def _documents(seed):
    """[B, S] ids whose documents cross the chunk boundaries of every sp in (2, 4, 8)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.rand(B, S, generator=gen) < 0.12
    starts[:, 0] = False
    starts[0, [3, 13, 22]] = True  # row 0: documents [0,3) [3,13) [13,22) [22,32)
    return starts.long().cumsum(1)


def _check_all_to_all(group, sp, sp_rank, seed):
    """seq->head returns the full sequence of this rank's heads, head->seq inverts it exactly, and
    the gradient through seq->head lands on the right sequence chunk; bytes as the formula."""
    n, s_local = 8, S // sp
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(B, S, n, D, generator=gen)            # [b, s, n, d], same on every rank
    grad_full = torch.randn(B, S, n, D, generator=gen)
    chunk = slice(sp_rank * s_local, (sp_rank + 1) * s_local)
    heads = slice(sp_rank * n // sp, (sp_rank + 1) * n // sp)
    x = full[:, chunk].clone().requires_grad_(True)         # [b, s/sp, n, d]

    comm_stats.reset()
    y = seq_to_head_all_to_all(x, group)                     # [b, s, n/sp, d]
    assert y.shape == (B, S, n // sp, D)
    assert torch.equal(y, full[:, :, heads])
    assert torch.equal(head_to_seq_all_to_all(y, group), x)
    sent = (sp - 1) * x.numel() * x.element_size() // sp
    assert comm_stats.snapshot() == {COMM_KIND: 2 * sent} and comm_stats.calls() == {COMM_KIND: 2}
    y.backward(grad_full[:, :, heads])                       # loss = sum over ranks of <y_r, G_r>
    assert torch.equal(x.grad, grad_full[:, chunk])
    assert comm_stats.snapshot() == {COMM_KIND: 3 * sent}


def _check_packed_all_to_all(group, sp, sp_rank, n_q, n_kv, seed):
    """One all-to-all of q, k, v packed equals three separate ones, bit for bit; head->seq of the
    packed pair is its exact inverse; gradients come back through ONE all-to-all; bytes unchanged."""
    s_local = S // sp
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(B, S, n, D, generator=gen) for n in (n_q, n_kv, n_kv)]   # [b, s, n_i, d]
    grads = [torch.randn(B, S, n // sp, D, generator=gen) for n in (n_q, n_kv, n_kv)]
    chunk = slice(sp_rank * s_local, (sp_rank + 1) * s_local)
    mine = [t[:, chunk].clone().requires_grad_(True) for t in full]             # [b, s/sp, n_i, d]

    comm_stats.reset()
    packed = seq_to_head_qkv_all_to_all(*mine, group)                          # [b, s, n_i/sp, d]
    assert comm_stats.calls() == {COMM_KIND: 1}
    sent = sum((sp - 1) * t.numel() * t.element_size() // sp for t in mine)
    assert comm_stats.snapshot() == {COMM_KIND: sent}
    for t, n, y in zip(full, (n_q, n_kv, n_kv), packed):
        heads = slice(sp_rank * n // sp, (sp_rank + 1) * n // sp)
        assert torch.equal(y, t[:, :, heads])
        assert torch.equal(y, seq_to_head_all_to_all(t[:, chunk], group))
    back = head_to_seq_qkv_all_to_all(*packed, group)
    assert all(torch.equal(b_, m) for b_, m in zip(back, mine))
    comm_stats.reset()
    torch.autograd.backward(packed, grads)
    assert comm_stats.calls() == {COMM_KIND: 1}                                # one a2a backward
    for t, g in zip(mine, grads):                                              # = head->seq of G
        assert torch.equal(t.grad, head_to_seq_all_to_all(g, group))


def _check_attention(group, sp, sp_rank, h, g, packed, seed, softmax_scale=None):
    """UlyssesAttention over SDPA equals SDPA on the full sequence, forward and backward."""
    s_local = S // sp
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, n, D, generator=gen) for n in (h, g, g))
    grad = torch.randn(B, S, h, D, generator=gen)
    docs = _documents(seed) if packed else None
    local = SDPAAttention()

    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = local(*full, document_ids=docs, softmax_scale=softmax_scale)
    ref.backward(grad)

    chunk = slice(sp_rank * s_local, (sp_rank + 1) * s_local)
    mine = [t[:, chunk].clone().requires_grad_(True) for t in (q, k, v)]
    comm_stats.reset()
    out = UlyssesAttention(local, group)(*mine, document_ids=docs, softmax_scale=softmax_scale)
    kv_heads = max(g, sp)  # replicated up to sp when sp % g == 0
    elems = B * s_local * D * (h + 2 * kv_heads + h)         # q, k, v, out
    assert comm_stats.snapshot() == {COMM_KIND: (sp - 1) * elems * 4 // sp}
    assert comm_stats.calls() == {COMM_KIND: 2}                # qkv packed, out
    out.backward(grad[:, chunk])
    assert comm_stats.snapshot() == {COMM_KIND: 2 * (sp - 1) * elems * 4 // sp}
    assert comm_stats.calls() == {COMM_KIND: 4}                # and two in backward

    case = f"sp={sp} rank={sp_rank} h={h} g={g} packed={packed}"
    torch.testing.assert_close(out, ref[:, chunk], atol=FWD_TOL, rtol=0, msg=case)
    for name, mine_t, full_t in zip("qkv", mine, full):
        torch.testing.assert_close(mine_t.grad, full_t.grad[:, chunk], atol=GRAD_TOL, rtol=0,
                                   msg=f"grad {name}, {case}")


CASES = [  # (h, g, packed): MHA, GQA split or replicated, MQA; packed documents
    (8, 8, False), (8, 2, False), (8, 2, True), (8, 1, True), (8, 4, True),
]


def _ulysses_checks(rank, world):
    groups = _contiguous_sp_groups(rank, world)
    for sp, group in groups.items():
        sp_rank = rank % sp
        assert dist.get_rank(group) == sp_rank
        _check_all_to_all(group, sp, sp_rank, seed=sp)
        _check_packed_all_to_all(group, sp, sp_rank, n_q=8, n_kv=max(2, sp), seed=50 + sp)
        for i, (h, g, packed) in enumerate(CASES):
            _check_attention(group, sp, sp_rank, h, g, packed, seed=100 * sp + i)
    _check_attention(groups[4], 4, rank % 4, 8, 2, True, seed=7, softmax_scale=0.21)

    # Refused layout (6 kv heads, sp = 4): every rank raises before any communication.
    try:
        q, kv = torch.zeros(1, 8, 12, 4), torch.zeros(1, 8, 6, 4)
        UlyssesAttention(SDPAAttention(), groups[4])(q, kv, kv)
        raise AssertionError("a 6-kv-head layout over sp=4 was not refused")
    except ValueError as err:
        assert "6 per tp rank, which sp = 4 can neither split" in str(err)

    # The mesh's sp group (tp=2 x sp=4: ranks {t, t+2, t+4, t+6}, not consecutive).
    mesh = ParallelMesh.from_sizes(tp=2, sp=4)
    assert mesh.sp_size == 4 and dist.get_rank(mesh.sp_group) == mesh.sp_rank
    _check_attention(mesh.sp_group, 4, mesh.sp_rank, 8, 2, True, seed=11 + mesh.tp_rank)
    return True


def test_ulysses_on_eight_ranks():
    assert run_distributed(_ulysses_checks, WORLD) == [True] * WORLD
