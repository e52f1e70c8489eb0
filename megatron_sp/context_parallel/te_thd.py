"""Packed documents under Transformer Engine's context parallelism: TE's thd layout of a step and
the token exchange between it and ours (docs/design.md §14). Pure index arithmetic from the
step's CpLayout, the same on every rank; the exchange itself is context_parallel/comm.py's.

TE's thd format takes a ring of cp ranks only as its own per-document DualChunkSwap (TE's
attn_forward_func_with_cp, thd_get_partitioned_indices): every sequence i of cu_seqlens_padded,
padded to P_i = 2cp * c_i tokens, is cut in 2cp chunks of c_i, context rank r holding chunks r and
2cp-1-r of EACH sequence, the real L_i tokens first and the padding at the end:

    document of L = 11, cp = 2: P = 12, c = 3     chunk  0    1    2    3
                                                   rank   0    1    1    0
                                                   tokens 0-2  3-5  6-8  9,10 + 1 pad

    rank r's thd buffer: per document in row order, chunk r's c_i slots then chunk 2cp-1-r's;
    T = sum_i 2 c_i slots on every rank (sum_i P_i / cp), padding slots zero

Our ranks hold n = s/cp tokens of the row (the balanced or zigzag layout), which is TE's only
where every document is split so with no padding. So the TE path moves tokens: before attention
q, k, v go from our layout to TE's (one all-to-all of the rows, a token staying home where its two
layouts agree: a long document whose length 2cp divides, split per document by the balanced
layout, stays entirely), TE attends with cu_seqlens (real lengths) and cu_seqlens_padded, and the
output comes back by the reverse all-to-all (its backward: the same two exchanges reversed).
Positions, labels and the loss stay ours. TE implements thd only for --cp-comm-type p2p.

    q, k, v [b, n, h|g, d] (our layout) -> rows [b*n, h+2g, d] -> sorted by (TE rank, TE slot)
      -> all-to-all (send_counts / recv_counts) -> thd [T, h+2g, d] (recv_slots, zero padding)
      -> TE DotProductAttention(qkv_format "thd", "padding_causal") -> [T, h*d]
      -> rows [recv_slots] -> reverse all-to-all -> [b*n, h, d] (send_index) -> [b, n, h, d]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_sp.context_parallel.balance import CpLayout


@dataclass
class ThdPlan:
    """One rank's view of a step in TE's thd layout (module docstring).

    send_index   [N] int64   our local rows (row * n + token) in the order they are sent: by TE
                             rank, then TE slot; send_counts[j] of them go to context rank j
    recv_slots   [M] int64   the thd slot of each row received, source rank by source rank;
                             recv_counts[j] come from context rank j
    slots        T, this rank's thd rows (real and padding; the same on every rank)
    cu_seqlens, cu_seqlens_padded  int32 [docs + 1]: every row's documents in row order, real
                             and padded lengths (global: TE divides by cp itself)
    max_seqlen   the longest padded document
    """
    send_index: torch.Tensor
    send_counts: list
    recv_slots: torch.Tensor
    recv_counts: list
    slots: int
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int

    def tokens_moved(self, rank: int) -> int:
        """Rows this rank sends to OTHER ranks (each way: in before attention, out after)."""
        return sum(self.send_counts) - self.send_counts[rank]


def chunk_size(length: int, cp: int) -> int:
    """c: TE's chunk of a document of `length` tokens over cp ranks (P = 2cp * c >= length)."""
    return -(-length // (2 * cp))


def te_places(layout: CpLayout):
    """Every token's place in TE's thd layout: (rank [b*s], slot [b*s], real lengths, padded
    lengths) for the rows of `layout` flattened row-major (index row * s + position)."""
    places = _places(layout)
    return places["rank"], places["slot"], places["real"], places["padded"]


def _places(layout: CpLayout) -> dict:
    """te_places' figures and every token's offset in its document, computed once per layout
    (kept in layout.derived: the model's work count and the layers' plan share them)."""
    if "te_places" in layout.derived:
        return layout.derived["te_places"]
    cp, s, b = layout.cp, layout.seq_len, len(layout.rows)
    rank = torch.empty(b * s, dtype=torch.long)
    slot = torch.empty(b * s, dtype=torch.long)
    offset = torch.empty(b * s, dtype=torch.long)
    real, padded, base = [], [], 0
    for r, row in enumerate(layout.rows):
        for start, end in zip(row.bounds, row.bounds[1:]):
            length = end - start
            c = chunk_size(length, cp)
            t = torch.arange(length)
            chunk, within = t // c, t % c
            first = chunk < cp                   # chunks 0..cp-1 on ranks 0..cp-1, then back
            at = slice(r * s + start, r * s + end)
            rank[at] = torch.where(first, chunk, 2 * cp - 1 - chunk)
            slot[at] = base + torch.where(first, 0, c) + within
            offset[at] = t
            base += 2 * c
            real.append(length)
            padded.append(2 * cp * c)
    places = dict(rank=rank, slot=slot, offset=offset, real=real, padded=padded)
    layout.derived["te_places"] = places
    return places


def _cumulative(lengths, device) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def thd_plan(layout: CpLayout, rank: int, device=None) -> ThdPlan:
    """Context rank `rank`'s ThdPlan for the step's `layout` (our tokens: layout.positions)."""
    cp, s = layout.cp, layout.seq_len
    te_rank, te_slot, real, padded = te_places(layout)
    slots = sum(padded) // cp
    rows = torch.arange(len(layout.rows))[:, None] * s                           # [b, 1]
    send_index, send_counts, received = None, [0] * cp, []
    for j in range(cp):
        flat = (layout.positions(j) + rows).reshape(-1)          # [b, n] -> [b*n] global index
        dest, slot = te_rank[flat], te_slot[flat]
        if j == rank:
            send_index = torch.argsort(dest * slots + slot)      # by TE rank, then TE slot
            send_counts = torch.bincount(dest, minlength=cp).tolist()
        received.append(slot[dest == rank].sort().values)        # what j sends here, in order
    recv_slots, recv_counts = torch.cat(received), [int(t.numel()) for t in received]
    return ThdPlan(send_index.to(device), send_counts, recv_slots.to(device), recv_counts, slots,
                   _cumulative(real, device), _cumulative(padded, device), max(padded))


def thd_work(layout: CpLayout) -> list[int]:
    """Per context rank, the causal (query, key) pairs of its queries in TE's thd layout (a
    query at offset t of its document attends t + 1 keys; padding none): the work TE's ring
    balances, summed over the rows."""
    places = _places(layout)
    work = torch.zeros(layout.cp, dtype=torch.long)
    return work.index_add_(0, places["rank"], places["offset"] + 1).tolist()
