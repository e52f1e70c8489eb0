"""Ulysses pieces that need no process group: layout checks, kv head replication, sp = 1, head
chunks (their refusal, their head order, sp = 1, the flag)."""
import pytest
import torch

from megatron_sp import comm_stats
from megatron_sp.attention import SDPAAttention
from megatron_sp.mesh import LayoutError
from megatron_sp.ulysses import (UlyssesAttention, check_head_chunks, check_seq_divisible,
                                 check_ulysses_layout, expand_kv_heads, head_chunk_index,
                                 head_chunk_problem, head_to_seq_all_to_all,
                                 seq_to_head_all_to_all)


@pytest.mark.parametrize("h,g,tp,sp", [
    (8, 8, 1, 8), (8, 2, 1, 4), (8, 1, 1, 8), (32, 8, 2, 4), (32, 8, 4, 2), (32, 8, 8, 4),
    (16, 4, 2, 2), (16, 4, 1, 2), (12, 6, 1, 3), (12, 6, 1, 6),
])
def test_layout_accepted(h, g, tp, sp):
    check_ulysses_layout(h, g, tp, sp)


@pytest.mark.parametrize("h,g,tp,sp,message", [
    (12, 12, 1, 8, r"12 attention heads are not divisible by tp\*sp = 1\*8 = 8"),
    (32, 8, 4, 16, r"32 attention heads are not divisible by tp\*sp = 4\*16 = 64"),
    (12, 6, 1, 4, r"6 key/value heads over tp = 1 leave 6 per tp rank, which sp = 4 can neither split"),
    (48, 12, 2, 4, r"leave 6 per tp rank, which sp = 4 can neither split \(6 % 4 != 0\) nor "
                   r"replicate \(4 % 6 != 0\)"),
    (16, 6, 1, 2, r"16 attention heads are not a multiple of 6 key/value heads"),
    (16, 2, 4, 2, r"2 key/value heads are not divisible by tp = 4"),
])
def test_layout_refused(h, g, tp, sp, message):
    with pytest.raises(ValueError, match=message):
        check_ulysses_layout(h, g, tp, sp)


def test_seq_divisible():
    check_seq_divisible(4096, 8)
    check_seq_divisible(4096, 8, tp=4, sequence_parallel=True)
    check_seq_divisible(24, 8, tp=3)  # tp does not shard the sequence without --sequence-parallel
    with pytest.raises(ValueError, match=r"sequence length 100 is not divisible by sp = 8"):
        check_seq_divisible(100, 8)
    with pytest.raises(ValueError, match=r"sequence length 40 is not divisible by sp\*tp = 8\*3 = 24"):
        check_seq_divisible(40, 8, tp=3, sequence_parallel=True)


def test_expand_kv_heads_maps_rank_to_its_group():
    g_local, sp, h_local = 2, 8, 16
    kv = torch.arange(g_local).view(1, 1, g_local, 1).float()  # head j holds the value j
    expanded = expand_kv_heads(kv, sp)                         # [1, 1, sp, 1]
    for r in range(sp):  # rank r receives expanded head r: it must serve q heads of rank r
        q_heads = range(r * h_local // sp, (r + 1) * h_local // sp)
        groups = {i * g_local // h_local for i in q_heads}
        assert groups == {int(expanded[0, 0, r, 0])} == {r * g_local // sp}
    assert expand_kv_heads(torch.zeros(1, 1, 8, 1), 4).shape[2] == 8  # divisible: unchanged


def test_single_rank_is_identity():
    comm_stats.reset()
    x = torch.randn(2, 8, 4, 3)
    assert seq_to_head_all_to_all(x, None) is x and head_to_seq_all_to_all(x, None) is x
    local = SDPAAttention()
    ulysses = UlyssesAttention(local, None)
    q, k = torch.randn(2, 8, 4, 3), torch.randn(2, 8, 2, 3)
    docs = torch.tensor([[0] * 3 + [1] * 5] * 2)
    torch.testing.assert_close(ulysses(q, k, k, document_ids=docs, softmax_scale=0.5),
                               local(q, k, k, document_ids=docs, softmax_scale=0.5), atol=0, rtol=0)
    assert comm_stats.snapshot() == {}


# Head chunks (--ulysses-head-chunks; issue 36) ---------------------------------------------------

@pytest.mark.parametrize("h,g,sp,chunks", [
    (8, 8, 2, 4), (8, 4, 2, 2), (8, 4, 2, 4), (8, 2, 4, 2), (8, 1, 2, 4), (32, 8, 8, 4),
    (4, 1, 4, 1), (8, 2, 1, 8),
])
def test_head_chunks_accepted(h, g, sp, chunks):
    check_head_chunks(h, g, sp, chunks)


def test_head_chunks_refused_in_one_sentence():
    # 12 query and 6 key/value heads over sp = 2: 6 and 3 per rank; 2 chunks would split 3
    # key/value heads unevenly, 4 does not divide the 6 query heads.
    with pytest.raises(LayoutError) as err:
        check_head_chunks(12, 6, 2, 2)
    assert str(err.value) == (
        "--ulysses-head-chunks 2 does not fit 12 query and 6 key/value heads per tp rank over "
        "sp = 2: each sp rank holds 6 query and 3 key/value heads, and a chunk must hold whole "
        "key/value heads with all their query heads or an equal share of one key/value head's "
        "query heads; use one of 1, 3, 6.")
    assert "use one of 1, 2, 4." in head_chunk_problem(8, 8, 2, 8)
    with pytest.raises(LayoutError, match="head_chunks must be an integer >= 1, got 0"):
        UlyssesAttention(SDPAAttention(), None, head_chunks=0)


def test_head_chunk_index_is_ulysses_over_sp_times_chunks():
    """Chunk c sends sp rank r the heads plain Ulysses over sp*N ranks gives rank r*N + c; with
    fewer key/value heads, the replica expand_kv_heads would give that rank."""
    sp, n, h = 2, 4, 16
    for c in range(n):
        got = head_chunk_index(h, sp, n, c).view(sp, -1)            # [sp, h/(sp N)]
        for r in range(sp):
            m = r * n + c
            assert got[r].tolist() == list(range(m * h // (sp * n), (m + 1) * h // (sp * n)))
    for g in (1, 2, 4):                                             # kv heads <= sp*N: replicas
        kv = torch.arange(g).view(1, 1, g, 1).float()
        expanded = expand_kv_heads(kv, sp * n)[0, 0, :, 0]          # [sp*N]
        for c in range(n):
            got = head_chunk_index(g, sp, n, c)
            assert got.tolist() == [int(expanded[r * n + c]) for r in range(sp)]


def test_head_chunks_on_one_rank_equal_plain():
    """sp = 1 (the chunks run the local attention over head groups in turn): forward and
    backward equal the plain call, MHA and GQA, with documents, and nothing is communicated."""
    gen = torch.Generator().manual_seed(3)
    docs = torch.tensor([[0] * 5 + [1] * 11] * 2)
    for h, g, n in ((8, 8, 4), (8, 2, 2), (8, 2, 8)):
        q, dout = torch.randn(2, 16, h, 8, generator=gen), torch.randn(2, 16, h, 8, generator=gen)
        k, v = torch.randn(2, 16, g, 8, generator=gen), torch.randn(2, 16, g, 8, generator=gen)
        results = []
        for chunks in (1, n):
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            comm_stats.reset()
            out = UlyssesAttention(SDPAAttention(), None, head_chunks=chunks)(
                *x, document_ids=docs)
            out.backward(dout)
            assert comm_stats.snapshot() == {}
            results.append([out.detach()] + [t.grad for t in x])
        for name, a, b, tol in zip(("out", "dq", "dk", "dv"), *results, (1e-6, 1e-5, 1e-5, 1e-5)):
            torch.testing.assert_close(a, b, atol=tol, rtol=0, msg=f"{name} h={h} g={g} n={n}")


def test_head_chunks_flag_config_and_model():
    from megatron_sp.cli.build import parse_job
    from megatron_sp.errors import ConfigError
    from megatron_sp.memory import MemoryOptions
    from megatron_sp.models import GPTModel, preset
    job = parse_job(["--seq-length", "16", "--ulysses-head-chunks", "4"])
    assert job.memory.ulysses_head_chunks == 4
    assert MemoryOptions.from_config(job.memory).ulysses_head_chunks == 4
    assert parse_job(["--seq-length", "16"]).memory.ulysses_head_chunks == 1
    with pytest.raises(ConfigError, match=r"--ulysses-head-chunks must be an integer >= 1, got 0"):
        parse_job(["--seq-length", "16", "--ulysses-head-chunks", "0"])
    cfg = preset("llama-tiny", num_layers=1, hidden_size=64, num_attention_heads=8,
                 num_query_groups=2, ffn_hidden_size=128, vocab_size=100)
    model = GPTModel(cfg, memory=MemoryOptions(ulysses_head_chunks=4))
    assert model.layers["0"].attention.core.head_chunks == 4
    with pytest.raises(LayoutError, match=r"--ulysses-head-chunks 3 does not fit 8 query and 2 "
                                          r"key/value heads per tp rank over sp = 1.*use one of "
                                          r"1, 2, 4, 8\."):
        GPTModel(cfg, memory=MemoryOptions(ulysses_head_chunks=3))
