"""The ring exchange of ring attention: every torch.distributed call of context parallelism.

The ranks of the context parallel group form a ring in group rank order 0..cp-1; each rank sends
to the next and receives from the previous one, all at once (Liu et al. 2023, ring attention;
Megatron-LM's --cp-comm-type p2p):

          kv_0            kv_1            kv_2            kv_3
    +-> rank 0 ------> rank 1 ------> rank 2 ------> rank 3 --+
    |                                                          |
    +------------------------- kv_3 <--------------------------+

    step i: rank r holds the block of rank (r - i) mod cp, and passes it on to rank r + 1

An exchange is posted (send_next_recv_prev, one dist.batch_isend_irecv of isend/irecv P2POps,
contiguous tensors) BEFORE the block computation and waited (RingExchange.wait) after it, so the
transfer of the next block overlaps the work on the current one. Forward sends key/value blocks
(tag KV_TAG); backward sends them again and, behind them, the travelling dk, dv accumulators
(GRAD_TAG), posted in that order on every rank, so they match also where tags are ignored (NCCL).
With cp = 2 the next and previous rank are the same; the tags keep the two messages apart.

Packed documents under Transformer Engine's context parallelism move the rows between our layout
and TE's thd layout (te_thd.py) by an all-to-all of uneven splits (thd_exchange, kind
"cp/thd all_to_all"; the rows all-to-all of expert parallelism, moe/comm.py).

A group that is None or of size 1 is a ring of one: the exchange returns the tensors themselves
without touching torch.distributed. Bytes sent are recorded under comm_stats kind "cp/ring_p2p".
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp import comm_stats
from megatron_sp.mesh import group_rank, group_size
from megatron_sp.moe.comm import all_to_all_rows

COMM_KIND = "cp/ring_p2p"
THD_KIND = "cp/thd all_to_all"
KV_TAG = 0
GRAD_TAG = 1


def ring_bytes(tensors) -> int:
    """Bytes one rank sends in one exchange of `tensors`."""
    return sum(t.numel() * t.element_size() for t in tensors)


def group_global_ranks(group) -> list[int]:
    """Global ranks of `group`'s members in group rank order (entry i is group rank i), what
    Transformer Engine's cp_global_ranks takes; [this rank] for None (a group of one)."""
    if group is None:
        return [dist.get_rank() if dist.is_initialized() else 0]
    ranks = dist.get_process_group_ranks(group)
    return sorted(ranks, key=lambda rank: dist.get_group_rank(group, rank))


def ring_neighbours(group) -> tuple[int, int]:
    """Global ranks of (next, previous) in the ring of `group` (group ranks r+1 and r-1 mod cp)."""
    cp, r = group_size(group), group_rank(group)
    return (dist.get_global_rank(group, (r + 1) % cp), dist.get_global_rank(group, (r - 1) % cp))


class RingExchange:
    """A posted exchange: wait() blocks until it is done and returns the received tensors."""

    def __init__(self, works, received, sent=()):
        # the sent tensors are held until the sends are done
        self._works, self._received, self._sent = works, received, sent

    def wait(self) -> tuple[torch.Tensor, ...]:
        for work in self._works:
            work.wait()
        self._works, self._sent = [], ()
        return self._received


def _post(sends, recvs, next_rank, prev_rank, group, tag):
    """isend every tensor of `sends` to next_rank and irecv `recvs` from prev_rank, as one batch."""
    ops = [dist.P2POp(dist.isend, t, next_rank, group, tag) for t in sends]
    ops += [dist.P2POp(dist.irecv, t, prev_rank, group, tag) for t in recvs]
    return dist.batch_isend_irecv(ops)


def send_next_recv_prev(tensors, group, tag: int = KV_TAG, shape=None) -> RingExchange:
    """Post: send `tensors` to the next ring rank, receive ones of the same dtype from the
    previous, of their shapes or, given, of `shape` each (the previous rank's block may hold
    another number of tokens: layouts whose keys travel only where attended).

    Returns the RingExchange to wait on (after the computation it overlaps). The sent tensors
    must stay untouched until then.
    """
    tensors = tuple(tensors)
    if group_size(group) == 1:
        return RingExchange([], tensors)
    sends = tuple(t.contiguous() for t in tensors)                       # gloo needs contiguous
    recvs = tuple(torch.empty_like(t) if shape is None else
                  torch.empty(shape, dtype=t.dtype, device=t.device) for t in sends)
    comm_stats.record(COMM_KIND, ring_bytes(sends))
    next_rank, prev_rank = ring_neighbours(group)
    works = _post(sends, recvs, next_rank, prev_rank, group, tag)
    return RingExchange(list(works), recvs, sends)


def thd_exchange(rows: torch.Tensor, group, send_counts: list[int], recv_counts: list[int]):
    """rows [sum(send_counts), ...] -> [sum(recv_counts), ...]: send_counts[j] rows to context
    rank j, recv_counts[j] from it (autograd: gradients go back by the reverse exchange)."""
    if group_size(group) == 1:
        return rows
    return all_to_all_rows(rows, group, send_counts, recv_counts, kind=THD_KIND)
