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

The partial results merge in fp32 through merge_partials (docs/design.md §14). Backward is a ring
as well: the kv blocks travel again and so do their dk, dv accumulators (fp32), each rank adding
its queries' share to the held block's and passing it on; after cp steps every accumulator is one
hop from home and the last send returns it. dq accumulates locally. Every block's probabilities
are recomputed from q, the held k and the saved GLOBAL out and lse (attention_backward_with_lse).

Grouped-query attention travels as is: g key/value heads (g < h allowed, and cp > g is fine, as
every rank holds all heads of its tokens). Per rank and layer the forward sends (cp-1) kv blocks,
2 (cp-1) b 2c g d elements; backward (cp-1) kv blocks plus cp dk, dv blocks in fp32.
"""
from __future__ import annotations

import math

import torch

from megatron_sp.attention.lse import BlockPair, backward_pairs, forward_pairs
from megatron_sp.context_parallel.comm import GRAD_TAG, KV_TAG, send_next_recv_prev
from megatron_sp.mesh import group_rank, group_size


def step_pairs(rank: int, src: int, c: int, causal: bool,
               documents: bool = False) -> list[BlockPair]:
    """The block pairs rank `rank` computes against the kv block of rank `src` (local slices of
    its 2c queries and of the block's 2c keys; see the table in the module docstring).
    documents: every pair also gets the document mask (packed documents)."""
    head, tail, both = slice(0, c), slice(c, 2 * c), slice(0, 2 * c)
    if not causal:
        pairs = [(both, both, False)]
    elif src == rank:
        pairs = [(head, head, True), (tail, head, False), (tail, tail, True)]
    elif src < rank:
        pairs = [(both, head, False)]
    else:
        pairs = [(tail, both, False)]
    return [BlockPair(q, k, diagonal, documents) for q, k, diagonal in pairs]


def _meeting(pairs, doc_q, doc_k) -> list[BlockPair]:
    """With packed documents, the pairs whose query and key tokens share a document in some row;
    the others are skipped. Each zigzag chunk is contiguous in the row and document indices never
    decrease along it, so a pair meets iff its document ranges overlap: first_q <= last_k and
    first_k <= last_q."""
    if doc_q is None:
        return pairs
    kept = []
    for p in pairs:
        q, k = doc_q[:, p.q], doc_k[:, p.k]           # [b, len] each, non-decreasing per chunk
        # a slice may span both chunks (head and tail): use each row's min and max
        meet = (q.min(1).values <= k.max(1).values) & (k.min(1).values <= q.max(1).values)
        if bool(meet.any()):
            kept.append(p)
    return kept


def _travelling(k, v, doc):
    """What travels around the ring: the kv block, and its tokens' document indices if packed."""
    return (k.contiguous(), v.contiguous()) + (() if doc is None else (doc.contiguous(),))


def _held_doc(held):
    """The document index that travels with a held block (None without packed documents)."""
    return held[2] if len(held) == 3 else None


def _ring_forward(q, k, v, doc, group, causal, scale):
    """(out [b, 2c, h, d] in q's dtype, lse [b, h, 2c] fp32, the block pairs of every step) of this
    rank's queries; backward reuses the pairs (the document check is not repeated)."""
    cp, r = group_size(group), group_rank(group)
    b, n, h, d = q.shape
    out = torch.zeros(b, n, h, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=q.device)
    held, plan = _travelling(k, v, doc), []
    for i in range(cp):
        pending = send_next_recv_prev(held, group, KV_TAG) if i < cp - 1 else None  # next block
        pairs = _meeting(step_pairs(r, (r - i) % cp, n // 2, causal, doc is not None), doc,
                         _held_doc(held))
        forward_pairs(q, held[0], held[1], pairs, scale=scale, out=out, lse=lse,
                      doc_q=doc, doc_k=_held_doc(held))
        plan.append(pairs)
        if pending is not None:
            held = pending.wait()
    return out.to(q.dtype), lse, plan


def _ring_backward(q, k, v, doc, out, dout, lse, group, plan, scale):
    """(dq, dk, dv) of this rank's tokens, fp32: dk, dv of the held block travel with it; `plan`:
    the forward's block pairs of every step."""
    cp = group_size(group)
    f32 = torch.float32
    dq = torch.zeros(q.shape, dtype=f32, device=q.device)
    held = _travelling(k, v, doc)
    grads = None                           # the exchange bringing the next block's dk, dv
    for i in range(cp):
        pending = send_next_recv_prev(held, group, KV_TAG) if i < cp - 1 else None
        dk = torch.zeros(k.shape, dtype=f32, device=k.device)
        dv = torch.zeros(v.shape, dtype=f32, device=v.device)
        backward_pairs(q, held[0], held[1], out, dout, lse, plan[i], scale=scale, dq=dq, dk=dk,
                       dv=dv, doc_q=doc, doc_k=_held_doc(held))
        if grads is not None:              # the other ranks' share of this block so far
            dk_in, dv_in = grads.wait()
            dk, dv = dk + dk_in, dv + dv_in
            del dk_in, dv_in               # not held into the next step (one fp32 pair fewer)
        grads = send_next_recv_prev((dk, dv), group, GRAD_TAG)   # on around the ring / home
        if pending is not None:
            held = pending.wait()
    dk, dv = grads.wait()                  # this rank's own block, complete, back home
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    """Ring attention as an autograd function: forward(ctx, q, k, v, doc, group, causal, scale)."""

    @staticmethod
    def forward(ctx, q, k, v, doc, group, causal, scale):
        out, lse, plan = _ring_forward(q, k, v, doc, group, causal, scale)
        ctx.save_for_backward(q, k, v, doc, out, lse)
        ctx.group, ctx.plan, ctx.scale = group, plan, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, doc, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q, k, v, doc, out, dout.contiguous(), lse, ctx.group,
                                    ctx.plan, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q, k, v, group, *, causal: bool = True, scale: float | None = None,
                   document_index=None):
    """Attention of this rank's zigzag tokens against the whole sequence, over a ring.

    q [b, 2c, h, d], k, v [b, 2c, g, d]: this rank's tokens in the zigzag layout (zigzag_split),
    h % g == 0. group: the context parallel ring (group ranks 0..cp-1 in ring order; None or one
    rank: plain attention). document_index [b, 2c] int64 (packed documents): each token's document
    index counted over the FULL row (megatron_sp.attention.lse.document_index of the full
    document ids, then zigzag_split), so indices compare across ranks; it travels with the kv
    blocks; a block pair whose documents never meet is skipped, the others masked to
    same-document keys. Returns out [b, 2c, h, d] in q's
    dtype, in the same layout.
    """
    b, n, h, d = q.shape
    if n % 2 or k.shape[:2] != (b, n) or k.shape != v.shape or k.shape[3] != d:
        raise ValueError(f"ring attention takes this rank's zigzag tokens, q [b, 2c, h, d] and "
                         f"k, v [b, 2c, g, d]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}.")
    if h % k.shape[2]:
        raise ValueError(f"grouped-query attention needs the query heads h = {h} to be a multiple "
                         f"of the key/value heads g = {k.shape[2]}.")
    if document_index is not None and tuple(document_index.shape) != (b, n):
        raise ValueError(f"document_index must be [b, 2c] = [{b}, {n}] (this rank's zigzag "
                         f"tokens), got {tuple(document_index.shape)}.")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    return RingAttention.apply(q, k, v, document_index, group, causal, scale)
