"""Ring attention over the context parallel group (Liu et al. 2023; Megatron-LM CP, p2p).

Every rank holds its zigzag tokens (megatron_sp.context_parallel.zigzag): q [b, 2c, h, d],
k, v [b, 2c, g, d] with c = s / (2 cp), chunk r then chunk 2cp-1-r of the sequence. Queries stay
put; key/value blocks travel around the ring (context_parallel.comm), one hop per step, the next
hop in flight while the current block is computed:

    step 0         step 1         step 2         step 3          (cp = 4, rank r holds kv of
    r0: kv0        r0: kv3        r0: kv2        r0: kv1          rank (r - i) mod cp at step i)
    r1: kv1        r1: kv0        r1: kv3        r1: kv2
    r2: kv2        r2: kv1        r2: kv0        r2: kv3
    r3: kv3        r3: kv2        r3: kv1        r3: kv0

Causal work per step, by chunk index (query chunks A = r, B = 2cp-1-r; key chunks a = j,
b = 2cp-1-j of the held block of rank j): a key chunk before a query chunk is seen fully, the
same chunk causally, a later one not at all, so with the zigzag layout every step is balanced:

    j == r  (step 0)   A x a diagonal, B x a full, B x b diagonal
    j <  r             [A B] x a full         (both query chunks, the head key chunk)
    j >  r             B x [a b] full         (the tail query chunk, both key chunks)

Packed documents change only which parts of these chunk pairs are computed (the plan,
attention/segments.py, made once per step from the full rows' document ids and shared by every
layer): a pair of chunks with keys before queries is one dense rectangle of the single document
that meets both, or nothing; a diagonal pair is its documents' causal squares. No mask, nothing
[chunk, chunk], and no document index travels with the blocks.

The partial results merge in fp32 by their log-sum-exp (docs/design.md §14), through the fused
block kernels of attention/block_kernels.py (the CPU flash kernel; FlashAttention-2 varlen in
fp16/bf16 and the memory-efficient kernel in fp32 on CUDA). Backward is a ring as well: the kv
blocks travel again and so do their dk, dv accumulators (fp32), each rank adding its queries'
share to the held block's and passing it on; after cp steps every accumulator is one hop from
home and the last send returns it. dq accumulates locally. Every block's probabilities are
recomputed by the kernels' backward from q, the held k and the saved GLOBAL out and lse.

Grouped-query attention travels as is: g key/value heads (g < h allowed, and cp > g is fine, as
every rank holds all heads of its tokens). Per rank and layer the forward sends (cp-1) kv blocks,
2 (cp-1) b 2c g d elements; backward (cp-1) kv blocks plus cp dk, dv blocks in fp32.
"""
from __future__ import annotations

import math

import torch

from megatron_sp.attention.block_kernels import backward_batch, forward_batch
from megatron_sp.attention.segments import RingPlan, document_bounds, ring_plan
from megatron_sp.context_parallel.comm import GRAD_TAG, KV_TAG, send_next_recv_prev
from megatron_sp.mesh import group_rank, group_size


def plan_ring(document_ids, b: int, n: int, group, causal: bool) -> RingPlan:
    """This rank's RingPlan for rows of n zigzag tokens per rank: the segments of every step
    (attention/segments.py). document_ids: the FULL rows' [b, n cp] ids, or None."""
    cp, r = group_size(group), group_rank(group)
    if document_ids is not None and tuple(document_ids.shape) != (b, n * cp):
        raise ValueError(f"document_ids must cover the full rows, [b, s] = [{b}, {n * cp}] "
                         f"(cp = {cp} ranks of {n} zigzag tokens), got "
                         f"{tuple(document_ids.shape)}.")
    return ring_plan(document_bounds(document_ids), b, n * cp, cp, r, causal)


def rank_forward(q, k, v, plan: RingPlan, scale):
    """One rank's forward ring as a generator: (out [b, 2c, h, d] in q's dtype, lse [b, 2c, h]
    fp32, token-major) of its queries, step i merging the segments of plan.steps[i] against the
    held kv block. At every exchange it yields (tensors to send on, tag, shape of what arrives or
    None for the sent ones') and is sent back the posted exchange (whose wait() returns what the
    previous rank sent): _over_group posts it with send_next_recv_prev, the rehearsal
    (rehearsal.py) hands it over locally. With a compact plan (plan.send_index) step 0 uses the
    whole own block and only its travelling tokens go on."""
    cp = plan.cp
    b, n, h, d = q.shape
    out = torch.zeros(b, n, h, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, n, h), float("-inf"), dtype=torch.float32, device=q.device)
    held = (k.contiguous(), v.contiguous())
    for i in range(cp):
        pending = None
        if i < cp - 1:                   # the next block, posted first
            sent = tuple(plan.travelling(t) for t in held) if i == 0 else held
            pending = yield sent, KV_TAG, plan.received_shape(i, k)
        for batch in plan.steps[i]:
            forward_batch(q, held[0], held[1], batch, scale=scale, out=out, lse=lse)
        if pending is not None:
            held = pending.wait()
    return out.to(q.dtype), lse


def rank_backward(q, k, v, out, dout, lse, plan: RingPlan, scale):
    """One rank's backward ring as a generator (the protocol of rank_forward): (dq, dk, dv) of
    its tokens, fp32; the dk, dv of the held block travel with it. With a compact plan the own
    block's step-0 gradients stay home and the travelling block's come back to be added."""
    cp, compact = plan.cp, plan.send_index is not None
    f32 = torch.float32
    dq = torch.zeros(q.shape, dtype=f32, device=q.device)
    held = (k.contiguous(), v.contiguous())
    grads = home = None                    # the exchange bringing the next block's dk, dv
    for i in range(cp):
        pending = None
        if i < cp - 1:
            sent = tuple(plan.travelling(t) for t in held) if i == 0 else held
            pending = yield sent, KV_TAG, plan.received_shape(i, k)
        dk = torch.zeros(held[0].shape, dtype=f32, device=k.device)
        dv = torch.zeros(held[1].shape, dtype=f32, device=v.device)
        for batch in plan.steps[i]:
            backward_batch(q, held[0], held[1], out, dout, lse, batch, scale=scale, dq=dq,
                           dk=dk, dv=dv)
        if compact and i == 0:
            home = (dk, dv)                # the own block's share from its own queries
        else:
            if grads is not None:          # the other ranks' share of this block so far
                dk_in, dv_in = grads.wait()
                dk, dv = dk + dk_in, dv + dv_in
                del dk_in, dv_in           # not held into the next step (one fp32 pair fewer)
            # on around the ring / home after the last step
            grads = yield (dk, dv), GRAD_TAG, plan.received_shape(i, k)
        if pending is not None:
            held = pending.wait()
    if home is None:
        dk, dv = grads.wait()              # this rank's own block, complete, back home
        return dq, dk, dv
    if grads is None:                      # a ring of one
        return dq, home[0], home[1]
    dk_in, dv_in = grads.wait()            # the travelling tokens' shares from the others
    return dq, plan.scatter_home(home[0], dk_in), plan.scatter_home(home[1], dv_in)


def _over_group(rank, group):
    """Run a rank_forward / rank_backward generator over the ring of `group`: every exchange it
    yields is posted with send_next_recv_prev (the transfer overlaps the next block's work)."""
    try:
        tensors, tag, shape = next(rank)
        while True:
            tensors, tag, shape = rank.send(send_next_recv_prev(tensors, group, tag, shape))
    except StopIteration as done:
        return done.value


class RingAttention(torch.autograd.Function):
    """Ring attention as an autograd function: forward(ctx, q, k, v, plan, group, scale)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, group, scale):
        out, lse = _over_group(rank_forward(q, k, v, plan, scale), group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plan, ctx.scale = group, plan, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _over_group(rank_backward(q, k, v, out, dout.contiguous(), lse, ctx.plan,
                                               ctx.scale), ctx.group)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(q, k, v, group, *, causal: bool = True, scale: float | None = None,
                   document_ids=None, plan: RingPlan | None = None):
    """Attention of this rank's zigzag tokens against the whole sequence, over a ring.

    q [b, 2c, h, d], k, v [b, 2c, g, d]: this rank's tokens in the zigzag layout (zigzag_split),
    h % g == 0. group: the context parallel ring (group ranks 0..cp-1 in ring order; None or one
    rank: plain attention). document_ids [b, s] int64 (packed documents): the FULL rows' ids, as
    every rank has them; each step then computes only the segments its documents make (one dense
    rectangle or nothing per chunk pair off the diagonal, each document's causal square on it;
    attention/segments.py), never a mask. plan: plan_ring's result for these ids and shapes when
    the caller has it (one per step for every layer). Returns out [b, 2c, h, d] in q's dtype, in
    the same layout.
    """
    b, n, h, d = q.shape
    if n % 2 or k.shape[:2] != (b, n) or k.shape != v.shape or k.shape[3] != d:
        raise ValueError(f"ring attention takes this rank's zigzag tokens, q [b, 2c, h, d] and "
                         f"k, v [b, 2c, g, d]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}.")
    if h % k.shape[2]:
        raise ValueError(f"grouped-query attention needs the query heads h = {h} to be a multiple "
                         f"of the key/value heads g = {k.shape[2]}.")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    plan = plan or plan_ring(document_ids, b, n, group, causal)
    return RingAttention.apply(q, k, v, plan, group, scale)
