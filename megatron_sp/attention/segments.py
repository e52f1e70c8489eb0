"""Packed documents as segments, never masks (docs/design.md §14).

A row of packed documents is cut at its document starts: document i covers positions
[bounds[i], bounds[i+1]) of the row, bounds = [0, ..., s] (`document_bounds`, one host
synchronisation per step). Attention of one contiguous query range against one contiguous key
range is then a handful of dense blocks, never a mask (`range_segments`):

    key range wholly before the query range      at most ONE document meets both (it must cover
                                                 everything in between): one dense rectangle,
                                                 its queries from the range start to the
                                                 document's end, its keys from the document's
                                                 start to the range end; or nothing
    the same range (the causal diagonal)         each document's causal square
    keys after the queries (causal)              nothing
    not causal                                   each shared document's rectangle

         keys ->   |  doc 3  | doc 4 ...               queries of doc 4 in the query range see
    queries        +---------+----------               the keys of doc 4 in the key range, in
    (doc 4 | 5)    |    .    |##########               one dense block (#); doc 5 sees nothing
                   |    .    |   .                     of this key range

Without documents a row is one document, so the same code gives the plain pairs: a full
rectangle, or one causal square.

A `SegmentBatch` is what one kernel call (or one loop of calls) takes: segments of one kind
(causal squares or dense rectangles), their queries disjoint, at most PACK_TOKENS query tokens
(segments of ALONE_TOKENS and up, and every segment without documents, alone: kernels run them
on views), as (row, q0, q1, k0, k1) in the
LOCAL indices of the query and key tensors (row None: every row of the batch, as without
documents). For varlen kernels it packs the segments into flat token indices and cumulative
lengths (`packed`), built once per device and reused by every layer.

`ring_plan` plans a whole ring (context_parallel/ring.py) for one rank: per step the batches of
its zigzag chunks against the held kv block's chunks, and the work (query-key pairs computed) of
each step. It depends on the step's document ids and shapes only, so it is made once per step
(`PlanCache`) and serves every layer, forward and backward; the kv blocks travel without any
document index.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass, field

import torch

from megatron_sp.attention.documents import document_starts

Segment = tuple  # (row | None, q0, q1, k0, k1), local indices
PACK_TOKENS = 1 << 14  # query tokens per batch at most: what a varlen call packs (copies) at once
ALONE_TOKENS = 1 << 12  # a segment this long runs alone, on views (packing it would copy it)


def document_bounds(document_ids: torch.Tensor | None, seq_len: int | None = None):
    """[b, s] ids -> per row [0, start_1, ..., s]: the starts of its documents and s at the end
    (a document is a maximal run of equal ids). None (no documents) -> None. One host sync."""
    if document_ids is None:
        return None
    b, s = document_ids.shape
    rows, cols = document_starts(document_ids).nonzero(as_tuple=True)   # [num_docs] each
    bounds = [[] for _ in range(b)]
    for row, col in zip(rows.tolist(), cols.tolist()):
        bounds[row].append(col)
    for row in bounds:
        row.append(s)
    return bounds


def range_segments(bounds: list[int], q: tuple[int, int], k: tuple[int, int],
                   causal: bool) -> list[tuple[int, int, int, int, bool]]:
    """The segments (q0, q1, k0, k1, causal) of queries in range q = [q0, q1) against keys in
    range k = [k0, k1) of one row (global positions; bounds: the row's document_bounds).

    causal: the ranges must be equal (the diagonal: causal squares) or disjoint (keys before:
    dense, keys after: nothing). Every returned segment lies inside one document."""
    (q0, q1), (k0, k1) = q, k
    diagonal = causal and (q0, q1) == (k0, k1)
    if causal and not diagonal:
        if k0 >= q1:
            return []                                    # keys after every query
        if k1 > q0:
            raise ValueError(f"causal segments need equal or disjoint ranges, got queries "
                             f"[{q0}, {q1}) and keys [{k0}, {k1}).")
    first = max(bisect_right(bounds, q0), bisect_right(bounds, k0)) - 1   # doc of the later start
    last = min(bisect_left(bounds, q1), bisect_left(bounds, k1)) - 1      # last doc starting in both
    found = []
    for i in range(first, last + 1):
        d0, d1 = bounds[i], bounds[i + 1]
        a0, a1, b0, b1 = max(d0, q0), min(d1, q1), max(d0, k0), min(d1, k1)
        if a0 < a1 and b0 < b1:
            found.append((a0, a1, b0, b1, diagonal))
    return found


def segment_work(q0, q1, k0, k1, causal) -> int:
    """(query, key) pairs a segment computes: its area, or the causal square's lower triangle."""
    n = q1 - q0
    return n * (n + 1) // 2 if causal else n * (k1 - k0)


# Batches ----------------------------------------------------------------------------------------

@dataclass
class SegmentBatch:
    """Segments of one kind for one kernel call: causal squares or dense rectangles, queries
    disjoint within a row. segments: (row | None, q0, q1, k0, k1) local indices."""
    causal: bool
    segments: tuple
    _packed: dict = field(default_factory=dict, repr=False, compare=False)

    def rows(self, b: int):
        """(row slice, q0, q1, k0, k1) per segment: row None is every row (slice(0, b))."""
        for row, q0, q1, k0, k1 in self.segments:
            rows = slice(0, b) if row is None else slice(row, row + 1)
            yield rows, q0, q1, k0, k1

    def packed(self, b: int, nq: int, nk: int, device):
        """For varlen kernels, over the flattened [b*nq] queries and [b*nk] keys: (q_index [Tq],
        k_index [Tk] int64, cu_q, cu_k [num + 1] int32, max_q, max_k), one segment per row."""
        key = (b, nq, nk, str(device))
        if key not in self._packed:
            q_idx, k_idx, lq, lk = [], [], [0], [0]
            for row, q0, q1, k0, k1 in self.segments:
                for r in (range(b) if row is None else (row,)):
                    q_idx.append(torch.arange(r * nq + q0, r * nq + q1))
                    k_idx.append(torch.arange(r * nk + k0, r * nk + k1))
                    lq.append(lq[-1] + q1 - q0)
                    lk.append(lk[-1] + k1 - k0)
            sizes_q = [b - a for a, b in zip(lq, lq[1:])]
            sizes_k = [b - a for a, b in zip(lk, lk[1:])]
            self._packed[key] = (torch.cat(q_idx).to(device), torch.cat(k_idx).to(device),
                                 torch.tensor(lq, dtype=torch.int32, device=device),
                                 torch.tensor(lk, dtype=torch.int32, device=device),
                                 max(sizes_q), max(sizes_k))
        return self._packed[key]

    def work(self, b: int) -> int:
        """(query, key) pairs computed, over the b rows."""
        return sum(segment_work(q0, q1, k0, k1, self.causal) * (b if row is None else 1)
                   for row, q0, q1, k0, k1 in self.segments)


def _coalesce(dense: list) -> list:
    """Merge dense rectangles that share one side and touch on the other (a query chunk seeing
    both key chunks of a block, both query chunks seeing one key chunk): fewer, larger calls."""
    for first, second in (((3, 4), (1, 2)), ((1, 2), (3, 4))):   # (kept equal, made adjacent)
        dense.sort(key=lambda s: (s[0] is not None, s[0] or 0) + tuple(s[i] for i in first)
                   + (s[second[0]],))
        merged = []
        for seg in dense:
            last = merged[-1] if merged else None
            if (last is not None and last[0] == seg[0]
                    and all(last[i] == seg[i] for i in first)
                    and last[second[1]] == seg[second[0]]):
                grown = list(last)
                grown[second[1]] = seg[second[1]]
                merged[-1] = tuple(grown)
            else:
                merged.append(seg)
        dense = merged
    return dense


def _disjoint_batches(causal: bool, segments: list) -> list[SegmentBatch]:
    """Split segments into batches whose queries never overlap within a row (a batch's partial
    results are merged by index, once per query): each segment joins the first batch where its
    query range is free (per row, sorted ranges and a bisect; row None is every row)."""
    batches: list[tuple[list, dict]] = []          # (segments, {row: sorted [(q0, q1)]})
    for seg in segments:
        for members, taken in batches:
            if _free(taken, seg):
                break
        else:
            members, taken = [], {}
            batches.append((members, taken))
        members.append(seg)
        insort(taken.setdefault(seg[0], []), (seg[1], seg[2]))
    return [SegmentBatch(causal, tuple(part)) for members, _ in batches
            for part in _within_budget(members)]


def _within_budget(members: list) -> list[list]:
    """A batch cut into parts of at most PACK_TOKENS query tokens (per row), so a varlen call's
    packed copies stay bounded. Segments of every row (no documents) and segments of at least
    ALONE_TOKENS are parts alone: they run on views, nothing packed or copied."""
    alone = [[seg] for seg in members if seg[0] is None or seg[2] - seg[1] >= ALONE_TOKENS]
    parts, size = [[]], 0
    for seg in members:
        n = seg[2] - seg[1]
        if seg[0] is None or n >= ALONE_TOKENS:
            continue
        if parts[-1] and size + n > PACK_TOKENS:
            parts.append([])
            size = 0
        parts[-1].append(seg)
        size += n
    return alone + [part for part in parts if part]


def _free(taken: dict, seg) -> bool:
    """Whether seg's query range [q0, q1) overlaps nothing taken in its row (or, for row None,
    in any row; every row's ranges also meet row None's)."""
    rows = list(taken) if seg[0] is None else [seg[0], None]
    for row in rows:
        ranges = taken.get(row, ())
        i = bisect_left(ranges, (seg[1], seg[1]))
        if i < len(ranges) and ranges[i][0] < seg[2]:
            return False                           # the next range starts inside seg
        if i > 0 and ranges[i - 1][1] > seg[1]:
            return False                           # the previous range reaches into seg
    return True


def make_batches(segments: list) -> list[SegmentBatch]:
    """(row, q0, q1, k0, k1, causal) segments -> SegmentBatches: dense ones coalesced, each kind
    in as few batches as disjoint queries allow (causal squares first)."""
    causal = [s[:5] for s in segments if s[5]]
    dense = _coalesce([s[:5] for s in segments if not s[5]])
    return _disjoint_batches(True, causal) + _disjoint_batches(False, dense)


def ranges_batches(bounds, q_ranges, k_ranges, causal: bool) -> list[SegmentBatch]:
    """Batches of every (query range, key range) pair of contiguous ranges.

    q_ranges / k_ranges: [(global start, local start, length)] of the query / key tensors'
    contiguous pieces; bounds: document_bounds (None: no documents, one document per row)."""
    rows = [(None, [0, 1 << 62])] if bounds is None else list(enumerate(bounds))
    found = []
    for row, row_bounds in rows:
        for gq, lq, nq in q_ranges:
            for gk, lk, nk in k_ranges:
                for a0, a1, b0, b1, diag in range_segments(row_bounds, (gq, gq + nq),
                                                           (gk, gk + nk), causal):
                    found.append((row, a0 - gq + lq, a1 - gq + lq, b0 - gk + lk, b1 - gk + lk,
                                  diag))
    return make_batches(found)


# The ring's plan --------------------------------------------------------------------------------

@dataclass
class RingPlan:
    """One rank's ring: steps[i] the SegmentBatches of step i (its queries against the kv block
    of ring rank (rank - i) mod cp), work[i] the (query, key) pairs step i computes.

    send_index None: every rank's whole kv block travels. Otherwise (a layout where some keys
    are attended only at home, context_parallel/balance.py) only the travelling tokens do:
    send_index [b][m] this rank's local indices of them (padded with 0 to block_tokens[rank] per
    row), block_tokens[j] the tokens of ring rank j's travelling block; the segments of steps
    i >= 1 index those blocks."""
    cp: int
    rank: int
    steps: list
    work: list
    send_index: list | None = None
    block_tokens: list | None = None
    _index: dict = field(default_factory=dict, repr=False, compare=False)

    def travelling(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's travelling tokens of t [b, n, ...] -> [b, m, ...] (t itself when the
        whole block travels)."""
        if self.send_index is None:
            return t
        key = str(t.device)
        if key not in self._index:
            self._index[key] = torch.tensor(self.send_index, dtype=torch.int64, device=t.device)
        index = self._index[key]                                      # [b, m]
        index = index.view(*index.shape, *[1] * (t.dim() - 2)).expand(-1, -1, *t.shape[2:])
        return t.gather(1, index).contiguous()                        # [b, n, ..] -> [b, m, ..]

    def scatter_home(self, full: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """full [b, n, ...] plus the travelling block's [b, m, ...] added at its tokens."""
        if self.send_index is None:
            return full + block
        index = self._index[str(full.device)]
        index = index.view(*index.shape, *[1] * (full.dim() - 2)).expand(-1, -1, *full.shape[2:])
        return full.scatter_add(1, index, block)

    def received_shape(self, step: int, like: torch.Tensor) -> tuple | None:
        """The shape of the block arriving at `step` (ring rank (rank - step - 1) mod cp's), for
        like's [b, n, ...]; None when every block has like's shape."""
        if self.send_index is None:
            return None
        return (like.shape[0], self.block_tokens[(self.rank - step - 1) % self.cp],
                *like.shape[2:])


def zigzag_ranges(cp: int, rank: int, c: int):
    """[(global start, local start, length)] of ring rank `rank`'s two zigzag chunks."""
    return [(rank * c, 0, c), ((2 * cp - 1 - rank) * c, c, c)]


def ring_plan(bounds, b: int, seq_len: int, cp: int, rank: int, causal: bool) -> RingPlan:
    """The plan of ring rank `rank` (of cp) for rows of seq_len tokens in the zigzag layout.
    bounds: document_bounds of the full rows, or None."""
    c = seq_len // (2 * cp)
    mine = zigzag_ranges(cp, rank, c)
    steps, work = [], []
    for i in range(cp):
        batches = ranges_batches(bounds, mine, zigzag_ranges(cp, (rank - i) % cp, c), causal)
        steps.append(batches)
        work.append(sum(batch.work(b) for batch in batches))
    return RingPlan(cp, rank, steps, work)


class PlanCache:
    """Remembers the last plan per key: the document ids tensor (identity and version, as every
    layer of a step passes the same one) and the shapes. One plan, one host sync, per step."""

    def __init__(self, build):
        self._build = build
        self._key = self._ids = self._value = None

    def __call__(self, document_ids, *extra):
        key = (None if document_ids is None else (id(document_ids), document_ids._version),
               extra)
        if self._key != key or (document_ids is not None and self._ids is not document_ids):
            self._value = self._build(document_ids, *extra)
            self._key, self._ids = key, document_ids
        return self._value
