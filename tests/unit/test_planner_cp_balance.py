"""The planner's step time at the ring's slowest rank (megatron_sp/memory/planner/cp_balance.py):
the attention part of the compute time x cp_work_balance, exactly; the figure estimated from a
document-length distribution under either ring layout (context_parallel.balance.estimate_balance);
no documents or no stated lengths: balanced; bad values refused in one sentence; the tool's flags.
Pure computation (no model is built)."""
import json
import shlex

import numpy as np
import pytest

from megatron_sp.cli.arguments import build_parser
from megatron_sp.context_parallel.balance import estimate_balance
from megatron_sp.memory.planner import Hardware, Workload, plan
from megatron_sp.memory.planner.cp_balance import (PLANNED_ROWS, attention_flops,
                                                   lognormal_lengths)
from megatron_sp.models import preset
from megatron_sp.testing import load_script
from megatron_sp.training.flops import flops_for_config

plan_parallel = load_script("tools/plan_parallel.py")

SEQ, GPUS, BATCH = 16384, 4, 8
HW = Hardware(GPUS)
REL = 1e-12          # the same float arithmetic in another order


def _cfg():
    return preset("llama-8b", max_position_embeddings=SEQ)


def _key(p):
    return (p.tp, p.sp, p.cp, p.pp, p.dp, p.sharding, p.cpu_offload, p.ep, repr(p.memory))


def _pairs(first, second):
    """Plans of the same layout, sharding and memory settings in both lists (their compute
    differs by the attention term alone), with at least one ring among them."""
    by_key = {_key(p): p for p in first}
    pairs = [(by_key[_key(q)], q) for q in second if _key(q) in by_key]
    assert any(p.cp > 1 for p, _ in pairs), "no ring layout in both plan lists"
    return pairs


def _skewed_row(rng) -> list[int]:
    """One row of SEQ tokens: a document of 60% of the row, then short lognormal ones."""
    long_doc = int(0.6 * SEQ)
    row, left = [long_doc], SEQ - long_doc
    while left:
        m = min(left, max(1, int(rng.lognormal(np.log(200), 1.0))))
        row.append(m)
        left -= m
    return row


def _bubble(p) -> float:
    return (p.pp - 1) / max(1, BATCH // (p.micro_batch * p.dp)) if p.pp > 1 else 0.0


def test_attention_flops_are_the_quadratic_term_of_megatrons_formula():
    """12 B s^2 L a d, and what is left of the model FLOPs is linear in s."""
    cfg = _cfg()
    a = attention_flops(cfg, BATCH, SEQ)
    assert a == 12 * BATCH * SEQ ** 2 * cfg.num_layers * cfg.num_attention_heads * cfg.kv_channels
    rest = lambda s: flops_for_config(cfg, BATCH, s) - attention_flops(cfg, BATCH, s)  # noqa: E731
    assert rest(2 * SEQ) == pytest.approx(2 * rest(SEQ), rel=REL)
    assert 0 < a < flops_for_config(cfg, BATCH, SEQ)


def test_step_time_attention_part_scales_with_the_slowest_rank():
    """cp_work_balance X: a ring plan's compute_s = the balanced plan's + attention FLOPs / (GPUs
    x peak x mfu) x (X - 1) x technique cost x (1 + bubble), exactly; communication unchanged;
    plans without a ring unchanged (X applies to rings only)."""
    cfg, x = _cfg(), 1.75
    base = plan(cfg, Workload(SEQ, global_batch=BATCH, documents=True), HW, ring=True)
    slow = plan(cfg, Workload(SEQ, global_batch=BATCH, documents=True, cp_work_balance=x), HW,
                ring=True)
    attention_s = attention_flops(cfg, BATCH, SEQ) / (GPUS * HW.peak_tflops * 1e12 * HW.mfu)
    for p, q in _pairs(base, slow):
        assert p.cp_work_balance == 1.0 and q.comm_s == p.comm_s
        if p.cp == 1:
            assert q.cp_work_balance == 1.0 and q.compute_s == p.compute_s
            continue
        assert q.cp_work_balance == x
        extra = attention_s * (x - 1) * p.cost * (1 + _bubble(p))
        assert q.compute_s == pytest.approx(p.compute_s + extra, rel=REL)
        assert q.step_s == pytest.approx(p.step_s + extra, rel=REL)
        assert q.mfu < p.mfu


def test_zigzag_plan_on_a_skewed_mix_is_slower_than_the_balanced(seed):
    """A row of one long document among short ones, as the corpus (PLANNED_ROWS copies): each
    ring plan's figure is that row's under its layout (estimate_balance), the zigzag's above
    1.2 and the balanced's within 1.05 at cp 2 and 4, so every zigzag ring plan is slower than
    the same balanced one, and the best zigzag plan no faster than the best balanced one."""
    cfg, row = _cfg(), _skewed_row(np.random.default_rng(seed))
    lengths = row * PLANNED_ROWS
    plans = {kind: plan(cfg, Workload(SEQ, global_batch=BATCH, documents=True,
                                      context_parallel_layout=kind, document_lengths=lengths),
                        HW, ring=True)
             for kind in ("balanced", "zigzag")}
    seen = set()
    for b, z in _pairs(plans["balanced"], plans["zigzag"]):
        if b.cp == 1:
            assert b.cp_work_balance == z.cp_work_balance == 1.0 and b.step_s == z.step_s
            continue
        seen.add(b.cp)
        assert b.cp_work_balance == pytest.approx(
            estimate_balance(row, SEQ, b.cp, "balanced")["mean"], rel=REL)
        assert b.cp_work_balance <= 1.05
        assert z.cp_work_balance == pytest.approx(
            estimate_balance(row, SEQ, b.cp, "zigzag")["mean"], rel=REL)
        assert z.cp_work_balance > 1.2
        assert z.compute_s > b.compute_s and z.step_s > b.step_s
        assert "--context-parallel-layout zigzag" in z.flags()
        assert "--context-parallel-layout" not in b.flags()
    assert seen == {2, 4}
    assert plans["zigzag"][0].step_s >= plans["balanced"][0].step_s


def test_without_documents_or_their_lengths_both_layouts_plan_alike():
    """No documents (the whole-row zigzag balances a causal row): the layouts' plans are the
    same, figure 1, no layout flag. Documents whose lengths are not stated: assumed balanced,
    both layouts the same times. One document the length of the row: exactly 1 under both."""
    cfg = _cfg()
    for documents, lengths in ((False, None), (True, None), (True, (SEQ,))):
        made = [plan(cfg, Workload(SEQ, global_batch=BATCH, documents=documents,
                                   context_parallel_layout=kind, document_lengths=lengths),
                     HW, ring=True) for kind in ("balanced", "zigzag")]
        pairs = _pairs(*made)
        assert len(pairs) == len(made[0]) == len(made[1])
        for b, z in pairs:
            assert b.cp_work_balance == z.cp_work_balance == 1.0
            assert (b.compute_s, b.comm_s, b.step_s) == (z.compute_s, z.comm_s, z.step_s)
            if not documents:
                assert b.flags() == z.flags() and "--context-parallel-layout" not in z.flags()


@pytest.mark.parametrize("fields, match", [
    (dict(context_parallel_layout="ring"), "is not one of"),
    (dict(cp_work_balance=0.9), "a finite number >= 1"),
    (dict(cp_work_balance=float("nan")), "a finite number >= 1"),
    (dict(cp_work_balance=float("inf")), "a finite number >= 1"),
    (dict(cp_work_balance=True), "a finite number >= 1"),
    (dict(document_lengths=()), "non-empty sequence of positive integer"),
    (dict(document_lengths=(100, 0)), "non-empty sequence of positive integer"),
    (dict(document_lengths=(100, 2.5)), "non-empty sequence of positive integer"),
    (dict(document_lengths=(100,), cp_work_balance=1.2), "not both"),
    (dict(documents=False, cp_work_balance=1.2), "set documents"),
    (dict(documents=False, document_lengths=(100,)), "set documents"),
])
def test_bad_workload_values_are_refused_in_one_sentence(fields, match):
    with pytest.raises(ValueError, match=match) as err:
        Workload(SEQ, **{"documents": True, **fields})
    assert "\n" not in str(err.value)


def test_lognormal_lengths_are_seeded_positive_integers():
    a, b = lognormal_lengths(1024, 1.5, 500, seed=3), lognormal_lengths(1024, 1.5, 500, seed=3)
    assert a == b != lognormal_lengths(1024, 1.5, 500, seed=4)
    assert len(a) == 500 and all(isinstance(m, int) and m >= 1 for m in a)
    assert 700 < float(np.median(a)) < 1500
    assert set(lognormal_lengths(300, 0.0, 10)) == {300}


TOOL = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
        "--seq-length", str(SEQ), "--num-gpus", str(GPUS), "--global-batch-size", str(BATCH)]


def test_the_tool_plans_a_mix_and_layout_and_refuses_bad_flags(capsys):
    """--reset-attention-mask --context-parallel-layout zigzag --document-lengths-lognormal:
    ring plans carry the estimated figure (> 1 on that mix) and the layout flag, which
    pretrain_gpt.py's parser takes; the table says the figures; bad flags: one line."""
    mix = ["--reset-attention-mask", "--context-parallel-layout", "zigzag",
           "--document-lengths-lognormal", "1024", "1.5"]
    assert plan_parallel.main(TOOL + mix + ["--json", "--top", "50"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    rings = [q for q in plans if q["cp"] > 1]
    assert rings and all(q["cp_work_balance"] > 1.0 and q["context_parallel_layout"] == "zigzag"
                         for q in rings)
    assert all(q["cp_work_balance"] == 1.0 for q in plans if q["cp"] == 1)
    parser = build_parser()
    for q in rings:
        args, _ = parser.parse_known_args(shlex.split(q["flags"]))
        assert args.context_parallel_layout == "zigzag" and args.reset_attention_mask
    assert plan_parallel.main(TOOL + mix + ["--top", "50"]) == 0
    assert "ring (zigzag layout): attention at the slowest rank's work" in capsys.readouterr().out
    for bad, says in (
            (["--cp-work-balance", "0.5", "--reset-attention-mask"], "--cp-work-balance is the"),
            (["--cp-work-balance", "1.3"], "give --reset-attention-mask too"),
            (["--document-lengths-lognormal", "0", "1", "--reset-attention-mask"],
             "needs a median of at least 1"),
            (["--document-lengths-lognormal", "100", "1", "--cp-work-balance", "1.2",
              "--reset-attention-mask"], "not allowed with argument")):
        with pytest.raises(SystemExit):
            plan_parallel.main(TOOL + bad)
        err = capsys.readouterr().err
        assert "Traceback" not in err and says in err.strip().splitlines()[-1], err
