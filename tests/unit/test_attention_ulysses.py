"""Ulysses pieces that need no process group: layout checks, kv head replication, sp = 1, head
chunks (their refusal, the chunks' weights, sp = 1 against the plain block, the flag)."""
import pytest
import torch

from megatron_sp import comm_stats
from megatron_sp.attention import SDPAAttention
from megatron_sp.mesh import LayoutError
from megatron_sp.ulysses import (UlyssesAttention, check_head_chunks, check_ulysses_layout,
                                 expand_kv_heads, head_chunk_problem, head_to_seq_all_to_all,
                                 seq_to_head_all_to_all)
from library_helpers import check_seq_divisible


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
    # 12 query and 6 key/value heads over sp = 2: 2 chunks hold 3 groups each, which 2 sp ranks
    # cannot split; 4 neither divides the 6 groups nor is a multiple of them.
    with pytest.raises(LayoutError) as err:
        check_head_chunks(12, 6, 2, 2)
    assert str(err.value) == (
        "--ulysses-head-chunks 2 does not fit 12 query and 6 key/value heads per tp rank over "
        "sp = 2: a chunk holds whole key/value groups with all their query heads or an equal "
        "share of one group's query heads, and its heads must split over the 2 sp ranks as "
        "Ulysses' do; use one of 1, 3, 6.")
    assert "use one of 1, 2, 4." in head_chunk_problem(8, 8, 2, 8)


def _tiny(**kw):
    from megatron_sp.models import preset
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                ffn_hidden_size=128, vocab_size=100, max_position_embeddings=64)
    return preset("llama-tiny", **{**base, **kw})


def test_head_chunk_weights_cover_the_block_once():
    """The chunks' QKV rows are the fused weight's rows, each once, grouped as the layout is (whole
    groups: views; a share of a group's query heads: its q rows, then its k and v rows), and their
    out-proj columns are the output weight's, each once, in head order."""
    from megatron_sp.models import GPTModel
    from megatron_sp.memory import MemoryOptions
    for groups, n in ((2, 2), (2, 4), (2, 8), (8, 4), (1, 8)):
        model = GPTModel(_tiny(num_query_groups=groups, add_qkv_bias=True),
                         memory=MemoryOptions(ulysses_head_chunks=n))
        attn = model.layers["0"].attention
        with torch.no_grad():
            attn.qkv.weight.copy_(torch.arange(attn.qkv.weight.numel()).view_as(attn.qkv.weight))
            attn.qkv.bias.copy_(torch.arange(attn.qkv.bias.numel()))
        per, d = 8 // groups, 8
        rows = attn.qkv.weight[:, 0].long() // 64        # weight[i, 0] = 64 i: its row index
        seen_rows, seen_cols = [], []
        for c in range(n):
            w, b, w_out, g_c, per_c = attn.head_chunk_weights(c)
            assert w.shape == ((per_c + 2) * g_c * d, 64) and b.shape == (w.shape[0],)
            assert g_c * per_c == 8 // n
            assert torch.equal(w[:, 0].long() // 64, b.long())        # bias rows follow
            seen_rows += (w[:, 0].long() // 64).tolist()
            if groups % n == 0:
                assert w.data_ptr() == attn.qkv.weight[len(seen_rows) - w.shape[0]:].data_ptr()
            # its rows: per group, its query heads' d rows, then that group's k and v
            grouped = (w[:, 0].long() // 64).view(g_c, per_c + 2, d)
            group = grouped[:, 0, 0] // ((per + 2) * d)
            assert torch.equal(grouped[:, -2, 0], group * (per + 2) * d + per * d)   # its k
            cols = (w_out.data_ptr() - attn.proj.weight.data_ptr()) // 4
            seen_cols += list(range(cols, cols + w_out.shape[1]))
        assert sorted(set(seen_rows)) == rows.tolist()                 # every row, k, v repeated
        assert len(seen_rows) == rows.numel() + (0 if groups % n == 0 else
                                                 2 * d * (n - groups))
        assert seen_cols == list(range(64))                             # each column once, in order


@pytest.mark.parametrize("kw", [dict(), dict(num_query_groups=8, add_qkv_bias=True),
                                dict(num_query_groups=1, qk_layernorm=True)],
                         ids=["gqa", "mha-bias", "mqa-qknorm"])
@pytest.mark.parametrize("recompute", [None, "full"])
def test_head_chunks_on_one_rank_equal_the_plain_block(kw, recompute):
    """sp = 1: the model with head chunks N (whole groups, and a share of one group's query heads)
    gives the plain model's loss and gradients (fp32: loss 1e-6 relative, gradients 1e-5 of their
    largest entry), packed documents included, and communicates nothing."""
    from megatron_sp.models import GPTModel
    from megatron_sp.models.init import init_parameters
    from megatron_sp.memory import MemoryOptions
    gen = torch.Generator().manual_seed(torch.initial_seed() % 2**31)
    ids = torch.randint(0, 100, (2, 48), generator=gen)
    docs = (torch.rand(2, 48, generator=gen) < 0.1).long().cumsum(1)
    cfg = _tiny(**kw)
    results = {}
    for n in (1, 2, 8 if cfg.num_query_groups <= 2 or cfg.num_query_groups == 8 else 4):
        model = GPTModel(cfg, memory=MemoryOptions(ulysses_head_chunks=n,
                                                   recompute_granularity=recompute))
        init_parameters(model, seed=7)       # the same weights
        comm_stats.reset()
        loss = model(input_ids=ids, labels=ids, document_ids=docs).float().mean()
        loss.backward()
        assert comm_stats.snapshot() == {}
        results[n] = loss.item(), {k: p.grad for k, p in model.named_parameters()}
    loss1, grads1 = results.pop(1)
    for n, (loss, grads) in results.items():
        assert abs(loss - loss1) <= 1e-6 * abs(loss1), (n, loss, loss1)
        for name, g in grads.items():
            torch.testing.assert_close(g, grads1[name], rtol=0,
                                       atol=1e-5 * grads1[name].abs().max().item(),
                                       msg=f"{name} n={n} {kw}")


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
    assert model.layers["0"].attention.head_chunks == 4
    with pytest.raises(LayoutError, match=r"--ulysses-head-chunks 3 does not fit 8 query and 2 "
                                          r"key/value heads per tp rank over sp = 1.*use one of "
                                          r"1, 2, 4, 8\."):
        GPTModel(cfg, memory=MemoryOptions(ulysses_head_chunks=3))
