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

Head chunks (--ulysses-head-chunks N, UPipe's idea) run the whole attention block, projections
included, over groups of heads in turn: models/gpt.py SelfAttention, which calls this module once
per chunk; head_chunk_problem says which N fit the heads.
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_sp.mesh import LayoutError, group_size, head_layout_problem
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


def head_chunk_problem(num_heads: int, num_kv_heads: int, sp: int, chunks: int) -> str | None:
    """Why `chunks` head chunks do not fit num_heads query and num_kv_heads key/value heads (per tp
    rank) over Ulysses sp, or None when they do (the sp layout itself is check_ulysses_layout's).

    Rule (models/gpt.py SelfAttention's chunks): a chunk holds g/N whole key/value groups with
    all their query heads (g % N == 0), or one group's key/value head with an equal share of its
    query heads (N % g == 0, (h/g) % (N/g) == 0); and its h/N query and max(g/N, 1) key/value
    heads split over sp as Ulysses' do (head_layout_problem). For powers of two this is plain
    Ulysses over sp*N ranks.
    """
    def fits(n):
        if num_heads % num_kv_heads or not (num_kv_heads % n == 0 or (
                n % num_kv_heads == 0 and (num_heads // num_kv_heads) % (n // num_kv_heads) == 0)):
            return False
        return head_layout_problem(num_heads // n, max(num_kv_heads // n, 1), 1, sp) is None
    if chunks >= 1 and fits(chunks):
        return None
    choices = ", ".join(str(n) for n in range(1, num_heads + 1) if fits(n))
    return (f"--ulysses-head-chunks {chunks} does not fit {num_heads} query and {num_kv_heads} "
            f"key/value heads per tp rank over sp = {sp}: a chunk holds whole key/value groups "
            f"with all their query heads or an equal share of one group's query heads, and its "
            f"heads must split over the {sp} sp ranks as Ulysses' do; use one of {choices}.")


def check_head_chunks(num_heads: int, num_kv_heads: int, sp: int, chunks: int) -> None:
    """Refuse (LayoutError) head chunks that do not fit the heads per tp rank."""
    problem = head_chunk_problem(num_heads, num_kv_heads, sp, chunks)
    if problem:
        raise LayoutError(problem)


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
    With sp_group None or of size 1 it is just local_attention. fuse_qkv=False sends q, k and v
    in three all-to-alls instead of one (for the benchmark's comparison).
    """

    def __init__(self, local_attention, sp_group=None, fuse_qkv: bool = True):
        super().__init__()
        self.local_attention = local_attention
        self.sp_group = sp_group
        self.sp_size = group_size(sp_group)
        self.fuse_qkv = fuse_qkv

    def forward(self, q, k, v, *, document_ids=None, softmax_scale=None, dropout_p=0.0):
        sp = self.sp_size
        documents = {} if document_ids is None else {"document_ids": document_ids}
        if sp == 1:
            return self.local_attention(q, k, v, softmax_scale=softmax_scale, dropout_p=dropout_p,
                                        **documents)
        check_ulysses_layout(q.shape[2], k.shape[2], tp=1, sp=sp)  # per-tp-rank head counts
        full = q.shape[1] * sp * getattr(self.local_attention, "cp_size", 1)   # a ring's too
        if document_ids is not None and document_ids.shape[1] != full:
            raise ValueError(f"document_ids must cover the full sequence s = {full} "
                             f"(sp = {sp} chunks of {q.shape[1]}), got {document_ids.shape[1]}.")
        k, v = expand_kv_heads(k, sp), expand_kv_heads(v, sp)         # [b, s/sp, max(g_l, sp), d]
        if self.fuse_qkv:   # q [b, s, h_l/sp, d], k, v [b, s, max(g_l, sp)/sp, d]
            q, k, v = seq_to_head_qkv_all_to_all(q, k, v, self.sp_group)
        else:
            q, k, v = (seq_to_head_all_to_all(t, self.sp_group) for t in (q, k, v))
        out = self.local_attention(q, k, v, softmax_scale=softmax_scale, dropout_p=dropout_p,
                                   **documents)
        return head_to_seq_all_to_all(out, self.sp_group)               # [b, s/sp, h_l, d]

    def extra_repr(self) -> str:
        return f"sp={self.sp_size}" + ("" if self.fuse_qkv else ", fuse_qkv=False")
