"""Tensor and Ulysses sequence parallelism of the whole model equal one rank (loss and gradients over
several optimizer steps; tolerances in layout_utils: loss 1e-5 relative, gradients 1e-4)."""
from megatron_sp.testing import run_distributed

from layout_utils import check_layouts

GPT2 = dict(model="gpt2-tiny", overrides=dict(num_layers=2, hidden_size=64, num_attention_heads=8,
                                              vocab_size=300, max_position_embeddings=64))
LLAMA = dict(model="llama-tiny", overrides=dict(num_layers=2, hidden_size=64, num_attention_heads=8,
                                                num_query_groups=4, ffn_hidden_size=128,
                                                vocab_size=300))
LLAMA_GQA2 = dict(model="llama-tiny", overrides=dict(num_layers=2, hidden_size=64,
                                                     num_attention_heads=8, num_query_groups=2,
                                                     ffn_hidden_size=128, vocab_size=300))


def _run(world, cases):
    results = run_distributed(check_layouts, world, cases)
    assert [r[0] for r in results[0]] == [c["name"] for c in cases]


def test_four_rank_layouts():
    common = dict(seq=32, global_batch=4, steps=3)
    _run(4, [
        dict(GPT2, name="gpt2 tp4", tp=4, micro_batch=4, **common),
        dict(GPT2, name="gpt2 tp4 sequence-parallel", tp=4, micro_batch=4, sequence_parallel=True,
             **common),
        dict(LLAMA, name="llama tp4 gqa swiglu rope", tp=4, micro_batch=2, **common),
        dict(LLAMA, name="llama tp2 x dp2 sequence-parallel", tp=2, micro_batch=1,
             sequence_parallel=True, **common),
        dict(GPT2, name="gpt2 sp4", sp=4, micro_batch=2, **common),
        dict(LLAMA_GQA2, name="llama sp4 (2 kv heads < sp, replicated)", sp=4, micro_batch=4, **common),
        dict(LLAMA, name="llama tp2 x sp2", tp=2, sp=2, micro_batch=2, **common),
        dict(LLAMA, name="llama tp2 x sp2 sequence-parallel", tp=2, sp=2, micro_batch=4,
             sequence_parallel=True, **common),
        dict(LLAMA, name="llama sp2 x dp2", sp=2, micro_batch=1, **common),
        dict(LLAMA, name="llama sp4 packed documents", sp=4, micro_batch=4, packed=True, **common),
    ])


def test_two_rank_layouts():
    common = dict(seq=16, global_batch=4, steps=3)
    _run(2, [
        dict(GPT2, name="gpt2 tp2", tp=2, micro_batch=2, **common),
        dict(LLAMA, name="llama tp2 sequence-parallel", tp=2, micro_batch=4, sequence_parallel=True,
             **common),
        dict(GPT2, name="gpt2 sp2", sp=2, micro_batch=4, **common),
        dict(LLAMA, name="llama sp2 packed", sp=2, micro_batch=2, packed=True, **common),
    ])
