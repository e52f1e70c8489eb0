"""The ring's balanced layout of packed documents in megatron_sp.hf (docs/design.md §14, §15).

Under a ring (cp > 1) with packed documents, shard_batch lays the tokens out as the Megatron side
does by default (context_parallel.balance, "balanced": every ring rank the same causal attention
work), computed from the FULL rows' document ids. The attention layers see only this rank's
position_ids: gathered over sp and then cp (`gather_layout_order`) they are the rows' positions
in LAYOUT order (ring rank 0's tokens, then ring rank 1's, ...), and per-document positions do
not say where each token sat in its row. So shard_batch remembers, in this process, each layout
it made: keyed by those gathered positions, the rows' positions in sequence order (`remember`).
The attention looks its gathered positions up once per step (`recall`, one host copy of
[b, s] int64) and plans the ring from the rows' document ids; a row without documents is the
whole-row zigzag under either (cp_layout keeps it), so only batches with documents are looked up.

A lookup that misses (positions not cut by shard_batch in this process, or forgotten: the last
KEEP layouts are kept) is refused by the attention, never guessed.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from megatron_sp.attention.segments import document_bounds

KEEP = 64                      # layouts remembered per process (micro-batches between cut and use)
_MADE: OrderedDict = OrderedDict()


def ring_layout(document_ids: torch.Tensor, cp: int):
    """The balanced CpLayout over cp ring ranks of full rows [b, s] whose document ids
    (megatron_sp.hf.batch.document_ids) are given."""
    from megatron_sp.context_parallel.balance import cp_layout
    b, s = document_ids.shape
    return cp_layout("balanced", document_bounds(document_ids), b, s, cp)


def layout_index(layout, device=None) -> torch.Tensor:
    """[b, s] global positions of every token in layout order: ring rank 0's [b, s/cp], then
    ring rank 1's, ... (each cut contiguously over its sp ranks: the order of
    gather_layout_order)."""
    return torch.cat([layout.positions(r, device) for r in range(layout.cp)], dim=1)   # [b, s]


def _key(gathered: torch.Tensor) -> tuple:
    host = gathered.detach().to("cpu", torch.int64).contiguous()
    return (tuple(host.shape), hash(host.numpy().tobytes())), host


def remember(full_positions: torch.Tensor, layout) -> None:
    """Record that the rows full_positions [b, s] were laid out by `layout`."""
    full = full_positions.detach().to("cpu", torch.int64)
    gathered = full.gather(1, layout_index(layout))                     # [b, s], layout order
    key, host = _key(gathered)
    _MADE[key] = (host, full)
    _MADE.move_to_end(key)
    while len(_MADE) > KEEP:
        _MADE.popitem(last=False)


def recall(gathered: torch.Tensor) -> torch.Tensor | None:
    """The rows' positions [b, s] in sequence order for positions gathered in layout order
    (on gathered's device), or None when this process's shard_batch did not lay them out."""
    key, host = _key(gathered)
    found = _MADE.get(key)
    if found is None or not torch.equal(found[0], host):
        return None
    return found[1].to(gathered.device)
