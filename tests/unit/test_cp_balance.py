"""The document-aware balanced context-parallel layout (context_parallel/balance.py), pure:
every position held exactly once, equal token counts per rank, pieces inside documents; the work
figure equal to a brute-force count of causal (query, key) pairs and to what the ring's plan
computes; one document the whole row (and no documents) give the whole-row zigzag; max/mean work
<= 1.05 on skewed mixes at cp 2..16; and the ring run in lockstep in one process over the
balanced plans equals full document-causal attention (output 1e-5, gradients 1e-4, fp32)."""
import numpy as np
import pytest
import torch

from megatron_sp.attention.documents import document_causal_mask
from megatron_sp.attention.segments import document_bounds
from megatron_sp.context_parallel.balance import (LayoutPlanner, causal_pairs, cp_layout,
                                                  layout_ring_plan, work_balance)
from megatron_sp.context_parallel.ring import rank_backward, rank_forward
from megatron_sp.context_parallel.zigzag import zigzag_positions

FWD_TOL, GRAD_TOL, BALANCE_TOL = 1e-5, 1e-4, 1.05


def bounds_of(lengths):
    out = [0]
    for m in lengths:
        out.append(out[-1] + m)
    return out


def fill(s, draw):
    """Document lengths drawn by draw() until the row of s tokens is full (the last one cut)."""
    lengths = []
    while sum(lengths) < s:
        lengths.append(max(1, min(int(draw()), s - sum(lengths))))
    return lengths


def mixes(s, rng):
    """The issue's skewed mixes (and the easy ones), as document lengths of one row."""
    long60 = [int(0.6 * s)] + fill(s - int(0.6 * s), lambda: rng.integers(64, 2048))
    return {
        "one long (60%) + short": long60,
        "lognormal (median 1K)": fill(s, lambda: rng.lognormal(np.log(1024), 1.0)),
        "short ones, then one long": (lambda short: short + [s - sum(short)])(
            fill(s // 2, lambda: rng.integers(64, 1024))),
        "hundreds of short ones": fill(s, lambda: rng.integers(32, 512)),
        "one document": [s],
    }


def check_partition(layout, bounds_rows):
    """Every position once, s/cp tokens per rank, each piece inside its document."""
    cp, s = layout.cp, layout.seq_len
    for row, bounds in zip(layout.rows, bounds_rows):
        seen = []
        for pieces in row.ranks:
            assert sum(p.length for p in pieces) == s // cp
            starts = [p.start for p in pieces]
            assert starts == sorted(starts)
            for p in pieces:
                assert bounds[p.doc] <= p.start and p.start + p.length <= bounds[p.doc + 1]
                assert p.offset == p.start - bounds[p.doc] and p.length > 0
                seen += range(p.start, p.start + p.length)
        assert sorted(seen) == list(range(s))


def check_work(layout, bounds_rows):
    """The layout's work per rank = brute force over its positions = the ring plan's work."""
    work = layout.work()
    for r in range(layout.cp):
        positions = layout.positions(r)
        brute = sum(causal_pairs(bounds, positions[i].tolist())
                    for i, bounds in enumerate(bounds_rows))
        assert work[r] == brute
        assert sum(layout_ring_plan(layout, r).work) == brute


@pytest.mark.parametrize("cp", [2, 4, 8, 16])
def test_skewed_mixes_are_balanced(cp, seed):
    rng = np.random.default_rng(seed)
    s = 32768
    for name, lengths in mixes(s, rng).items():
        bounds = bounds_of(lengths)
        zig = cp_layout("zigzag", [bounds], 1, s, cp)
        bal = cp_layout("balanced", [bounds], 1, s, cp)
        check_partition(bal, [bounds])
        assert bal.balance() <= BALANCE_TOL, f"{name} at cp {cp}: {bal.balance():.3f}"
        assert bal.balance() <= zig.balance() + 1e-9, name
        assert bal.travelling_tokens() and all(t <= s // cp for t in bal.travelling_tokens())
    check_work(bal, [bounds])             # the last mix: one document; brute force is cheap


def test_small_rows_exact(seed):
    """Work equals brute force and the plan's, and the partition is valid, on small random rows
    of one-token documents, random documents and 2-row batches, cp 2..4."""
    rng = np.random.default_rng(seed)
    for cp in (2, 3, 4):
        s = 8 * cp * 4
        rows = [bounds_of([1] * s), bounds_of(fill(s, lambda: rng.integers(1, 40))),
                bounds_of(fill(s, lambda: rng.integers(1, 5)) )]
        for kind in ("balanced", "zigzag"):
            layout = cp_layout(kind, rows, len(rows), s, cp)
            check_partition(layout, rows)
            check_work(layout, rows)
        ones = cp_layout("balanced", [rows[0]], 1, s, cp)
        assert ones.work() == [s // cp] * cp and ones.travelling_tokens() == [0] * cp


def test_one_document_and_no_documents_are_the_zigzag():
    for cp in (2, 4, 8):
        s = 64 * cp
        for bounds in ([[0, s]], None):
            layout = cp_layout("balanced", bounds, 1, s, cp)
            for r in range(cp):
                assert torch.equal(layout.positions(r)[0], zigzag_positions(s, cp, r))
        assert cp_layout("balanced", None, 1, s, cp).kind == "zigzag"


def test_deterministic_and_short_documents_stay_home(seed):
    rng = np.random.default_rng(seed)
    s, cp = 1 << 17, 8
    bounds = bounds_of(fill(s, lambda: rng.integers(16, 256)))
    a, b = (cp_layout("balanced", [bounds], 1, s, cp) for _ in range(2))
    assert all(torch.equal(a.positions(r), b.positions(r)) for r in range(cp))
    assert a.balance() <= 1.01 and sum(a.travelling_tokens()) < s // 20
    assert work_balance([0, 0]) == 1.0


class _Arrived:
    """A received block, already here (what RingExchange.wait returns)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def wait(self):
        return self.tensors


def _lockstep(ranks):
    """Run every rank's rank_forward / rank_backward generator in lockstep in one process: what
    rank r posts reaches rank r + 1 (a copy, as a receive is). Returns their results."""
    cp = len(ranks)
    results, handles = [None] * cp, [None] * cp
    while True:
        posted = []
        for r, rank in enumerate(ranks):
            try:
                posted.append((next(rank) if handles[r] is None else rank.send(handles[r]))[0])
            except StopIteration as stop:
                results[r] = stop.value
                posted.append(None)
        if all(p is None for p in posted):
            return results
        assert None not in posted, "the ranks went out of step"
        handles = [_Arrived(tuple(t.clone() for t in posted[(r - 1) % cp])) for r in range(cp)]


def _reference(q, k, v, dout, ids):
    """Full document-causal attention and its gradients on one rank (fp32 math)."""
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = document_causal_mask(ids)                                  # [b, 1, s, s]
    rep = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(rep, dim=2) for t in qkv[1:])        # GQA -> [b, s, h, d]
    scores = torch.einsum("bqhd,bkhd->bhqk", qkv[0], kk) / q.shape[3] ** 0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vv)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in qkv]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_over_balanced_plans_equals_attention(cp, seed):
    """The ring (rank_forward / rank_backward, in lockstep in one process) over the balanced
    layout's plans equals full attention, for a skewed mix with one-token documents."""
    gen = torch.Generator().manual_seed(seed)
    b, s, h, g, d = 2, 16 * cp * 2, 4, 2, 8
    rows = [[s // 2 + 3] + [1] * 5 + [s - s // 2 - 8],
            [3, 5, 1, 1, 2] + [7] * ((s - 12) // 7) + [s - 12 - 7 * ((s - 12) // 7)]]
    rows = [[m for m in row if m] for row in rows]
    ids = torch.tensor([sum(([i] * m for i, m in enumerate(row)), []) for row in rows])
    q, dout = (torch.randn(b, s, h, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, s, g, d, generator=gen) for _ in range(2))
    ref = _reference(q, k, v, dout, ids)

    planners = [LayoutPlanner("balanced", cp, r) for r in range(cp)]
    layout = planners[0].layout(ids, b, s)
    assert layout.kind == "balanced" and document_bounds(ids) == [row.bounds for row in layout.rows]
    index = [layout.positions(r) for r in range(cp)]                       # [b, n] each
    take = lambda t, r: torch.stack([t[i, index[r][i]] for i in range(b)])  # [b, n, ..]
    plans = [p.plan(ids, b, s // cp, True) for p in planners]
    scale = d ** -0.5
    outs = _lockstep([rank_forward(take(q, r), take(k, r), take(v, r), plans[r], scale)
                      for r in range(cp)])
    grads = _lockstep([rank_backward(take(q, r), take(k, r), take(v, r), outs[r][0],
                                     take(dout, r), outs[r][1], plans[r], scale)
                       for r in range(cp)])
    for i, (name, tol) in enumerate((("out", FWD_TOL), ("dq", GRAD_TOL), ("dk", GRAD_TOL),
                                     ("dv", GRAD_TOL))):
        full = torch.zeros_like(ref[i])
        for r in range(cp):
            got = outs[r][0] if i == 0 else grads[r][i - 1]
            for row in range(b):
                full[row, index[r][row]] = got[row].to(full.dtype)
        assert (full - ref[i]).abs().max().item() <= tol, name


def test_log_line_has_cp_work_balance_only_when_counted():
    from megatron_sp.training.metrics import format_log_line
    record = {"iteration": 1, "consumed_samples": 4, "ms_per_iter": 1.0, "tflops_per_gpu": 1e-5,
              "lr": 1e-3, "global_batch_size": 4, "lm_loss": 6.0, "grad_norm": 1.0,
              "tokens_per_sec": 10.0}
    assert "cp work balance" not in format_log_line(record, 2)
    assert "| cp work balance: 1.234 |" in format_log_line(dict(record, cp_work_balance=1.2341), 2)


def test_estimate_balance_of_a_length_distribution(seed):
    """Documents packed into rows as the dataset packs them (cut across rows): the balanced
    layout's figure within 1.05 where the zigzag's is not, and one row of one document exact."""
    from megatron_sp.context_parallel.balance import estimate_balance
    rng = np.random.default_rng(seed)
    s, cp = 8192, 4
    lengths = [int(m) for m in np.maximum(1, rng.lognormal(np.log(300), 1.5, 400))]
    zig, bal = (estimate_balance(lengths, s, cp, kind) for kind in ("zigzag", "balanced"))
    assert zig["rows"] == bal["rows"] == sum(lengths) // s
    assert bal["max"] <= BALANCE_TOL < zig["max"] and bal["mean"] <= zig["mean"]
    assert estimate_balance([s], s, cp) == {"rows": 1, "mean": 1.0, "max": 1.0}
    with pytest.raises(ValueError, match="at least 8192 tokens"):
        estimate_balance([10], s, cp)
