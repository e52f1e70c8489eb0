"""context_parallel.te_thd: TE's thd layout of a step and the exchange plans, at cp 2, 4 and 8 in
one process (no process group: every rank's plan is computed and the all-to-all simulated).

TE's layout is written out here from TE's description (every document padded to P = 2cp * c,
chunks i and 2cp-1-i of c tokens on rank i, real tokens first), independently of te_places."""
import random

import pytest
import torch

from megatron_sp.context_parallel.balance import cp_layout
from megatron_sp.context_parallel.te_thd import thd_plan, thd_work


def random_bounds(rng, s):
    """Document bounds of a row of s tokens: a few long documents among many short ones."""
    bounds, at = [0], 0
    while at < s:
        length = rng.choice([1, 2, 3, rng.randint(1, 40), rng.randint(s // 4, s)])
        at = min(s, at + length)
        bounds.append(at)
    return bounds


def expected_buffers(rows_bounds, s, cp):
    """Per rank, the global index (row * s + position) in each of its thd slots, -1 for padding,
    and the per-rank causal work there."""
    buffers, work = [[] for _ in range(cp)], [0] * cp
    for r, bounds in enumerate(rows_bounds):
        for start, end in zip(bounds, bounds[1:]):
            length = end - start
            c = -(-length // (2 * cp))
            padded = [r * s + start + t if t < length else -1 for t in range(2 * cp * c)]
            for i in range(cp):
                for chunk in (i, 2 * cp - 1 - i):
                    slots = padded[chunk * c:(chunk + 1) * c]
                    buffers[i] += slots
                    work[i] += sum(g - r * s - start + 1 for g in slots if g >= 0)
    return buffers, work


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("kind", ["balanced", "zigzag"])
def test_the_exchange_builds_tes_layout_and_brings_every_token_home(cp, kind, seed):
    rng = random.Random(seed + cp)
    b, s = 3, 16 * cp * 2
    rows = [random_bounds(rng, s) for _ in range(b)]
    rows[0] = [0, s]                                               # one document the whole row
    layout = cp_layout(kind, rows, b, s, cp)
    plans = [thd_plan(layout, r) for r in range(cp)]
    ours = [(layout.positions(r) + torch.arange(b)[:, None] * s).reshape(-1) for r in range(cp)]
    want, want_work = expected_buffers(rows, s, cp)
    # simulated all-to-all: rank j's rows in send order, cut by send_counts
    outgoing = [list(ours[j][plans[j].send_index].split(plans[j].send_counts)) for j in range(cp)]
    for i, plan in enumerate(plans):
        assert plan.slots == len(want[i]) and plan.recv_counts == [
            plans[j].send_counts[i] for j in range(cp)]
        received = torch.cat([outgoing[j][i] for j in range(cp)])
        buffer = torch.full((plan.slots,), -1, dtype=torch.long)
        buffer[plan.recv_slots] = received
        assert buffer.tolist() == want[i], f"rank {i}'s thd buffer is not TE's layout"
        # the way back: the same slots, the reverse exchange, scattered by send_index
        back = [buffer[plan.recv_slots].split(plan.recv_counts)[j] for j in range(cp)]
        for j in range(cp):
            outgoing[j][i] = back[j]
    for j, plan in enumerate(plans):
        home = torch.empty_like(ours[j])
        home[plan.send_index] = torch.cat(outgoing[j])
        assert torch.equal(home, ours[j]), f"rank {j}'s tokens did not come home"
    lengths = [e - a for bounds in rows for a, e in zip(bounds, bounds[1:])]
    padded = [2 * cp * -(-m // (2 * cp)) for m in lengths]
    assert plans[0].cu_seqlens.tolist() == torch.tensor([0] + lengths).cumsum(0).tolist()
    assert plans[0].cu_seqlens_padded.tolist() == torch.tensor([0] + padded).cumsum(0).tolist()
    assert plans[0].cu_seqlens.dtype == torch.int32 and plans[0].max_seqlen == max(padded)
    assert thd_work(layout) == want_work


def test_a_split_document_that_2cp_divides_stays_home():
    """The balanced layout splits a long document per document; where 2cp divides its length
    its chunks are TE's, so none of its tokens move (the short ones held whole do)."""
    s, cp = 64, 2
    layout = cp_layout("balanced", [[0, 32, 40, 48, 56, 64]], 1, s, cp)
    plans = [thd_plan(layout, r) for r in range(cp)]
    for r, plan in enumerate(plans):
        mine = layout.positions(r)[0]
        long_doc = mine < 32
        dest = torch.repeat_interleave(torch.arange(cp), torch.tensor(plan.send_counts))
        assert bool((dest[torch.argsort(plan.send_index)][long_doc] == r).all())
    assert sum(plan.tokens_moved(r) for r, plan in enumerate(plans)) > 0   # the short ones
