"""Ulysses pieces that need no process group: layout checks, kv head replication, sp = 1."""
import pytest
import torch

from megatron_sp import comm_stats
from megatron_sp.attention import SDPAAttention
from megatron_sp.ulysses import (UlyssesAttention, check_seq_divisible, check_ulysses_layout,
                                 expand_kv_heads, head_to_seq_all_to_all, seq_to_head_all_to_all)


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
