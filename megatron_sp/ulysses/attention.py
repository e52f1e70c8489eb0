"""Ulysses sequence-parallel attention (DeepSpeed-Ulysses; docs/design.md §4).

Each sp rank holds a contiguous chunk s/sp of the sequence with all h_l query and g_l key/value
heads of its tp rank. One seq->head all-to-all of q, k and v packed together gives it the whole
sequence for h_l/sp query heads; any local attention backend then runs causal attention over the
full sequence (so there is no causal load imbalance), and a head->seq all-to-all of the output
returns to sequence chunks. Two all-to-alls per layer forward (qkv, out), two more in backward
(fuse_qkv=False: one per tensor, four and four, the same bytes).

Key/value heads (GQA), per tp rank: if g_l % sp == 0 they are split like the query heads; if
sp % g_l == 0 each is replicated sp/g_l times first (repeat_interleave, so sp rank r receives key/
value head floor(r*g_l/sp), the group of its query heads; autograd sums the replicas' gradients);
anything else is refused.

Head chunks (head_chunks = N > 1, UPipe's idea: Ghadia et al. 2026, "Untied Ulysses"): the
seq->head all-to-all, the local attention (a ring's too) and the head->seq all-to-all run over N
groups of heads in turn, so q, k, v, out and the exchange buffers at [b, s, heads/(sp N), d] are
live for one chunk at a time. Chunk c sends sp rank r the heads that plain Ulysses over sp*N ranks
would give rank r*N + c, so sp rank r still ends up with its own heads and the result is the
plain one. Each chunk is one activation checkpoint whose saved input is that chunk's local
[b, s/sp, heads/N, d] slices (chunks that share key/value heads keep one copy of k, v between
them): its all-to-alls and attention are recomputed in backward (chunks in
reverse order, the same on every rank). GQA groups stay whole: with q_r = h_l/sp query and
kv_r = max(g_l, sp)/sp key/value heads per sp rank (after replication), a chunk holds kv_r/N whole
key/value heads with all their query heads (kv_r % N == 0, the same bytes as plain Ulysses), or,
with fewer key/value heads than chunks (N % kv_r == 0, q_r % N == 0: Llama-8B at tp 8), one
key/value head with an equal share of its query heads, that head then sent with each of its
N/kv_r chunks (k, v bytes x N/kv_r). Any other N is refused (head_chunk_problem).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from megatron_sp.memory.recompute import checkpoint
from megatron_sp.mesh import (LayoutError, group_size, head_layout_problem,
                              sequence_layout_problem)
from megatron_sp.ulysses.comm import (head_to_seq_all_to_all, seq_to_head_all_to_all,
                                      seq_to_head_qkv_all_to_all)


def check_ulysses_layout(num_heads: int, num_kv_heads: int, tp: int, sp: int) -> None:
    """Refuse (LayoutError, a ValueError) head counts that tp x Ulysses sp cannot split.

    Rules (megatron_sp.mesh.head_layout_problem): h % (tp*sp) == 0; g % tp == 0 and h % g == 0;
    with g_l = g/tp per tp rank, either g_l % sp == 0 (split) or sp % g_l == 0 (each key/value
    head replicated sp/g_l times).
    """
    problem = head_layout_problem(num_heads, num_kv_heads, tp, sp)
    if problem:
        raise LayoutError(problem)


def check_seq_divisible(seq_length: int, sp: int, tp: int = 1, sequence_parallel: bool = False):
    """Refuse a sequence length that sp (times tp with --sequence-parallel) does not divide."""
    problem = sequence_layout_problem(seq_length, sp, tp, sequence_parallel, what="sequence length")
    if problem:
        raise LayoutError(problem)


def head_chunk_problem(num_heads: int, num_kv_heads: int, sp: int, chunks: int) -> str | None:
    """Why `chunks` head chunks do not fit num_heads query and num_kv_heads key/value heads (per tp
    rank) over Ulysses sp, or None when they do (the sp layout itself is check_ulysses_layout's).

    Rule: with q_r = h/sp query and kv_r = max(g, sp)/sp key/value heads per sp rank, q_r % N == 0
    and (kv_r % N == 0 or N % kv_r == 0): plain Ulysses over sp*N ranks.
    """
    q_r, kv_r = num_heads // sp, max(num_kv_heads, sp) // sp

    def fits(n):
        return q_r % n == 0 and (kv_r % n == 0 or n % kv_r == 0)
    if chunks >= 1 and fits(chunks):
        return None
    choices = ", ".join(str(n) for n in range(1, q_r + 1) if fits(n))
    return (f"--ulysses-head-chunks {chunks} does not fit {num_heads} query and {num_kv_heads} "
            f"key/value heads per tp rank over sp = {sp}: each sp rank holds {q_r} query and "
            f"{kv_r} key/value heads, and a chunk must hold whole key/value heads with all their "
            f"query heads or an equal share of one key/value head's query heads; use one of "
            f"{choices}.")


def check_head_chunks(num_heads: int, num_kv_heads: int, sp: int, chunks: int) -> None:
    """Refuse (LayoutError) head chunks that do not fit the heads per tp rank."""
    problem = head_chunk_problem(num_heads, num_kv_heads, sp, chunks)
    if problem:
        raise LayoutError(problem)


def head_chunk_index(num_heads: int, sp: int, chunks: int, chunk: int, device=None) -> torch.Tensor:
    """The local heads (of [b, s/sp, num_heads, d]) that head chunk `chunk` sends, in send order.

    Destination sp rank r gets the heads plain Ulysses over sp*chunks ranks gives rank
    r*chunks + chunk: per = max(n, sp*chunks) / (sp*chunks) heads each, a head repeated
    sp*chunks/n times when there are fewer (as expand_kv_heads does for sp). chunks = 1 is
    plain Ulysses (expand_kv_heads' order).
    """
    ranks = sp * chunks
    width = max(num_heads, ranks)                # heads after replication
    per, repeat = width // ranks, width // num_heads
    index = [((r * chunks + chunk) * per + i) // repeat for r in range(sp) for i in range(per)]
    return torch.tensor(index, dtype=torch.long, device=device)


def expand_kv_heads(kv: torch.Tensor, sp: int) -> torch.Tensor:
    """Replicate key/value heads so that sp divides them: [b, s/sp, g_l, d] -> [b, s/sp, max(g_l, sp), d].

    Unchanged when g_l % sp == 0; otherwise (sp % g_l == 0) head j becomes heads
    j*sp/g_l .. (j+1)*sp/g_l - 1, so after seq->head sp rank r holds head floor(r*g_l/sp).
    """
    g_local = kv.shape[2]
    if g_local % sp == 0:
        return kv
    return kv.repeat_interleave(sp // g_local, dim=2)  # [b, s/sp, g_l, d] -> [b, s/sp, sp, d]


class UlyssesAttention(nn.Module):
    """Sequence-parallel wrapper around a local attention backend (megatron_sp.attention).

    forward(q, k, v, *, document_ids=None, softmax_scale=None, dropout_p=0.0):
      q [b, s/sp, h_l, d], k/v [b, s/sp, g_l, d] (this rank's sequence chunk, its tp rank's heads)
      -> out [b, s/sp, h_l, d]. document_ids [b, s] covers the FULL sequence (every sp rank has
      it) and goes to the local attention unchanged, also under a ring (RingLocalAttention plans
      its segments from it). Always causal.
    With sp_group None or of size 1 it is just local_attention (head chunks still apply: a
    ring's, or the backend's, heads in turn). fuse_qkv=False sends q, k and v in three
    all-to-alls instead of one (for the benchmark's comparison). head_chunks = N > 1: the
    exchange and attention over N head chunks in turn, each recomputed in backward (module
    docstring); the head counts are checked on the first call (check_head_chunks).
    """

    def __init__(self, local_attention, sp_group=None, fuse_qkv: bool = True, head_chunks: int = 1):
        super().__init__()
        if not isinstance(head_chunks, int) or head_chunks < 1:
            raise LayoutError(f"head_chunks must be an integer >= 1, got {head_chunks!r}.")
        self.local_attention = local_attention
        self.sp_group = sp_group
        self.sp_size = group_size(sp_group)
        self.fuse_qkv = fuse_qkv
        self.head_chunks = head_chunks

    def forward(self, q, k, v, *, document_ids=None, softmax_scale=None, dropout_p=0.0):
        sp, n = self.sp_size, self.head_chunks
        documents = {} if document_ids is None else {"document_ids": document_ids}
        if sp == 1 and n == 1:
            return self.local_attention(q, k, v, softmax_scale=softmax_scale, dropout_p=dropout_p,
                                        **documents)
        check_ulysses_layout(q.shape[2], k.shape[2], tp=1, sp=sp)  # per-tp-rank head counts
        full = q.shape[1] * sp * getattr(self.local_attention, "cp_size", 1)   # a ring's too
        if document_ids is not None and document_ids.shape[1] != full:
            raise ValueError(f"document_ids must cover the full sequence s = {full} "
                             f"(sp = {sp} chunks of {q.shape[1]}), got {document_ids.shape[1]}.")

        def exchange_attend(q, k, v, pick=None):
            """q [b, s/sp, h_c, d], k, v [b, s/sp, g_c, d] (in send order; or all key/value heads
            and `pick` the chunk's, in send order) -> [b, s/sp, h_c, d]."""
            if pick is not None:
                k, v = k.index_select(2, pick), v.index_select(2, pick)   # [b, s/sp, g_c, d]
            if self.fuse_qkv:   # q [b, s, h_c/sp, d], k, v [b, s, g_c/sp, d]
                q, k, v = seq_to_head_qkv_all_to_all(q, k, v, self.sp_group)
            else:
                q, k, v = (seq_to_head_all_to_all(t, self.sp_group) for t in (q, k, v))
            out = self.local_attention(q, k, v, softmax_scale=softmax_scale, dropout_p=dropout_p,
                                       **documents)
            return head_to_seq_all_to_all(out, self.sp_group)           # [b, s/sp, h_c, d]

        if n == 1:
            k, v = expand_kv_heads(k, sp), expand_kv_heads(v, sp)     # [b, s/sp, max(g_l, sp), d]
            return exchange_attend(q, k, v)                           # [b, s/sp, h_l, d]
        check_head_chunks(q.shape[2], k.shape[2], sp, n)
        b, s_local, h_local, d = q.shape
        q_index = [head_chunk_index(h_local, sp, n, c, q.device) for c in range(n)]
        kv_index = [head_chunk_index(k.shape[2], sp, n, c, k.device) for c in range(n)]
        per_rank = h_local // (sp * n)                                # query heads per rank, chunk
        # Chunks that share key/value heads (kv_r % N != 0) keep one copy of k, v for all of them
        # ([b, s/sp, g_l, d]) and pick theirs inside; otherwise each keeps its own.
        shared = (max(k.shape[2], sp) // sp) % n != 0
        k_all, v_all = (k.clone(), v.clone()) if shared else (None, None)
        outs = []
        for c in range(n):   # the chunk's inputs (copies): [b, s/sp, h_l/N, d], [b, s/sp, g_c, d]
            q_c = q.index_select(2, q_index[c])
            if shared:
                run, kv = functools.partial(exchange_attend, pick=kv_index[c]), (k_all, v_all)
            else:
                run, kv = exchange_attend, (k.index_select(2, kv_index[c]),
                                            v.index_select(2, kv_index[c]))
            out = checkpoint(run, q_c, *kv) if torch.is_grad_enabled() else run(q_c, *kv)
            # [b, s/sp, h_l/N, d] -> [b, s/sp, sp, h_l/(sp N), d]: the heads sent to each rank
            outs.append(out.reshape(b, s_local, sp, per_rank, d))
        # stack: [b, s/sp, sp, N, h_l/(sp N), d] -> [b, s/sp, h_l, d], head (r*N + c)*h_l/(sp N) + i
        return torch.stack(outs, dim=3).reshape(b, s_local, h_local, d)

    def extra_repr(self) -> str:
        return (f"sp={self.sp_size}" + ("" if self.fuse_qkv else ", fuse_qkv=False")
                + (f", head_chunks={self.head_chunks}" if self.head_chunks > 1 else ""))
