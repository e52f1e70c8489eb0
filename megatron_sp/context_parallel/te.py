"""Transformer Engine's own context parallelism behind the ring's interface (docs/design.md §5, §14):
with --attention-backend te and cp > 1, TE's DotProductAttention exchanges
the context itself, as in Megatron-core (whose TEDotProductAttention hands cp_group,
cp_global_ranks, cp_stream and cp_comm_type to TE's constructor), instead of our ring.

    q [b, n, h, d], k, v [b, n, g, d]   this rank's n = s/cp zigzag tokens (as RingLocalAttention)
    TE DotProductAttention, qkv_format "bshd", attn_mask_type "causal" ("no_mask" if not causal)
    out [b, n, h*d] (TE merges the heads) -> [b, n, h, d]

Layout. For bshd / sbhd, TE's context parallelism takes the sequence in 2 cp chunks, position i of
the cp group holding chunks i and 2cp-1-i (DualChunkSwap: TE's attn_forward_func_with_cp docstring,
its and Megatron's get_batch_on_this_cp_rank). That is our zigzag (context_parallel.zigzag), so the
tokens go in as they are and the layout, positions, labels and loss path stay ours:

    s = 16, cp = 4    chunk  0  1  2  3  4  5  6  7
                      rank   0  1  2  3  3  2  1  0      (ours and TE's)

    cp_comm_type  TE's exchange; the cp_group TE gets             position i of this rank
    p2p           kv blocks round a ring; cp_group                 its group rank
    all_gather    kv all-gathered, not overlapped; cp_group        its group rank
    a2a           heads scattered (Ulysses); cp_group              its group rank (h, g % cp == 0)
    a2a+p2p       a2a inside, p2p across; [a2a group, p2p group]   p2p rank * a + a2a rank
                  (cp_group is then the whole a x r group)         (h, g % a == 0)

cp_global_ranks is cp_group's global ranks in group rank order (comm.group_global_ranks): TE's ring
sends to cp_global_ranks[(p2p rank + 1) % r * a + a2a rank]. One CUDA stream per device, shared by
every layer (Megatron's class-wide cp_stream), lets TE overlap its two attention kernels.

Our Ulysses x ring hybrid is not TE's a2a+p2p layout: ours cuts ring rank j's zigzag tokens
contiguously over its a Ulysses ranks (hybrid.py), TE's gives context rank k = j a + u chunks k and
2ar-1-k of 2ar. The model keeps its own Ulysses outside, UlyssesAttention(TEContextParallelAttention
(ring group), ulysses group): after the seq->head exchange each rank holds its ring rank's whole
zigzag portion, which is TE's p2p layout over the ring group.

Packed documents. Under context parallelism TE takes them only as qkv_format "thd" (bshd /
sbhd support no_mask and causal there: TE's backend filter), and thd splits EVERY document in
2 cp chunks of its own, padded to a multiple of 2 cp, rank i holding chunks i and 2cp-1-i of each
(DualChunkSwap per sequence: tex.thd_get_partitioned_indices). Our ranks hold n = s/cp tokens of
the row in the balanced (or zigzag) layout, so with 16-bit inputs and documents the tokens move
to TE's layout and back around TE's call (te_thd.py: one all-to-all of q, k, v in, one of the
output out; tokens whose places agree stay home), with cu_seqlens (real lengths),
cu_seqlens_padded and "padding_causal". TE implements thd only for its p2p exchange, so the other
communication types refuse packed documents (documents_problem).

fp32: TE runs context parallelism on FlashAttention or FusedAttention only (it disables its unfused
attention there), both fp16 / bf16, so fp32 calls run our ring over the same group and layout
(RingLocalAttention), as TEAttention runs SDPA.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from megatron_sp.attention.backends import FUSED_DTYPES, TEAttention, import_optional
from megatron_sp.attention.base import check_shapes
from megatron_sp.context_parallel.attention import RingLocalAttention
from megatron_sp.context_parallel.comm import group_global_ranks, thd_exchange
from megatron_sp.context_parallel.te_thd import thd_plan
from megatron_sp.errors import ConfigError
from megatron_sp.mesh import LayoutError, group_rank, group_size

# --cp-comm-type values -> TE's cp_comm_type (Megatron spells TE's "all_gather" "allgather").
TE_COMM_TYPES = {"p2p": "p2p", "all_gather": "all_gather", "allgather": "all_gather",
                 "a2a": "a2a", "a2a+p2p": "a2a+p2p"}

_CP_STREAMS: dict = {}   # device -> the CUDA stream every layer's TE attention shares


def _unknown_comm_type(cp_comm_type: str) -> str:
    return (f"--cp-comm-type {cp_comm_type} is not one of Transformer Engine's context-parallel "
            f"communication types: choose p2p, all_gather (allgather), a2a or a2a+p2p.")


def te_comm_type(cp_comm_type: str) -> str:
    """TE's name for a --cp-comm-type value; anything else is a ConfigError."""
    kind = TE_COMM_TYPES.get(cp_comm_type)
    if kind is None:
        raise ConfigError(_unknown_comm_type(cp_comm_type))
    return kind


def documents_problem(cp: int, cp_comm_type: str) -> str:
    """The one sentence refusing packed documents under TE's context parallelism with a
    communication type other than p2p (TE's thd format has only the p2p exchange)."""
    return (f"packed documents (--reset-attention-mask) run under Transformer Engine's context "
            f"parallelism over {cp} ranks only with --cp-comm-type p2p (TE implements its packed "
            f"thd format for the p2p exchange alone), not {cp_comm_type}: use --cp-comm-type p2p, "
            f"or --attention-backend sdpa, whose ring attends packed documents in any layout.")


def te_cp_problem(cp_comm_type: str, cp: int, heads: int, kv_heads: int,
                  hierarchical_sizes, documents: bool, dtype, *, head_dim: int | None = None):
    """Why TE's context parallelism refuses this layout, in one sentence; None if it takes it.

    cp: the ranks TE's exchange spans (cp_group's size; a x r for a2a+p2p); heads, kv_heads: the
    query and key/value heads each rank hands TE (per tp rank, after any Ulysses exchange of ours);
    hierarchical_sizes: (a, r) for a2a+p2p, else None; documents: packed documents in the batch;
    dtype: the compute dtype (fp32 runs our ring, so only 16-bit dtypes meet TE); head_dim: the
    head size if known. TE's checks read: a2a scatters the heads ("The number of attention heads
    needs to be divisible by CP size!", query and key/value heads), a2a+p2p does so over its a2a
    group, p2p and a2a+p2p need "hidden size per attention head ... multiple of 8", and packed
    documents run in TE's thd format, p2p only (documents_problem).
    """
    kind = TE_COMM_TYPES.get(cp_comm_type)
    if kind is None:
        return _unknown_comm_type(cp_comm_type)
    if cp <= 1:
        return None
    if hierarchical_sizes is not None and kind != "a2a+p2p":
        return (f"hierarchical context-parallel sizes apply to --cp-comm-type a2a+p2p, not "
                f"{cp_comm_type}: drop them or use a2a+p2p.")
    if kind == "a2a+p2p":
        sizes = tuple(hierarchical_sizes or ())
        if len(sizes) != 2 or min(sizes) < 1 or sizes[0] * sizes[1] != cp:
            return (f"Transformer Engine's a2a+p2p takes two levels, a2a ranks A x p2p ranks "
                    f"R = {cp}, got {list(sizes) or 'none'}: pass "
                    f"--hierarchical-context-parallel-sizes A R with A x R = {cp}.")
        scatter, what = sizes[0], f"its a2a group of {sizes[0]} ranks"
    else:
        scatter, what = cp, f"the {cp} context-parallel ranks"
    if kind in ("a2a", "a2a+p2p") and (heads % scatter or kv_heads % scatter):
        return (f"Transformer Engine's {kind} context parallelism scatters the attention heads "
                f"over {what}, so {heads} query and {kv_heads} key/value heads per rank do not "
                f"split: use a head count that {scatter} divides, or --cp-comm-type p2p.")
    if kind in ("p2p", "a2a+p2p") and head_dim is not None and head_dim % 8:
        return (f"Transformer Engine's {kind} context parallelism needs a head size that is a "
                f"multiple of 8, got {head_dim}: use --kv-channels {8 * math.ceil(head_dim / 8)} "
                f"or --attention-backend sdpa.")
    if documents and dtype in FUSED_DTYPES and kind != "p2p":
        return documents_problem(cp, cp_comm_type)
    return None


def _cp_stream(device: torch.device):
    """The CUDA stream TE overlaps its two attention kernels on (None off CUDA)."""
    if device.type != "cuda":
        return None
    key = torch.device("cuda", device.index if device.index is not None else
                       torch.cuda.current_device())
    stream = _CP_STREAMS.get(key)
    if stream is None:
        stream = _CP_STREAMS[key] = torch.cuda.Stream(device=key)
    return stream


class TEContextParallelAttention(nn.Module):
    """Attention of this rank's zigzag tokens against the whole sequence by Transformer Engine's
    context parallelism over `cp_group` (module docstring): RingLocalAttention's interface.

    cp_comm_type: "p2p" (default), "all_gather" ("allgather"), "a2a" or "a2a+p2p"; for a2a+p2p,
    cp_group is the whole a x r context group and hierarchical_groups its (a2a group, p2p group),
    the a2a groups adjacent in cp_group's rank order (cp rank = p2p rank * a + a2a rank). One TE
    module per (h, g, d, mask, dropout, scale), built on first use and cached (no parameters).
    """

    name = "te"

    def __init__(self, cp_group, cp_comm_type: str = "p2p", hierarchical_groups=None):
        super().__init__()
        kind = te_comm_type(cp_comm_type)
        self._te = import_optional("transformer_engine.pytorch", "te")
        self.cp_group, self.cp_comm_type = cp_group, kind
        self.cp_size = group_size(cp_group)
        self.hierarchical_sizes = None
        te_group = cp_group
        if kind == "a2a+p2p":
            te_group = self._hierarchy(hierarchical_groups)
        elif hierarchical_groups is not None:
            raise ConfigError(f"hierarchical groups apply to cp_comm_type a2a+p2p, not "
                              f"{cp_comm_type}.")
        # what TE's constructor gets; nothing when cp == 1 (TE without context parallelism)
        self._cp_kwargs = None if self.cp_size == 1 else dict(
            cp_group=te_group, cp_global_ranks=group_global_ranks(cp_group), cp_comm_type=kind)
        self._ring = RingLocalAttention(cp_group)   # fp32: TE's context parallelism is 16-bit
        # cp == 1: no context to split, so packed documents are TE's plain thd attention
        self._one_rank = TEAttention() if self.cp_size == 1 else None
        self._cache = {}

    def _hierarchy(self, groups):
        """[a2a group, p2p group] for TE, checked against cp_group (TE indexes cp_global_ranks by
        p2p rank * a + a2a rank)."""
        if groups is None or len(groups) != 2:
            raise ConfigError("cp_comm_type a2a+p2p needs hierarchical_groups = (a2a group, p2p "
                              "group), Transformer Engine's two levels.")
        a2a, p2p = groups
        a, r = group_size(a2a), group_size(p2p)
        self.hierarchical_sizes = (a, r)
        if a * r != self.cp_size:
            raise LayoutError(f"a2a+p2p groups of {a} x {r} ranks do not make the context group of "
                              f"{self.cp_size}.")
        position = group_rank(p2p) * a + group_rank(a2a)
        if position != group_rank(self.cp_group):
            raise LayoutError(f"this rank is context rank {group_rank(self.cp_group)} but p2p rank "
                              f"{group_rank(p2p)} x {a} + a2a rank {group_rank(a2a)} = {position}: "
                              f"Transformer Engine's a2a+p2p needs the a2a groups adjacent in the "
                              f"context group's rank order.")
        return [a2a, p2p]

    def _module(self, h, g, d, mask_type, dropout_p, scale, device, fmt="bshd"):
        key = (h, g, d, mask_type, float(dropout_p), float(scale), fmt)
        module = self._cache.get(key)
        if module is None:
            problem = te_cp_problem(self.cp_comm_type, self.cp_size, h, g,
                                    self.hierarchical_sizes, False, torch.bfloat16, head_dim=d)
            if problem:
                raise LayoutError(problem)
            cp = {} if self._cp_kwargs is None else dict(self._cp_kwargs,
                                                          cp_stream=_cp_stream(device))
            module = self._te.DotProductAttention(
                h, d, num_gqa_groups=g, attention_dropout=dropout_p, qkv_format=fmt,
                attn_mask_type=mask_type, softmax_scale=scale, **cp)
            self._cache[key] = module
        module.train(dropout_p > 0)  # TE applies attention_dropout only in training mode
        return module

    def forward(self, q, k, v, *, causal=True, softmax_scale=None, document_ids=None,
                dropout_p=0.0):
        """q [b, n, h, d], k, v [b, n, g, d]: this rank's n = s/cp tokens of the shared planner's
        layout (zigzag: chunk i then chunk 2cp-1-i, i its position in the cp group), all of its
        heads. document_ids: None or the FULL rows' int64 [b, s] segment ids: with 16-bit inputs
        and cp > 1 attended in TE's thd layout (module docstring; p2p only), with cp = 1 by TE's
        plain thd attention, with fp32 ones by our ring. Returns out [b, n, h, d] in q's dtype."""
        check_shapes(q, k, v, None)
        (b, n, h, d), g = q.shape, k.shape[2]
        if document_ids is not None and tuple(document_ids.shape) != (b, n * self.cp_size):
            raise ValueError(f"document_ids must be the full rows [b, s] = [{b}, "
                             f"{n * self.cp_size}] (cp = {self.cp_size} ranks of {n} tokens), got "
                             f"{tuple(document_ids.shape)}.")
        if q.dtype not in FUSED_DTYPES:
            return self._ring(q, k, v, causal=causal, softmax_scale=softmax_scale,
                              document_ids=document_ids, dropout_p=dropout_p)
        if document_ids is not None:
            if self._one_rank is not None:
                return self._one_rank(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                      document_ids=document_ids, dropout_p=dropout_p)
            if self.cp_comm_type != "p2p":
                raise ConfigError(documents_problem(self.cp_size, self.cp_comm_type))
            return self._thd(q, k, v, document_ids, causal, softmax_scale, dropout_p)
        scale = softmax_scale if softmax_scale is not None else d ** -0.5
        mask_type = "causal" if causal else "no_mask"
        te_attention = self._module(h, g, d, mask_type, dropout_p, scale, q.device)
        out = te_attention(q, k, v, qkv_format="bshd", attn_mask_type=mask_type)
        return out.view(b, n, h, d)                                   # [b, n, h*d] -> [b, n, h, d]

    @property
    def planner(self):
        """The layout our tokens follow (the model shares one LayoutPlanner with every ring)."""
        return self._ring.planner

    def _thd_plan(self, document_ids, b, n, device):
        layout = self.planner.layout(document_ids, b, n * self.cp_size)
        return thd_plan(layout, group_rank(self.cp_group), device)

    def _thd(self, q, k, v, document_ids, causal, softmax_scale, dropout_p):
        """Packed documents: our tokens to TE's thd layout, TE's attention, and back (te_thd)."""
        (b, n, h, d), g = q.shape, k.shape[2]
        plan = self.planner.cached("te_thd", self._thd_plan, document_ids, b, n, q.device)
        rows = torch.cat([q, k, v], dim=2).reshape(b * n, h + 2 * g, d)  # [b, n, h+2g, d] -> rows
        received = thd_exchange(rows[plan.send_index], self.cp_group, plan.send_counts,
                                plan.recv_counts)                         # [M, h+2g, d]
        thd = rows.new_zeros(plan.slots, h + 2 * g, d).index_copy(0, plan.recv_slots, received)
        q_t, k_t, v_t = (t.contiguous() for t in thd.split([h, g, g], dim=1))   # [T, h|g, d]
        scale = softmax_scale if softmax_scale is not None else d ** -0.5
        mask_type = "padding_causal" if causal else "padding"
        te_attention = self._module(h, g, d, mask_type, dropout_p, scale, q.device, "thd")
        out = te_attention(q_t, k_t, v_t, qkv_format="thd", attn_mask_type=mask_type,
                           cu_seqlens_q=plan.cu_seqlens, cu_seqlens_kv=plan.cu_seqlens,
                           cu_seqlens_q_padded=plan.cu_seqlens_padded,
                           cu_seqlens_kv_padded=plan.cu_seqlens_padded,
                           max_seqlen_q=plan.max_seqlen, max_seqlen_kv=plan.max_seqlen)
        out = out.view(plan.slots, h, d)[plan.recv_slots]          # [T, h*d] -> [M, h, d] rows
        back = thd_exchange(out, self.cp_group, plan.recv_counts, plan.send_counts)  # [b*n, h, d]
        mine = back.new_zeros(b * n, h, d).index_copy(0, plan.send_index, back)
        return mine.view(b, n, h, d)                                  # rows -> [b, n, h, d]

    def extra_repr(self) -> str:
        return f"cp={self.cp_size}, cp_comm_type={self.cp_comm_type}"
