"""The ring of context_parallel/ring.py rehearsed in ONE process: cp virtual ranks on one device.

`ring_rehearsal` zigzag-splits full sequences into cp virtual ranks and runs, for every one of
them, exactly what a rank of the real ring runs: the ring's own rank generators
(context_parallel.ring.rank_forward / rank_backward: the same plan, attention/segments.ring_plan,
through the same block kernels, step by step). Only the exchange differs: instead of send_next_recv_prev over a process group, a local hand-over gives
every virtual rank what its previous neighbour posted (rank r receives from rank r - 1, so at
step i it holds the kv block of rank (r - i) mod cp):

    forward    step i: post the held kv block, compute plan.steps[i] against it, take the
               received block (none after the last step)
    backward   step i: post the held kv block, compute its dq and fresh dk, dv of the held block,
               add the dk, dv the previous rank passed on, post them on; after cp steps every
               accumulator is one hop from home and the last hand-over returns it

The ranks are generators that stop at every exchange; the driver steps them in lockstep, so the
virtual ranks' work interleaves as the real ranks' does (what one rank does between two exchanges
runs before the next rank's). No torch.distributed call is made here.

    rehearsal = ring_rehearsal(q, k, v, cp=4, document_ids=ids)     # q [b, s, h, d], full rows
    rehearsal.sum().backward()                                      # dq, dk, dv by the ring

`rehearse_rank_peak` runs ONE virtual rank's forward and backward on CUDA against kv blocks (and
dk, dv accumulators) of the other ranks that arrive one at a time, as random data of the right
shapes, each receive buffer allocated when its exchange is posted and every sent tensor kept
until the exchange completes (what comm.RingExchange keeps alive): the peak memory of one real
rank's ring attention, measurable on one GPU for a cp the machine does not have.
"""
from __future__ import annotations

import math

import torch

from megatron_sp.attention.segments import RingPlan, document_bounds, ring_plan
from megatron_sp.context_parallel.ring import rank_backward, rank_forward
from megatron_sp.context_parallel.zigzag import check_zigzag_length, zigzag_merge, zigzag_split


# The exchange, local --------------------------------------------------------------------------

class _Exchange:
    """A posted hand-over (comm.RingExchange's part that matters here): the sent tensors stay
    referenced until wait(), which returns the received ones (and forgets both)."""

    def __init__(self, sends, recvs):
        self._sends, self._recvs = sends, recvs

    def wait(self):
        recvs, self._sends, self._recvs = self._recvs, None, None
        return recvs


def _from_previous(posted: list) -> list[_Exchange]:
    """Every virtual rank's exchange of one lockstep: rank r receives what rank r - 1 posted (a
    copy, as a receive is) and keeps its own posted tensors until it waits."""
    cp = len(posted)
    return [_Exchange(posted[r], tuple(t.clone() for t in posted[(r - 1) % cp]))
            for r in range(cp)]


def _random_arrival(posted: list) -> list[_Exchange]:
    """One virtual rank's exchange: what arrives is random data of the posted shapes (memory
    rehearsal), its buffers allocated now, as the real receive's are when it is posted."""
    (sends,) = posted
    return [_Exchange(sends, tuple(torch.empty_like(t).normal_() for t in sends))]


def _lockstep(ranks: list, exchange) -> list:
    """Run generator ranks to completion in lockstep: each runs until it posts (yields the
    tensors it sends), then `exchange` turns every rank's posted tensors into its _Exchange,
    sent back into it. Returns every rank's return value. All ranks post equally often (a ring
    of one rank's forward never does)."""
    results = [None] * len(ranks)
    handles = [None] * len(ranks)
    while True:
        posted, done = [None] * len(ranks), 0
        for r, rank in enumerate(ranks):
            try:
                sent = next(rank) if handles[r] is None else rank.send(handles[r])
                posted[r] = sent[0]                 # (tensors, tag): the tag orders real sends
            except StopIteration as stop:
                results[r] = stop.value
                done += 1
            handles[r] = None                       # what it waits on, it holds itself
        if done:
            if done != len(ranks):
                raise RuntimeError("the virtual ranks of a ring rehearsal went out of step.")
            return results
        handles = exchange(posted)
        del posted                                  # not held past the exchange here


# The rehearsal ----------------------------------------------------------------------------------

def rehearsal_plans(document_ids, b: int, s: int, cp: int, causal: bool = True) -> list[RingPlan]:
    """Every virtual rank's RingPlan for rows of s tokens (what plan_ring makes on each real
    rank): one document_bounds (one host sync), cp ring_plan calls."""
    check_zigzag_length(s, cp)
    if document_ids is not None and tuple(document_ids.shape) != (b, s):
        raise ValueError(f"document_ids must cover the full rows, [b, s] = [{b}, {s}], got "
                         f"{tuple(document_ids.shape)}.")
    bounds = document_bounds(document_ids)
    return [ring_plan(bounds, b, s, cp, r, causal) for r in range(cp)]


def _split(t, cp):
    return [zigzag_split(t, cp, r) for r in range(cp)]          # each a new, contiguous tensor


class RingRehearsal(torch.autograd.Function):
    """The rehearsal as an autograd function: forward(ctx, q, k, v, plans, scale) on full rows."""

    @staticmethod
    def forward(ctx, q, k, v, plans, scale):
        cp = len(plans)
        qs, ks, vs = _split(q, cp), _split(k, cp), _split(v, cp)
        results = _lockstep([rank_forward(qs[r], ks[r], vs[r], plans[r], scale)
                             for r in range(cp)], _from_previous)
        outs = [o for o, _ in results]
        lses = [lse for _, lse in results]
        ctx.save_for_backward(q, k, v, *outs, *lses)
        ctx.plans, ctx.scale = plans, scale
        return zigzag_merge(outs, cp)                            # [b, s, h, d], sequence order

    @staticmethod
    def backward(ctx, dout):
        plans, cp = ctx.plans, len(ctx.plans)
        q, k, v, *rest = ctx.saved_tensors
        outs, lses = rest[:cp], rest[cp:]
        qs, ks, vs, douts = _split(q, cp), _split(k, cp), _split(v, cp), _split(dout, cp)
        results = _lockstep([rank_backward(qs[r], ks[r], vs[r], outs[r], douts[r], lses[r],
                                            plans[r], ctx.scale) for r in range(cp)],
                            _from_previous)
        dq, dk, dv = (zigzag_merge([res[i] for res in results], cp) for i in range(3))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _check_inputs(q, k, v):
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or k.shape[:2] != q.shape[:2] \
            or k.shape[3] != q.shape[3]:
        raise ValueError(f"the ring rehearsal takes full sequences, q [b, s, h, d] and k, v "
                         f"[b, s, g, d]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}.")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"grouped-query attention needs the query heads h = {q.shape[2]} to be "
                         f"a multiple of the key/value heads g = {k.shape[2]}.")


def ring_rehearsal(q, k, v, cp: int, *, causal: bool = True, scale: float | None = None,
                   document_ids=None, plans: list[RingPlan] | None = None):
    """Ring attention of cp virtual ranks in one process, on full sequences.

    q [b, s, h, d], k, v [b, s, g, d] (h % g == 0, s a multiple of 2 cp), in sequence order;
    document_ids [b, s] (packed documents) or None. Every virtual rank gets its zigzag tokens
    and runs the real ring's plan and block kernels; the kv blocks (and in backward the dk, dv
    accumulators) are handed over locally in the ring's order. Returns out [b, s, h, d] in q's
    dtype, in sequence order, differentiable w.r.t. q, k, v (the ring's backward). plans:
    rehearsal_plans' result for these ids and shapes, when the caller has it.
    """
    _check_inputs(q, k, v)
    b, s, _, d = q.shape
    check_zigzag_length(s, cp)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    plans = plans or rehearsal_plans(document_ids, b, s, cp, causal)
    if len(plans) != cp:
        raise ValueError(f"a ring rehearsal of cp = {cp} needs {cp} plans, got {len(plans)}.")
    return RingRehearsal.apply(q, k, v, plans, scale)


# One rank's peak memory -------------------------------------------------------------------------

def rehearse_rank_peak(b: int, s: int, h: int, g: int, d: int, cp: int, rank: int, dtype,
                       device, document_ids=None, *, causal: bool = True,
                       scale: float | None = None) -> int | None:
    """Peak device memory (bytes) of one virtual ring rank's attention forward + backward.

    Ring rank `rank` of cp, rows of s tokens (b rows, h query and g key/value heads of size d,
    `dtype`): its own zigzag q, k, v [b, 2c, .., d] (c = s / 2cp) are made first (random; the
    layer has them already) and are the baseline; then its forward (fp32 accumulators, each
    received kv block arriving while the held one is computed), the saved out and lse, the
    incoming gradient dout, and its backward (kv blocks again, dk, dv fp32 accumulators sent on,
    received and added, dq) run with every other rank's data random, one block at a time.
    Returns torch.cuda.max_memory_allocated() during all of that minus the baseline (what ring
    attention adds to the layer's q, k, v; the returned dq, dk, dv included), or None off CUDA
    (the CPU allocator keeps no peak). document_ids [b, s] of the full rows: the plan's segments.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if not 0 <= rank < cp:
        raise ValueError(f"ring rank {rank} is outside the context parallel group of size {cp}.")
    c = check_zigzag_length(s, cp)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    plan = ring_plan(document_bounds(document_ids), b, s, cp, rank, causal)
    n = 2 * c
    with torch.no_grad():
        q = torch.randn(b, n, h, d, dtype=dtype, device=device)
        k, v = (torch.randn(b, n, g, d, dtype=dtype, device=device) for _ in range(2))
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _rank_alone(q, k, v, plan, scale)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    return int(peak)


def _rank_alone(q, k, v, plan: RingPlan, scale):
    """One virtual rank's forward and backward, the other ranks' blocks and accumulators random:
    the gradients (dq, dk, dv) in q's dtype, as RingAttention.backward returns them."""
    (out, lse), = _lockstep([rank_forward(q, k, v, plan, scale)], _random_arrival)
    dout = torch.randn_like(out)                       # the gradient arriving from above
    (dq, dk, dv), = _lockstep([rank_backward(q, k, v, out, dout, lse, plan, scale)],
                              _random_arrival)
    return tuple(t.to(q.dtype) for t in (dq, dk, dv))
