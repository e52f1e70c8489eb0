"""Context parallelism past the head count (ring attention, and Ulysses x ring) of the whole model
equals one rank: loss and gradients over several optimizer steps (tolerances in layout_utils: loss
1e-5 relative, gradients 1e-4). The sequence is cut into 2*cp zigzag chunks over the ring; RoPE
positions, labels, the loss mask and packed documents follow that layout (docs/design.md §14)."""
import pytest

from megatron_sp.memory import MemoryOptions
from megatron_sp.testing import run_distributed

from layout_utils import check_layouts
from test_model_parallel import LLAMA, LLAMA_GQA2   # the same small models as tp and Ulysses

GPT2 = dict(model="gpt2-tiny", overrides=dict(num_layers=2, hidden_size=64, num_attention_heads=4,
                                              vocab_size=300, max_position_embeddings=64))


def _run(world, cases):
    results = run_distributed(check_layouts, world, cases)
    assert [r[0] for r in results[0]] == [c["name"] for c in cases]


@pytest.mark.timeout(400)
def test_four_rank_context_parallel_layouts():
    common = dict(seq=32, global_batch=4, steps=3)
    _run(4, [
        dict(LLAMA, name="llama ring cp4", cp=4, micro_batch=4, **common),
        dict(LLAMA_GQA2, name="llama ring cp4 (2 kv heads < ring degree)", cp=4, micro_batch=4,
             **common),
        dict(LLAMA, name="llama a2a+p2p sp2 x cp2", sp=2, cp=2, micro_batch=4, **common),
        dict(LLAMA, name="llama ring cp2 x dp2", cp=2, micro_batch=1, **common),
        dict(LLAMA, name="llama ring cp2 x tp2 sequence-parallel", cp=2, tp=2, micro_batch=2,
             sequence_parallel=True, **common),
        dict(LLAMA, name="llama ring cp2 x pp2 (1F1B)", cp=2, pp=2, micro_batch=1, **common),
        dict(LLAMA, name="llama sp2 x cp2 packed documents", sp=2, cp=2, micro_batch=2,
             packed=True, **common),
        dict(GPT2, name="gpt2 ring cp4 learned positions", cp=4, micro_batch=2, **common),
        dict(LLAMA, name="llama ring cp2 x dp2 full recompute", cp=2, micro_batch=2,
             model_kwargs={"memory": MemoryOptions(recompute_granularity="full")}, **common),
        dict(LLAMA_GQA2, name="llama ring cp4 packed documents, selective recompute (the ring "
             "recomputed)", cp=4, micro_batch=2, packed=True,
             model_kwargs={"memory": MemoryOptions(recompute_granularity="selective")}, **common),
    ])


@pytest.mark.timeout(400)
def test_eight_rank_tp2_x_sp2_x_cp2():
    _run(8, [dict(LLAMA, name="llama tp2 x (sp2 x cp2) sequence-parallel", tp=2, sp=2, cp=2,
                  micro_batch=2, sequence_parallel=True, seq=32, global_batch=2, steps=3)])
