"""Data parallelism equals one rank: dp=2 and dp=4 on gloo, several optimizer steps."""
from megatron_sp.testing import run_distributed

from layout_utils import check_layouts

GPT2 = dict(model="gpt2-tiny", overrides=dict(num_layers=2, hidden_size=64, num_attention_heads=4,
                                              vocab_size=300, max_position_embeddings=64))
LLAMA = dict(model="llama-tiny", overrides=dict(num_layers=2, hidden_size=64, num_attention_heads=4,
                                                num_query_groups=2, ffn_hidden_size=128,
                                                vocab_size=300))


def test_dp4_and_dp2_match_one_rank():
    cases = [dict(GPT2, name="gpt2 dp4 mbs1 (4 micro x 1)", seq=32, global_batch=8, micro_batch=1,
                  steps=3),
             dict(LLAMA, name="llama dp4 mbs2", seq=32, global_batch=8, micro_batch=2, steps=3)]
    for rank_results in run_distributed(check_layouts, 4, cases):
        assert [r[0] for r in rank_results] == [c["name"] for c in cases]


def test_dp2_gradient_accumulation():
    cases = [dict(LLAMA, name="llama dp2 4 micro-batches", seq=16, global_batch=8, micro_batch=1,
                  steps=3)]
    run_distributed(check_layouts, 2, cases)
