"""The head-tail (zigzag) sequence layout of ring attention (Megatron-LM context parallelism).

With causal attention, a contiguous split would leave ring rank 0 with the least work (its queries
see only its own keys) and rank cp-1 with the most. Cutting the sequence in 2*cp chunks and giving
ring rank r chunks r and 2*cp-1-r (one from the head, one from the tail) balances it: every rank
then does the same work at every ring step (docs/design.md §14).

    s = 16, cp = 4: chunks of c = s / (2 cp) = 2 tokens

    chunk    0     1     2     3     4     5     6     7
    rank     0     1     2     3     3     2     1     0

    rank 0 holds chunks 0, 7 = positions [0 1 | 14 15]
    rank 1 holds chunks 1, 6 = positions [2 3 | 12 13]      (always chunk r, then chunk 2cp-1-r)

RoPE positions (zigzag_positions), labels and the loss mask follow the same permutation.
Pure index arithmetic, no process group.
"""
from __future__ import annotations

import torch

from megatron_sp.mesh import LayoutError


def check_zigzag_length(seq_len: int, cp: int) -> int:
    """The chunk length c = seq_len / (2 cp); a length that 2 cp does not divide is refused."""
    if cp < 1:
        raise LayoutError(f"the context parallel size must be at least 1, got {cp}.")
    n = 2 * cp
    if seq_len % n != 0:
        fit = max(n, (seq_len // n) * n)
        raise LayoutError(f"the zigzag layout of ring attention cuts the sequence in 2*cp = {n} "
                          f"chunks (cp = {cp}), so a sequence length of {seq_len} does not fit: "
                          f"use a multiple of {n}, e.g. {fit}.")
    return seq_len // n


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices ring rank `rank` holds: (rank, 2*cp-1-rank)."""
    if not 0 <= rank < cp:
        raise ValueError(f"ring rank {rank} is outside the context parallel group of size {cp}.")
    return rank, 2 * cp - 1 - rank


def zigzag_split(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of the full tensor t: [.., s, ..] -> [.., 2 s/(2 cp), ..] along `dim`,
    chunk `rank` then chunk 2*cp-1-rank (a new tensor; the input is untouched)."""
    c = check_zigzag_length(t.shape[dim], cp)
    head, tail = zigzag_chunks(cp, rank)
    return torch.cat([t.narrow(dim, head * c, c), t.narrow(dim, tail * c, c)], dim=dim)


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global position ids [2 c] (int64) of this rank's zigzag tokens (for RoPE and labels)."""
    c = check_zigzag_length(seq_len, cp)
    head, tail = zigzag_chunks(cp, rank)
    positions = torch.arange(seq_len, device=device)
    return torch.cat([positions[head * c:(head + 1) * c], positions[tail * c:(tail + 1) * c]])


def zigzag_merge(chunks_per_rank, cp: int, dim: int = 1) -> torch.Tensor:
    """The inverse of zigzag_split: every rank's [.., 2 c, ..] (in ring rank order) -> the full
    [.., 2 cp c, ..] tensor in sequence order (for tests and evaluation)."""
    if len(chunks_per_rank) != cp:
        raise ValueError(f"zigzag_merge needs one tensor per ring rank: {cp} ranks, "
                         f"{len(chunks_per_rank)} tensors.")
    chunks = [None] * (2 * cp)
    for rank, t in enumerate(chunks_per_rank):
        head, tail = zigzag_chunks(cp, rank)
        chunks[head], chunks[tail] = t.chunk(2, dim=dim)       # [.., 2c, ..] -> 2 x [.., c, ..]
    return torch.cat(chunks, dim=dim)
