"""FP8 linears (torchao, megatron_sp.tensor_parallel.fp8) in every layout against FP8 on one rank
(docs/design.md §17).

The one-rank reference trains the same model with the same FP8 recipe on the whole global batch as
one micro-batch; each layout has micro-batch x dp = the global batch, so the amaxes reduced over tp
and over dp x cp x sp give the reference's scales exactly: losses 1e-5 relative, full gradients
1e-4 (layout_utils), three optimizer steps, tp 2 with --sequence-parallel, sp 2, cp 2 (ring), pp 2,
dp 4, tp 2 x sp 2 (rowwise, e4m3; and under full recompute: the recomputed casts equal the first
ones), FSDP2 and the distributed optimizer (losses and gradient norms); rowwise also at cp 2 x dp 2
(its per-feature scales of the weight gradient reduced over the tokens' ranks).
The same tp 2 layout with each rank's own amax (reduce_amax=False) must NOT match: the reduction
is what makes the layouts equal.

Matmuls emulated in fp32 (torchao's emulate=True; the casts, scales and reductions are the same as
torch._scaled_mm's path, which tests/unit/test_fp8.py checks against emulation on one rank): this
CPU's torch._scaled_mm for e4m3 x e4m3 takes ~0.1 s per small matmul. One 4-rank spawn.
"""
from __future__ import annotations

import pytest

from megatron_sp.testing import run_distributed

pytest.importorskip("torchao.float8")

from megatron_sp.memory import MemoryOptions   # noqa: E402
from megatron_sp.tensor_parallel.fp8 import Fp8Recipe   # noqa: E402

from layout_utils import check_layouts   # noqa: E402

LLAMA = dict(model="llama-tiny", overrides=dict(num_layers=2, hidden_size=64, num_attention_heads=4,
                                               num_query_groups=2, ffn_hidden_size=128,
                                               vocab_size=256))
HYBRID = Fp8Recipe(format="hybrid", recipe="tensorwise", emulate=True)
COMMON = dict(LLAMA, seq=32, global_batch=4, steps=3, fp8=HYBRID)
CASES = [
    dict(COMMON, name="fp8 tp2 sequence-parallel (x dp2)", tp=2, micro_batch=2,
         sequence_parallel=True),
    dict(COMMON, name="fp8 sp2 (x dp2)", sp=2, micro_batch=2),
    dict(COMMON, name="fp8 cp2 (x dp2)", cp=2, micro_batch=2),
    dict(COMMON, name="fp8 pp2 (x dp2)", pp=2, micro_batch=2),
    dict(COMMON, name="fp8 dp4", micro_batch=1),
    dict(COMMON, name="fp8 rowwise e4m3 tp2 x sp2 sequence-parallel", tp=2, sp=2, micro_batch=4,
         sequence_parallel=True, fp8=Fp8Recipe(format="e4m3", recipe="rowwise", emulate=True)),
    dict(COMMON, name="fp8 rowwise cp2 (x dp2)", cp=2, micro_batch=2,
         fp8=Fp8Recipe(format="hybrid", recipe="rowwise", emulate=True)),
    dict(COMMON, name="fp8 tp2 x sp2 sequence-parallel, full recompute", tp=2, sp=2,
         micro_batch=4, sequence_parallel=True,
         model_kwargs={"memory": MemoryOptions(recompute_granularity="full")}),
    dict(COMMON, name="fp8 FSDP2 sp2 (x dp2)", sp=2, micro_batch=2, sharding="fsdp2"),
    dict(COMMON, name="fp8 distributed optimizer tp2 (x dp2)", tp=2, micro_batch=2,
         sharding="distopt"),
]
UNREDUCED = dict(COMMON, name="fp8 tp2 (x dp2), amax not reduced", tp=2, micro_batch=2,
                 reference_fp8=HYBRID, fp8=Fp8Recipe(emulate=True, reduce_amax=False))


def _rank_main(rank, world):
    results = check_layouts(rank, world, CASES)
    try:
        check_layouts(rank, world, [UNREDUCED])
        unreduced = "matched one rank"
    except AssertionError as err:
        unreduced = str(err).split("\n")[0]
    return results, unreduced


def test_fp8_layouts_equal_one_rank_fp8():
    out = run_distributed(_rank_main, 4, timeout_s=600)
    for results, unreduced in out:
        assert [r[0] for r in results] == [c["name"] for c in CASES]
        assert unreduced.startswith("fp8 tp2 (x dp2), amax not reduced: step"), unreduced
    for name, loss_rel, grad_diff in out[0][0]:
        print(f"{name}: loss rel {loss_rel:.1e}, gradient {grad_diff:.1e}")
