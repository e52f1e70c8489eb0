"""The two Ulysses all-to-alls (DeepSpeed-Ulysses, Jacobs et al. 2023), as autograd functions.

Outside attention every sp rank holds a contiguous chunk of the sequence with all (tp-local)
heads; inside attention it holds the whole sequence for 1/sp of the heads:

    seq->head   [b, s/sp, n, d]  ->  [b, s, n/sp, d]   scatter heads, gather sequence
    head->seq   [b, s, n/sp, d]  ->  [b, s/sp, n, d]   scatter sequence, gather heads

Rank r of the sp group holds sequence positions [r*s/sp, (r+1)*s/sp) and, inside attention, heads
[r*n/sp, (r+1)*n/sp). The two are exact inverses, so each one's backward is the other.

q, k and v travel together in ONE seq->head all-to-all (as DeepSpeed-Ulysses and Megatron's
context-parallel a2a do): each destination rank's q, k and v heads are packed next to each other
in one buffer, so an attention layer runs two all-to-alls forward (qkv, out) and two backward,
with the same bytes as three separate ones:

    pack        q [b, s/sp, n_q, d], k, v [b, s/sp, n_kv, d]  ->  [sp, b, s/sp, (n_q + 2 n_kv)/sp, d]
    all-to-all  chunk j to rank j                               (one call)
    unpack      -> q [b, s, n_q/sp, d], k, v [b, s, n_kv/sp, d]

Every torch.distributed call of Ulysses lives in this module. A group that is None or of size 1
makes both functions the identity without touching torch.distributed. Each all-to-all records
the bytes this rank sends, (sp-1)/sp of its local tensor, under comm_stats kind "sp/all_to_all"
(backward all-to-alls are counted too, as they are sent).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp import comm_stats
from megatron_sp.mesh import group_size

COMM_KIND = "sp/all_to_all"


def all_to_all_bytes(x: torch.Tensor, sp: int) -> int:
    """Bytes one rank sends in an all-to-all of its local tensor x: (sp-1)/sp of it."""
    return (sp - 1) * x.numel() * x.element_size() // sp


def _all_to_all(chunks: torch.Tensor, group) -> torch.Tensor:
    """Exchange chunks[j] with rank j of `group`; result[i] is what rank i sent to us.

    `chunks` is [sp, ...] and contiguous (gloo requires it), one equal chunk per destination rank.
    """
    out = torch.empty_like(chunks)
    comm_stats.record(COMM_KIND, all_to_all_bytes(chunks, chunks.shape[0]))
    dist.all_to_all_single(out, chunks, group=group)
    return out


def _check_divisible(what: str, size: int, sp: int):
    if size % sp != 0:
        raise ValueError(f"Ulysses all-to-all: {what} = {size} is not divisible by the sequence "
                         f"parallel size sp = {sp}.")


def _seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s/sp, n, d] -> [b, s, n/sp, d] over `group` (no autograd)."""
    sp = group_size(group)
    if sp == 1:
        return x
    b, s_local, n, d = x.shape
    _check_divisible("the number of heads", n, sp)
    # [b, s/sp, n, d] -> [b, s/sp, sp, n/sp, d]: head group j goes to rank j
    x = x.reshape(b, s_local, sp, n // sp, d)
    # -> [sp, b, s/sp, n/sp, d]: one contiguous chunk per destination rank
    chunks = x.permute(2, 0, 1, 3, 4).contiguous()
    # received[i] = sequence chunk i of our head group: [sp, b, s/sp, n/sp, d]
    received = _all_to_all(chunks, group)
    # -> [b, sp, s/sp, n/sp, d] -> [b, s, n/sp, d]: sequence chunks in rank order
    return received.permute(1, 0, 2, 3, 4).reshape(b, sp * s_local, n // sp, d)


def _head_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s, n/sp, d] -> [b, s/sp, n, d] over `group` (no autograd)."""
    sp = group_size(group)
    if sp == 1:
        return x
    b, s, n_local, d = x.shape
    _check_divisible("the sequence length", s, sp)
    # [b, s, n/sp, d] -> [b, sp, s/sp, n/sp, d]: sequence chunk j goes to rank j
    x = x.reshape(b, sp, s // sp, n_local, d)
    # -> [sp, b, s/sp, n/sp, d]: one contiguous chunk per destination rank
    chunks = x.transpose(0, 1).contiguous()
    # received[i] = head group i of our sequence chunk: [sp, b, s/sp, n/sp, d]
    received = _all_to_all(chunks, group)
    # -> [b, s/sp, sp, n/sp, d] -> [b, s/sp, n, d]: head groups in rank order
    return received.permute(1, 2, 0, 3, 4).reshape(b, s // sp, sp * n_local, d)


def _seq_to_head_packed(tensors, group):
    """[b, s/sp, n_i, d] each -> [b, s, n_i/sp, d] each, in one all-to-all (no autograd)."""
    sp = group_size(group)
    b, s_local, _, d = tensors[0].shape
    for t in tensors:
        _check_divisible("the number of heads", t.shape[2], sp)
    # Each [b, s/sp, n_i, d] -> [b, s/sp, sp, n_i/sp, d] -> [sp, b, s/sp, n_i/sp, d]; the cat along
    # the head dim writes one contiguous buffer [sp, b, s/sp, sum(n_i)/sp, d]: per rank its heads
    chunks = torch.cat([t.reshape(b, s_local, sp, t.shape[2] // sp, d).permute(2, 0, 1, 3, 4)
                        for t in tensors], dim=3)
    # received[i] = sequence chunk i of our heads of every tensor: [sp, b, s/sp, sum(n_i)/sp, d]
    received = _all_to_all(chunks, group)
    parts = received.split([t.shape[2] // sp for t in tensors], dim=3)
    # each [sp, b, s/sp, n_i/sp, d] -> [b, sp, s/sp, n_i/sp, d] -> [b, s, n_i/sp, d], contiguous
    # (with b = 1 the reshape alone would be a view with gaps between the heads)
    return tuple(p.permute(1, 0, 2, 3, 4).reshape(b, sp * s_local, p.shape[3], d).contiguous()
                 for p in parts)


def _head_to_seq_packed(tensors, group):
    """[b, s, n_i/sp, d] each -> [b, s/sp, n_i, d] each, in one all-to-all (no autograd)."""
    sp = group_size(group)
    b, s, _, d = tensors[0].shape
    _check_divisible("the sequence length", s, sp)
    # Each [b, s, n_i/sp, d] -> [b, sp, s/sp, n_i/sp, d] -> [sp, b, s/sp, n_i/sp, d]; cat along the
    # head dim: one contiguous buffer [sp, b, s/sp, sum(n_i)/sp, d], chunk j = sequence chunk j
    chunks = torch.cat([t.reshape(b, sp, s // sp, t.shape[2], d).transpose(0, 1) for t in tensors],
                       dim=3)
    # received[i] = head group i (of every tensor) of our sequence chunk
    received = _all_to_all(chunks, group)
    parts = received.split([t.shape[2] for t in tensors], dim=3)
    # each [sp, b, s/sp, n_i/sp, d] -> [b, s/sp, sp, n_i/sp, d] -> [b, s/sp, n_i, d]
    return tuple(p.permute(1, 2, 0, 3, 4).reshape(b, s // sp, sp * p.shape[3], d) for p in parts)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad, ctx.group), None


class _SeqToHeadPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return _seq_to_head_packed(tensors, group)

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + _head_to_seq_packed(grads, ctx.group)


class _HeadToSeqPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return _head_to_seq_packed(tensors, group)

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + _seq_to_head_packed(grads, ctx.group)


def seq_to_head_qkv_all_to_all(q, k, v, group):
    """q [b, s/sp, n_q, d], k, v [b, s/sp, n_kv, d] -> [b, s, n_q/sp, d], [b, s, n_kv/sp, d] x 2.

    The same result as three seq_to_head_all_to_all calls, in ONE all-to-all of a packed buffer.
    Backward is head_to_seq_qkv_all_to_all (also one all-to-all).
    """
    if group_size(group) == 1:
        return q, k, v
    return _SeqToHeadPacked.apply(group, q, k, v)


def head_to_seq_qkv_all_to_all(q, k, v, group):
    """The exact inverse of seq_to_head_qkv_all_to_all: [b, s, n_i/sp, d] -> [b, s/sp, n_i, d]."""
    if group_size(group) == 1:
        return q, k, v
    return _HeadToSeqPacked.apply(group, q, k, v)


def seq_to_head_all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Ulysses seq->head all-to-all: [b, s/sp, n, d] -> [b, s, n/sp, d].

    x is this rank's contiguous sequence chunk with all n heads; the result is the full sequence
    for heads [r*n/sp, (r+1)*n/sp) of sp rank r. Backward is the head->seq all-to-all.
    """
    if group_size(group) == 1:
        return x
    return _SeqToHead.apply(x, group)


def head_to_seq_all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Ulysses head->seq all-to-all: [b, s, n/sp, d] -> [b, s/sp, n, d], the inverse of seq->head.

    Backward is the seq->head all-to-all.
    """
    if group_size(group) == 1:
        return x
    return _HeadToSeq.apply(x, group)
