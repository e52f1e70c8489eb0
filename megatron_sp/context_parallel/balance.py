"""Which tokens each ring rank holds: the whole-row zigzag or the document-aware balanced layout
(docs/design.md §14). Pure index arithmetic from the full rows' document bounds, no process group:
every rank computes the same layout from the same ids.

The causal work of a query is the keys of its own document up to and including itself: a token
at offset t of its document costs t + 1 (query, key) pairs. The whole-row zigzag (chunks r and
2cp-1-r of the ROW on ring rank r) balances that for one document the length of the row, not
for a few long documents among many short ones. The balanced layout cuts per document instead:

    long documents   (work > share x the mean work per rank, and at least 2 cp tokens):
                     zigzag per document, chunks i and 2cp-1-i of THE DOCUMENT on ring rank i;
                     each rank gets 1/cp of its tokens and of its work
    short documents  whole, largest work first, each on the least-loaded rank that still has
                     room for it (tokens); one that fits nowhere whole is cut in contiguous
                     pieces over the ranks with room, least-loaded first

    row of 32, cp 2:   doc A (16 tokens)            | B (6)  | C (4) | D (4) | E (2)
    zigzag per doc:    A0 A1 A2 A3 -> rank 0 A0 A3, rank 1 A1 A2   (chunks of 4)
    short, whole:      B -> rank 0, C -> rank 1, D -> rank 1, E -> rank 0 ... (until 16 each)

Every rank holds the same number of tokens, n = s/cp per row (the ring's point-to-point
buffers, Ulysses' all-to-alls and the pipeline's activations keep one shape; nothing is padded):
the short documents fill each rank's room exactly, cutting the last ones if needed. A rank's
tokens are its pieces in increasing position order (local order = global order), so a row that
is one document gives exactly the whole-row zigzag. Positions, labels and the loss mask follow
the same gather (CpLayout.positions), so the loss is the same sum over the same tokens.

The share starts high (few documents split, few keys travel) and halves, down to 0 (every
document of 2cp tokens or more split), until the row's max/mean work is within BALANCE_GOAL;
the most balanced is kept if none is, and the whole-row zigzag where it is at least as balanced
(tiny rows, or a row that is one document: the zigzag exactly).

A short document held whole by one rank is never a key of another rank's queries: its keys and
values need no ring step (`travelling_tokens` counts the tokens that do; the rest is what a ring
sending only those would save).
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

import torch

from megatron_sp.attention.segments import (PlanCache, RingPlan, document_bounds, make_batches,
                                            ring_plan)
from megatron_sp.mesh import LayoutError

LAYOUTS = ("balanced", "zigzag")
LONG_SHARES = (0.5, 0.25, 0.12, 0.06, 0.03, 0.015, 0.0)   # tried in turn (module docstring)
BALANCE_GOAL = 1.02   # the first share whose layout is this balanced is taken


@dataclass(frozen=True)
class Piece:
    """A contiguous run of one document held by one rank: global positions [start, start+length),
    `offset` tokens after its document's start (document `doc` of the row)."""
    start: int
    length: int
    doc: int
    offset: int

    def work(self) -> int:
        """Causal (query, key) pairs of its queries: sum of (t + 1) over offsets t."""
        m, o = self.length, self.offset
        return m * o + m * (m + 1) // 2


@dataclass
class RowLayout:
    """One row: ranks[r] the pieces ring rank r holds, in increasing position (= local) order."""
    bounds: list
    ranks: list

    def local_starts(self, rank: int) -> list[int]:
        """The local index of each of rank's pieces in its [n] tokens."""
        starts, at = [], 0
        for piece in self.ranks[rank]:
            starts.append(at)
            at += piece.length
        return starts


@dataclass
class CpLayout:
    """Every row's layout over cp ring ranks (kind "balanced" or "zigzag")."""
    kind: str
    cp: int
    seq_len: int
    rows: list
    _positions: dict = field(default_factory=dict, repr=False)
    derived: dict = field(default_factory=dict, repr=False, compare=False)
    """What other modules compute from this layout once (e.g. TE's thd places, te_thd.py): the
    planner caches the layout per step, so the model and every layer share it."""

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """Global positions [b, s/cp] (int64) of ring rank `rank`'s tokens, per row, local order."""
        key = (rank, str(device))
        if key not in self._positions:
            per_row = [torch.cat([torch.arange(p.start, p.start + p.length)
                                  for p in row.ranks[rank]]) for row in self.rows]
            self._positions[key] = torch.stack(per_row).to(device)             # [b, n]
        return self._positions[key]

    def work(self) -> list[int]:
        """Per ring rank, the causal (query, key) pairs of its queries over every row."""
        return [sum(p.work() for row in self.rows for p in row.ranks[r]) for r in range(self.cp)]

    def balance(self) -> float:
        """max / mean of work(): 1.0 is perfect balance."""
        return work_balance(self.work())

    def travelling_tokens(self) -> list[int]:
        """Per ring rank, its tokens some OTHER rank's queries attend (a piece whose document has
        a later piece on another rank), summed over rows: the keys and values the ring sends
        (layout_ring_plan's compact blocks, before padding rows to one length). The rest (short
        documents held whole) stays home."""
        out = [0] * self.cp
        for row in self.rows:
            for r, moving in enumerate(_later_elsewhere(row)):
                out[r] += sum(p.length for p in row.ranks[r] if p.start in moving)
        return out


def work_balance(work) -> float:
    """max / mean of per-rank work (1.0 when there is none)."""
    total = sum(work)
    return max(work) * len(work) / total if total else 1.0


def _check(seq_len: int, cp: int) -> int:
    if cp < 1 or seq_len % (2 * cp):
        raise LayoutError(f"a context parallel layout over cp = {cp} ring ranks needs a sequence "
                          f"length that 2*cp divides, got {seq_len}.")
    return seq_len // cp


def _row_bounds(bounds, b: int, seq_len: int):
    if bounds is None:
        return [[0, seq_len] for _ in range(b)]
    if len(bounds) != b or any(row[-1] != seq_len or row[0] != 0 for row in bounds):
        raise ValueError(f"document bounds must cover {b} rows of {seq_len} tokens.")
    return bounds


def _cut(bounds: list, ranges_per_rank: list) -> list:
    """Pieces of each rank's contiguous (start, length) ranges, cut at document bounds."""
    out = []
    for ranges in ranges_per_rank:
        pieces = []
        for start, length in sorted(ranges):
            at, end = start, start + length
            while at < end:
                doc = bisect_right(bounds, at) - 1
                stop = min(end, bounds[doc + 1])
                pieces.append(Piece(at, stop - at, doc, at - bounds[doc]))
                at = stop
        out.append(pieces)
    return out


def zigzag_row(bounds: list, seq_len: int, cp: int) -> RowLayout:
    """The whole-row zigzag: ring rank r holds chunks r and 2cp-1-r of the row."""
    c = seq_len // (2 * cp)
    ranges = [[(r * c, c), ((2 * cp - 1 - r) * c, c)] for r in range(cp)]
    return RowLayout(bounds, _cut(bounds, ranges))


def _zigzag_document(d0: int, length: int, cp: int, tokens: list) -> list[list]:
    """(start, length) ranges per rank of one long document split in 2cp chunks, rank i chunks i
    and 2cp-1-i; the length % 2cp tokens left over go one each to the ranks holding the fewest
    tokens so far (head chunk first, then tail), so the ranks' totals stay within one token."""
    base, extra = divmod(length, 2 * cp)
    sizes = [base] * (2 * cp)
    order = sorted(range(cp), key=lambda r: (tokens[r], r))
    for k in range(extra):
        r = order[k % cp]
        sizes[r if k < cp else 2 * cp - 1 - r] += 1
    starts = [d0]
    for size in sizes:
        starts.append(starts[-1] + size)
    return [[(starts[i], sizes[i]), (starts[2 * cp - 1 - i], sizes[2 * cp - 1 - i])]
            for i in range(cp)]


def balanced_row(bounds: list, seq_len: int, cp: int) -> RowLayout:
    """The document-aware balanced layout of one row (module docstring): the first of
    LONG_SHARES within BALANCE_GOAL, else the most balanced; the whole-row zigzag where that is
    at least as balanced (a tiny row)."""
    best = None
    for share in LONG_SHARES:
        row = _balanced_row(bounds, seq_len, cp, share)
        balance = _row_balance(row)
        if best is None or balance < best[0]:
            best = (balance, row)
        if balance <= BALANCE_GOAL:
            break
    zigzag = zigzag_row(bounds, seq_len, cp)
    return zigzag if _row_balance(zigzag) <= best[0] else best[1]


def _row_balance(row: RowLayout) -> float:
    return work_balance([sum(p.work() for p in pieces) for pieces in row.ranks])


def _balanced_row(bounds: list, seq_len: int, cp: int, share: float) -> RowLayout:
    """Documents with work above `share` x the mean per rank split in zigzag, the rest whole."""
    n = seq_len // cp
    lengths = [e - s for s, e in zip(bounds, bounds[1:])]
    total = sum(m * (m + 1) // 2 for m in lengths)
    long_work = share * total / cp
    ranges = [[] for _ in range(cp)]
    tokens, work = [0] * cp, [0] * cp
    short = []
    for doc, m in enumerate(lengths):
        if m >= 2 * cp and m * (m + 1) // 2 > long_work:
            for r, parts in enumerate(_zigzag_document(bounds[doc], m, cp, tokens)):
                ranges[r] += [part for part in parts if part[1]]
                tokens[r] += sum(size for _, size in parts)
                work[r] += sum(Piece(s, size, doc, s - bounds[doc]).work() for s, size in parts)
        else:
            short.append(doc)
    if max(tokens) > n:      # cannot happen: the long documents' tokens stay within one per rank
        raise AssertionError(f"balanced layout overfilled a rank: {tokens} > {n}")
    short.sort(key=lambda doc: (-lengths[doc], doc))
    for doc in short:
        at, left = bounds[doc], lengths[doc]
        room = [r for r in range(cp) if n - tokens[r] >= left]
        if room:                                 # whole, on the least-loaded rank with room
            r = min(room, key=lambda r: (work[r], r))
            _place(ranges, tokens, work, r, at, left, 0)
            continue
        offset = 0                               # fits nowhere whole: contiguous pieces
        while left:
            r = min((r for r in range(cp) if tokens[r] < n), key=lambda r: (work[r], r))
            size = min(left, n - tokens[r])
            _place(ranges, tokens, work, r, at + offset, size, offset)
            offset, left = offset + size, left - size
    return RowLayout(bounds, _cut(bounds, ranges))


def _place(ranges, tokens, work, r, start, size, offset):
    ranges[r].append((start, size))
    tokens[r] += size
    work[r] += size * offset + size * (size + 1) // 2


def cp_layout(kind: str, bounds, b: int, seq_len: int, cp: int) -> CpLayout:
    """The layout of b rows of seq_len tokens over cp ring ranks. bounds: the rows' document
    bounds (attention/segments.document_bounds: [0, starts..., s] per row), None for no documents
    (one document per row: both kinds give the whole-row zigzag)."""
    if kind not in LAYOUTS:
        raise ValueError(f"unknown context parallel layout {kind!r}: use one of {LAYOUTS}.")
    _check(seq_len, cp)
    rows = _row_bounds(bounds, b, seq_len)
    build = balanced_row if kind == "balanced" and bounds is not None else zigzag_row
    return CpLayout(kind if bounds is not None else "zigzag", cp, seq_len,
                    [build(list(row), seq_len, cp) for row in rows])


def causal_pairs(bounds_row: list, positions) -> int:
    """Brute force, for tests: the causal (query, key) pairs of the queries at `positions`
    (one row; keys of the same document up to and including the query)."""
    return sum(p - bounds_row[bisect_right(bounds_row, p) - 1] + 1 for p in positions)


# The ring's plan under a layout -----------------------------------------------------------------

def _later_elsewhere(row: RowLayout) -> list[set]:
    """Per rank, the starts of its pieces that another rank's queries attend: a later piece of
    the same document lies on another rank."""
    last = {}                                       # doc -> {rank: its last piece's start}
    for r, pieces in enumerate(row.ranks):
        for p in pieces:
            last.setdefault(p.doc, {})[r] = max(last.get(p.doc, {}).get(r, -1), p.start)
    return [{p.start for p in pieces
             if max((s for q, s in last[p.doc].items() if q != r), default=-1) > p.start}
            for r, pieces in enumerate(row.ranks)]


def _pieces_by_doc(row: RowLayout, rank: int, travelling: set | None = None) -> dict:
    """doc -> [(piece, local start)] of `rank`'s pieces in one row; with `travelling` (the
    starts of its travelling pieces) only those, at their index in the travelling block."""
    out, at = {}, 0
    for piece, local in zip(row.ranks[rank], row.local_starts(rank)):
        if travelling is None:
            out.setdefault(piece.doc, []).append((piece, local))
        elif piece.start in travelling:
            out.setdefault(piece.doc, []).append((piece, at))
            at += piece.length
    return out


def _send_index(row: RowLayout, rank: int, travelling: set, width: int) -> list[int]:
    """Local indices of `rank`'s travelling tokens in one row, padded with 0 to `width`."""
    index = [i for piece, local in zip(row.ranks[rank], row.local_starts(rank))
             if piece.start in travelling for i in range(local, local + piece.length)]
    return index + [0] * (width - len(index))


def _pair_segments(row_index: int, queries: dict, keys: dict, same_rank: bool, causal: bool):
    """(row, q0, q1, k0, k1, causal) segments of one rank's query pieces against the held
    rank's key pieces, document by document: a piece against itself is its causal square, a key
    piece wholly before a query piece one dense rectangle, a later one nothing."""
    found = []
    for doc, query_pieces in queries.items():
        for kp, lk in keys.get(doc, ()):
            for qp, lq in query_pieces:
                if causal and same_rank and kp is qp:
                    found.append((row_index, lq, lq + qp.length, lk, lk + kp.length, True))
                elif not causal or kp.start + kp.length <= qp.start:
                    found.append((row_index, lq, lq + qp.length, lk, lk + kp.length, False))
    return found


def layout_ring_plan(layout: CpLayout, rank: int, causal: bool = True,
                     compact: bool = True) -> RingPlan:
    """Ring rank `rank`'s RingPlan (attention/segments.py) when the ranks hold `layout`'s tokens:
    step i pairs its pieces with those of ring rank (rank - i) mod cp, document by document
    (pieces never straddle a document, so every pair is a causal square, one dense rectangle or
    nothing). Local indices are the ranks' own token orders (CpLayout.positions).

    compact (causal, cp > 1): only the travelling tokens go round the ring (the plan's
    send_index / block_tokens; the segments of steps >= 1 index those blocks): a piece no other
    rank attends, like a short document held whole, stays home."""
    cp, b = layout.cp, len(layout.rows)
    compact = compact and causal and cp > 1
    travelling = [_later_elsewhere(row) if compact else None for row in layout.rows]
    mine = [_pieces_by_doc(row, rank) for row in layout.rows]
    steps, work = [], []
    for i in range(cp):
        held = (rank - i) % cp
        found = []
        for row_index, row in enumerate(layout.rows):
            if held == rank:
                keys = mine[row_index]
            else:
                keys = _pieces_by_doc(row, held,
                                      travelling[row_index][held] if compact else None)
            found += _pair_segments(row_index, mine[row_index], keys, held == rank, causal)
        batches = make_batches(found)
        steps.append(batches)
        work.append(sum(batch.work(b) for batch in batches))
    if not compact:
        return RingPlan(cp, rank, steps, work)
    block_tokens = [max(1, max(sum(p.length for p in row.ranks[j] if p.start in moving[j])
                               for row, moving in zip(layout.rows, travelling)))
                    for j in range(cp)]          # at least one token: no empty message
    send_index = [_send_index(row, rank, moving[rank], block_tokens[rank])
                  for row, moving in zip(layout.rows, travelling)]
    return RingPlan(cp, rank, steps, work, send_index, block_tokens)


class LayoutPlanner:
    """The step's layout and this ring rank's plan, made once per step from the FULL rows'
    document ids and shared by every layer (a model holds one): kind "balanced" or "zigzag",
    cp ring ranks, this rank's ring rank. Without documents both kinds are the whole-row zigzag
    and the plan is attention/segments.ring_plan's."""

    def __init__(self, kind: str, cp: int, rank: int):
        if kind not in LAYOUTS:
            raise ValueError(f"unknown context parallel layout {kind!r}: use one of {LAYOUTS}.")
        self.kind, self.cp, self.rank = kind, cp, rank
        self._layouts = PlanCache(self._layout)
        self._plans = PlanCache(self._plan)
        self._derived = {}

    def uses_layout(self, document_ids) -> bool:
        """Whether the tokens are not the whole-row zigzag (balanced, with documents)."""
        return self.kind == "balanced" and document_ids is not None and self.cp > 1

    def layout(self, document_ids, b: int, seq_len: int) -> CpLayout:
        """The step's CpLayout (cached on the ids tensor)."""
        return self._layouts(document_ids, b, seq_len)

    def _layout(self, document_ids, b, seq_len):
        return cp_layout(self.kind, document_bounds(document_ids), b, seq_len, self.cp)

    def plan(self, document_ids, b: int, n: int, causal: bool):
        """This rank's RingPlan for rows of n tokens per ring rank (cached on the ids tensor)."""
        return self._plans(document_ids, b, n, causal)

    def cached(self, key: str, build, document_ids, *extra):
        """build(document_ids, *extra) once per step and `key`, shared by every layer holding
        this planner (e.g. TE's thd plan of the step's layout)."""
        cache = self._derived.get(key)
        if cache is None:
            cache = self._derived[key] = PlanCache(build)
        return cache(document_ids, *extra)

    def _plan(self, document_ids, b, n, causal):
        if not self.uses_layout(document_ids):
            return ring_plan(document_bounds(document_ids), b, n * self.cp, self.cp, self.rank,
                             causal)
        return layout_ring_plan(self.layout(document_ids, b, n * self.cp), self.rank, causal)


def estimate_balance(lengths, seq_len: int, cp: int, kind: str = "balanced") -> dict:
    """The cp_work_balance a document-length distribution gives: `lengths` (document lengths in
    corpus order, e.g. a .idx's document sizes or samples of a distribution) packed into rows of
    seq_len tokens as the GPT dataset packs them (a document continues into the next row), each
    row laid out by `kind`. Returns {"rows", "mean", "max"} of the rows' max/mean work (a step
    of one row per micro-batch sees the max; many rows summed come near the mean)."""
    rows, row, used = [], [0], 0
    for m in lengths:
        while m > 0:
            take = min(m, seq_len - used)
            used += take
            m -= take
            row.append(used)
            if used == seq_len:
                rows.append(row)
                row, used = [0], 0
    if not rows:
        raise ValueError(f"estimate_balance needs at least {seq_len} tokens of documents, got "
                         f"{used}.")
    figures = [cp_layout(kind, [bounds], 1, seq_len, cp).balance() for bounds in rows]
    return {"rows": len(figures), "mean": sum(figures) / len(figures), "max": max(figures)}
