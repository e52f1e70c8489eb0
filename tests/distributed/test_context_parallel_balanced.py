"""The document-aware balanced ring layout (context_parallel/balance.py, the default with packed
documents) in the whole model equals one rank: loss 1e-5 relative, gradients 1e-4 (FSDP2: losses
and gradient norms), 3 optimizer steps (layout_utils.check_layouts), on 4 gloo ranks in one
spawn: cp 4 and cp 2 x dp 2 p2p, a2a+p2p / sp 2 x cp 2, cp 2 x tp 2 --sequence-parallel, cp 2 x
pp 2, FSDP2, full and selective recompute, head chunks; mixes skewed (one long document among
short and one-token ones), short ones, one-token documents, one document the whole row, and
--context-parallel-layout zigzag on the same skewed rows. Outside the spawn: those rows really
are laid out differently from the zigzag (and the whole-row document identically)."""
import numpy as np
import pytest
import torch

from megatron_sp.attention.segments import document_bounds
from megatron_sp.context_parallel.balance import cp_layout
from megatron_sp.memory import MemoryOptions
from megatron_sp.testing import run_distributed

from layout_utils import check_layouts, global_batches
from test_model_parallel import LLAMA, LLAMA_GQA2

COMMON = dict(seq=32, global_batch=4, steps=3)
ZIGZAG = {"context_parallel_layout": "zigzag"}


def _cases():
    skewed = dict(COMMON, packed="skewed")
    return [
        dict(LLAMA, name="cp4 skewed", cp=4, micro_batch=4, **skewed),
        dict(LLAMA, name="cp4 skewed, --context-parallel-layout zigzag", cp=4, micro_batch=4,
             model_kwargs=ZIGZAG, **skewed),
        dict(LLAMA, name="cp2 x dp2 one-token documents", cp=2, micro_batch=2, packed="one-token",
             **COMMON),
        dict(LLAMA, name="cp2 x dp2 one document the whole row", cp=2, micro_batch=1,
             packed="whole", **COMMON),
        dict(LLAMA, name="a2a+p2p sp2 x cp2 skewed", sp=2, cp=2, micro_batch=2, **skewed),
        dict(LLAMA, name="cp2 x tp2 sequence-parallel skewed", cp=2, tp=2, micro_batch=2,
             sequence_parallel=True, **skewed),
        dict(LLAMA, name="cp2 x pp2 (1F1B) skewed", cp=2, pp=2, micro_batch=1, **skewed),
        dict(LLAMA, name="cp2 x dp2 FSDP2 skewed", cp=2, micro_batch=2, sharding="fsdp2",
             **skewed),
        dict(LLAMA, name="cp2 x dp2 full recompute, short documents", cp=2, micro_batch=2,
             packed="short", model_kwargs={"memory": MemoryOptions(recompute_granularity="full")},
             **COMMON),
        dict(LLAMA_GQA2, name="cp4 selective recompute + 2 head chunks, short documents", cp=4,
             micro_batch=2, packed="short",
             model_kwargs={"memory": MemoryOptions(recompute_granularity="selective",
                                                   ulysses_head_chunks=2)}, **COMMON),
    ]


def test_mixes_are_laid_out_differently_from_the_zigzag():
    """The skewed and short rows of the cases move tokens; the whole-row document does not."""
    for mix, cp, moved in (("skewed", 4, True), ("skewed", 2, True), ("short", 4, True),
                           ("whole", 2, False)):
        batches = global_batches(300, COMMON["seq"], COMMON["global_batch"], COMMON["steps"],
                                 seed=11, packed=mix)
        ids = batches[0]["document_ids"]
        bounds = document_bounds(ids)
        balanced = cp_layout("balanced", bounds, ids.shape[0], ids.shape[1], cp)
        zigzag = cp_layout("zigzag", bounds, ids.shape[0], ids.shape[1], cp)
        same = all(torch.equal(balanced.positions(r), zigzag.positions(r)) for r in range(cp))
        assert same != moved, mix
        if moved:
            assert balanced.balance() < zigzag.balance(), mix


@pytest.mark.timeout(600)
def test_balanced_layout_equals_one_rank():
    cases = _cases()
    results = run_distributed(check_layouts, 4, cases)
    assert [r[0] for r in results[0]] == [c["name"] for c in cases]
