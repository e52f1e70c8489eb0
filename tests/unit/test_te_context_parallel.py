"""Transformer Engine's own context parallelism (megatron_sp.context_parallel.te), with a stand-in.

TE cannot be installed here, so a stand-in `transformer_engine.pytorch` (injected into sys.modules)
honours TE's documented DotProductAttention constructor, forward and set_context_parallel_group
keywords, records what it is given and computes what TE's context parallelism computes for
qkv_format "bshd": position i of the cp group (its group rank; p2p rank * a + a2a rank for a2a+p2p's
[a2a group, p2p group]) holds chunks i and 2c-1-i of the sequence (TE's DualChunkSwap, written out
here independently of our zigzag helpers), and its queries attend to the keys of the whole sequence
(gathered over the group), causal by position. It also checks TE's contract for cp_global_ranks
(entry i is position i's global rank).

One process: cp None (no context parallelism), the fp32 ring, the refusals, and a 2 x 2 a2a+p2p
hierarchy's rank bookkeeping (process groups faked). Two gloo ranks, one spawn: p2p, all_gather,
a2a and a2a+p2p (2 x 1 and 1 x 2) against full causal attention on one rank, with TE's arguments.

Tolerances: 16-bit runs against an fp64 reference on the same (bf16) values: the stand-in computes
in fp64 and rounds once to bf16, so rtol 2**-8 (half a bf16 ulp) with atol 1e-6, for outputs and
gradients; fp32 runs (our ring) against fp64: forward 1e-5.
"""
import sys
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron_sp.attention import AttentionBackendUnavailable
from megatron_sp.context_parallel import te as te_cp
from megatron_sp.context_parallel.te import (TEContextParallelAttention, documents_problem,
                                             te_cp_problem)
from megatron_sp.errors import ConfigError
from megatron_sp.mesh import LayoutError

RTOL_16, ATOL_16 = 2 ** -8, 1e-6
GRAD_NORM_RTOL = 0.05     # the model check: TE's thd path against our ring, both under bf16
FWD_TOL_32 = 1e-5


# Reference and TE's layout ------------------------------------------------------------------------

def masked_attention(q, k, v, pos_q, pos_k, causal, scale):
    """fp64 attention of q [b, nq, h, d] against k, v [b, nk, g, d] (GQA: query head i uses kv
    head i // (h/g)); causal by the tokens' global positions. Returns [b, nq, h, d] in fp64."""
    h, g = q.shape[2], k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))          # [b, heads, n, d]
    kd, vd = kd.repeat_interleave(h // g, 1), vd.repeat_interleave(h // g, 1)
    scores = qd @ kd.transpose(-1, -2) * scale                            # [b, h, nq, nk]
    if causal:
        scores = scores.masked_fill(pos_k[None, :] > pos_q[:, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vd).transpose(1, 2)           # [b, nq, h, d]


def full_reference(q, k, v, causal=True, scale=None):
    """Attention over the whole sequence, fp64: [b, s, h, d]."""
    s = q.shape[1]
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    return masked_attention(q, k, v, torch.arange(s), torch.arange(s), causal, scale)


def dual_chunk_swap(c, i, n):
    """Global positions of the n tokens at position i of c (TE: chunks i and 2c-1-i of 2c)."""
    half = n // 2
    return torch.cat([torch.arange(i * half, (i + 1) * half),
                      torch.arange((2 * c - 1 - i) * half, (2 * c - i) * half)])


# The stand-in ------------------------------------------------------------------------------------

def _gather(t, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


class _GatherWithGrad(torch.autograd.Function):
    """x [...] -> [c, ...] every group rank's x; backward: the gradients of every rank's
    queries summed (all-reduce), this rank's part returned (what TE's ring sends back as dkv)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return torch.stack(_gather(x, group))

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def make_te_stub(built, calls):
    """transformer_engine(.pytorch) modules whose DotProductAttention records its arguments
    (built: constructor keywords, calls: forward ones) and computes TE's context parallelism."""
    package = types.ModuleType("transformer_engine")
    te_pytorch = types.ModuleType("transformer_engine.pytorch")

    class DotProductAttention(nn.Module):
        # TE's keywords and defaults (DotProductAttention.__init__, TE 2.x)
        def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None,
                     attention_dropout=0.0, qkv_format="sbhd", attn_mask_type="causal",
                     window_size=None, bottom_right_diagonal=None, sequence_parallel=False,
                     tp_size=1, get_rng_state_tracker=None, tp_group=None, layer_number=None,
                     attention_type="self", cp_group=None, cp_global_ranks=None, cp_stream=None,
                     cp_comm_type="p2p", softmax_scale=None, softmax_type="vanilla",
                     return_max_logit=False, name=None):
            super().__init__()
            self.h, self.d = num_attention_heads, kv_channels
            self.g = num_gqa_groups or num_attention_heads
            self.attention_dropout, self.qkv_format = attention_dropout, qkv_format
            self.attn_mask_type = attn_mask_type
            self.softmax_scale = softmax_scale if softmax_scale is not None else kv_channels ** -0.5
            self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
            built.append(dict(num_attention_heads=num_attention_heads, kv_channels=kv_channels,
                              num_gqa_groups=num_gqa_groups, attention_dropout=attention_dropout,
                              qkv_format=qkv_format, attn_mask_type=attn_mask_type,
                              softmax_scale=softmax_scale, cp_group=cp_group,
                              cp_global_ranks=cp_global_ranks, cp_stream=cp_stream,
                              cp_comm_type=cp_comm_type))

        def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream,
                                       cp_comm_type="p2p"):
            self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
            self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type

        def _context(self, k, v):
            """(c, i, every position's k and v in position order), checking cp_global_ranks."""
            group = self.cp_group
            if group is None:
                return 1, 0, [k], [v]
            me = torch.tensor([dist.get_rank()])
            if self.cp_comm_type == "a2a+p2p":
                assert isinstance(group, list) and len(group) == 2, group
                a2a, p2p = group
                a = dist.get_world_size(a2a)
                i = dist.get_rank(p2p) * a + dist.get_rank(a2a)

                def two_level(t):   # position j*a + u: gather over a2a (u), then over p2p (j)
                    inner = torch.stack(_gather(t, a2a))
                    return [x for row in _gather(inner, p2p) for x in row]
            else:
                assert isinstance(group, dist.ProcessGroup), group
                i = dist.get_rank(group)

                def two_level(t):
                    return _gather(t, group)
            ranks = [int(x) for x in two_level(me)]
            assert self.cp_global_ranks == ranks, (self.cp_global_ranks, ranks)
            return len(ranks), i, two_level(k.detach()), two_level(v.detach())

        def forward(self, query_layer, key_layer, value_layer, attention_mask=None,
                    qkv_format=None, cu_seqlens_q=None, cu_seqlens_kv=None,
                    cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None,
                    max_seqlen_kv=None, attn_mask_type=None, window_size=None,
                    bottom_right_diagonal=None, checkpoint_core_attention=False,
                    core_attention_bias_type="no_bias", core_attention_bias=None,
                    alibi_slopes=None, fast_zero_fill=True, inference_params=None,
                    pad_between_seqs=None, fp8_output=False):
            fmt = qkv_format or self.qkv_format
            mask_type = attn_mask_type or self.attn_mask_type
            if fmt == "thd":
                return self._thd(query_layer, key_layer, value_layer, mask_type, cu_seqlens_q,
                                 cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                                 max_seqlen_q, max_seqlen_kv, attention_mask)
            # TE's context parallelism with bshd: no_mask or causal, no cu_seqlens, 16-bit
            assert fmt == "bshd" and mask_type in ("causal", "no_mask"), (fmt, mask_type)
            assert cu_seqlens_q is None and attention_mask is None
            assert query_layer.dtype in (torch.float16, torch.bfloat16)
            b, n = query_layer.shape[:2]
            assert query_layer.shape[2:] == (self.h, self.d)
            assert key_layer.shape == value_layer.shape == (b, n, self.g, self.d)
            calls.append(dict(qkv_format=fmt, attn_mask_type=mask_type, q=tuple(query_layer.shape),
                              training=self.training))
            c, i, ks, vs = self._context(key_layer, value_layer)
            pos_q = dual_chunk_swap(c, i, n)
            pos_k = torch.cat([dual_chunk_swap(c, j, n) for j in range(c)])
            out = masked_attention(query_layer, torch.cat(ks, 1), torch.cat(vs, 1), pos_q, pos_k,
                                   mask_type == "causal", self.softmax_scale)
            return out.to(query_layer.dtype).reshape(b, n, self.h * self.d)   # heads merged

        def _thd(self, q, k, v, mask_type, cu_q, cu_kv, cu_q_pad, cu_kv_pad, max_q, max_kv,
                 attention_mask):
            """TE's thd context parallelism (p2p): q, k, v [t, heads, d] hold, per sequence i of
            cu_seqlens_padded (global, each P_i a multiple of 2c), chunks i and 2c-1-i of c_i =
            P_i / 2c slots, at local offset cu_seqlens_padded[i] / c; the real tokens are the
            first cu_seqlens[i+1] - cu_seqlens[i] of the padded sequence. Out [t, h*d]: each real
            query against the real keys of its sequence (causal by offset), padding rows zero."""
            assert mask_type in ("padding_causal", "padding"), mask_type
            assert attention_mask is None and self.cp_comm_type == "p2p", self.cp_comm_type
            for cu in (cu_q, cu_kv, cu_q_pad, cu_kv_pad):
                assert cu is not None and cu.dtype == torch.int32 and cu.dim() == 1, cu
            assert torch.equal(cu_q, cu_kv) and torch.equal(cu_q_pad, cu_kv_pad)
            assert q.dtype in (torch.float16, torch.bfloat16) and q.dim() == 3
            assert q.shape[1:] == (self.h, self.d) and k.shape == v.shape == (
                q.shape[0], self.g, self.d)
            c, i, _, _ = self._context(k, v)               # the group and cp_global_ranks checks
            kv = _GatherWithGrad.apply(torch.stack([k, v]).double(), self.cp_group)
            ks, vs = [part[0] for part in kv], [part[1] for part in kv]    # every rank's [t, g, d]
            real, padded = (cu[1:] - cu[:-1] for cu in (cu_q, cu_q_pad))
            assert bool((padded % (2 * c) == 0).all()) and bool((real <= padded).all())
            assert q.shape[0] == int(cu_q_pad[-1]) // c, (q.shape, cu_q_pad)
            assert max_q == max_kv == int(padded.max()), (max_q, int(padded.max()))
            calls.append(dict(qkv_format="thd", attn_mask_type=mask_type, q=tuple(q.shape),
                              training=self.training, sequences=len(real)))
            out = torch.zeros(q.shape[0], self.h, self.d, dtype=torch.float64)
            for seq, (length, size) in enumerate(zip(real.tolist(), padded.tolist())):
                half, at = size // (2 * c), int(cu_q_pad[seq]) // c
                def whole(parts):       # the padded sequence [P, heads, d] from every rank's chunks
                    chunks = [None] * (2 * c)
                    for j, part in enumerate(parts):
                        chunks[j] = part[at:at + half]
                        chunks[2 * c - 1 - j] = part[at + half:at + 2 * half]
                    return torch.cat(chunks)[:length]
                keys, values = whole(ks), whole(vs)
                mine = dual_chunk_swap(c, i, 2 * half)                 # my slots' offsets
                real_rows = mine < length
                rows = torch.arange(at, at + 2 * half)[real_rows]
                got = masked_attention(q[rows][None], keys[None], values[None],
                                       mine[real_rows], torch.arange(length),
                                       mask_type == "padding_causal", self.softmax_scale)[0]
                out[rows] = got
            return out.to(q.dtype).reshape(q.shape[0], self.h * self.d)     # heads merged

    te_pytorch.DotProductAttention = DotProductAttention
    package.pytorch = te_pytorch
    return {"transformer_engine": package, "transformer_engine.pytorch": te_pytorch}


@pytest.fixture
def te_stub(monkeypatch):
    built, calls = [], []
    for name, module in make_te_stub(built, calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    return built, calls


def inputs(gen, b, s, h, g, d, dtype=torch.bfloat16):
    return [torch.randn(b, s, n, d, generator=gen).to(dtype) for n in (h, g, g, h)]   # q k v dout


def assert_close_16(got, want, what):
    torch.testing.assert_close(got.double(), want, rtol=RTOL_16, atol=ATOL_16, msg=lambda m: f"{what}: {m}")


# One process ------------------------------------------------------------------------------------

def test_without_context_parallelism_te_runs_as_given(te_stub, seed):
    """cp None: TE is built without context-parallel arguments, bshd, causal, GQA; output and
    gradients are full attention; one module per shape, mask, dropout and scale."""
    built, calls = te_stub
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = inputs(gen, 2, 16, 8, 2, 16)
    attention = TEContextParallelAttention(None)
    assert attention.cp_size == 1 and "cp=1, cp_comm_type=p2p" in repr(attention)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = attention(qq, kk, vv)
    out.backward(dout)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    ref = full_reference(*refs)
    ref.backward(dout.double())
    assert_close_16(out.detach(), ref.detach(), "out")
    for name, got, want in zip("qkv", (qq, kk, vv), refs):
        assert_close_16(got.grad, want.grad, f"grad of {name}")
    assert built == [dict(num_attention_heads=8, kv_channels=16, num_gqa_groups=2,
                          attention_dropout=0.0, qkv_format="bshd", attn_mask_type="causal",
                          softmax_scale=16 ** -0.5, cp_group=None, cp_global_ranks=None,
                          cp_stream=None, cp_comm_type="p2p")]
    assert calls[-1] == dict(qkv_format="bshd", attn_mask_type="causal", q=(2, 16, 8, 16),
                             training=False)
    attention(q, k, v)
    assert len(built) == 1                                      # cached
    out = attention(q, k, v, causal=False, softmax_scale=0.3)
    assert_close_16(out, full_reference(q, k, v, causal=False, scale=0.3), "no_mask")
    assert built[-1]["attn_mask_type"] == "no_mask" and built[-1]["softmax_scale"] == 0.3
    attention(q, k, v, dropout_p=0.1)
    assert built[-1]["attention_dropout"] == 0.1 and calls[-1]["training"] is True
    assert len(built) == 3


def test_fp32_runs_our_ring(te_stub, seed):
    """fp32 never reaches TE (its context parallelism is 16-bit): our ring over the same group,
    full attention within 1e-5; document_ids reach the ring as given."""
    built, calls = te_stub
    gen = torch.Generator().manual_seed(seed)
    q, k, v, _ = inputs(gen, 2, 16, 4, 2, 8, dtype=torch.float32)
    attention = TEContextParallelAttention(None)
    out = attention(q, k, v, softmax_scale=0.4)
    assert out.dtype == torch.float32 and built == [] and calls == []
    torch.testing.assert_close(out.double(), full_reference(q, k, v, scale=0.4), atol=FWD_TOL_32,
                               rtol=0)

    seen = []

    class Spy(nn.Module):
        def forward(self, q, k, v, **kwargs):
            seen.append(kwargs)
            return q

    attention._ring = Spy()
    docs = torch.zeros(2, 16, dtype=torch.long)
    attention(q, k, v, document_ids=docs, causal=False)
    assert seen[0]["document_ids"] is docs and seen[0]["causal"] is False


def test_refusals_are_one_sentence(te_stub, monkeypatch):
    with pytest.raises(ConfigError, match=r"--cp-comm-type ring is not one of Transformer "
                                          r"Engine's context-parallel communication types"):
        TEContextParallelAttention(None, cp_comm_type="ring")
    with pytest.raises(ConfigError, match=r"a2a\+p2p needs hierarchical_groups"):
        TEContextParallelAttention(None, cp_comm_type="a2a+p2p")
    with pytest.raises(ConfigError, match="hierarchical groups apply to cp_comm_type a2a\\+p2p"):
        TEContextParallelAttention(None, hierarchical_groups=(None, None))
    q = torch.zeros(1, 8, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"document_ids must be the full rows \[b, s\] = \[1, 8\]"):
        TEContextParallelAttention(None)(q, q, q, document_ids=torch.zeros(1, 4, dtype=torch.long))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    with pytest.raises(AttentionBackendUnavailable, match=r"Transformer Engine package"):
        TEContextParallelAttention(None)


def test_te_cp_problem_sentences():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert te_cp_problem("p2p", 4, 32, 8, None, False, bf16, head_dim=128) is None
    assert te_cp_problem("allgather", 4, 32, 8, None, False, bf16) is None
    assert te_cp_problem("a2a+p2p", 8, 32, 8, (2, 4), False, bf16, head_dim=64) is None
    assert te_cp_problem("a2a", 1, 3, 1, None, True, bf16) is None          # no context split
    assert te_cp_problem("p2p", 4, 32, 8, None, True, fp32) is None          # fp32: our ring
    assert te_cp_problem("p2p", 4, 32, 8, None, True, bf16) is None          # TE's thd layout
    assert te_cp_problem("a2a", 4, 32, 8, None, True, bf16) == documents_problem(4, "a2a")
    assert te_cp_problem("allgather", 4, 32, 8, None, True, bf16) == documents_problem(
        4, "allgather")
    assert documents_problem(4, "a2a") == (
        "packed documents (--reset-attention-mask) run under Transformer Engine's context "
        "parallelism over 4 ranks only with --cp-comm-type p2p (TE implements its packed thd "
        "format for the p2p exchange alone), not a2a: use --cp-comm-type p2p, or "
        "--attention-backend sdpa, whose ring attends packed documents in any layout.")
    assert te_cp_problem("a2a", 4, 6, 2, None, False, bf16) == (
        "Transformer Engine's a2a context parallelism scatters the attention heads over the 4 "
        "context-parallel ranks, so 6 query and 2 key/value heads per rank do not split: use a "
        "head count that 4 divides, or --cp-comm-type p2p.")
    assert "over its a2a group of 4 ranks, so 8 query and 2 key/value heads" in te_cp_problem(
        "a2a+p2p", 8, 8, 2, (4, 2), False, bf16)
    assert "R = 8, got [2, 2]: pass" in te_cp_problem("a2a+p2p", 8, 8, 8, (2, 2), False, bf16)
    assert "got none" in te_cp_problem("a2a+p2p", 8, 8, 8, None, False, bf16)
    assert "apply to --cp-comm-type a2a+p2p, not p2p" in te_cp_problem("p2p", 8, 8, 8, (2, 4),
                                                                      False, bf16)
    assert "multiple of 8, got 12: use --kv-channels 16" in te_cp_problem("p2p", 2, 8, 8, None,
                                                                         False, bf16, head_dim=12)
    assert "not one of Transformer Engine's" in te_cp_problem("ulysses", 2, 8, 8, None, False, bf16)


# Two gloo ranks, and a 2 x 2 hierarchy's bookkeeping -------------------------------------------

B, S, D = 2, 32, 16


def _check(attention, cp, i, h, g, seed, tag):
    """Run `attention` on this rank's zigzag tokens of fresh full tensors; compare with full
    attention split the same way. Returns the largest error."""
    from megatron_sp.context_parallel import zigzag_split
    gen = torch.Generator().manual_seed(seed)
    q, k, v, _ = inputs(gen, B, S, h, g, D)
    out = attention(*(zigzag_split(t, cp, i) for t in (q, k, v)))
    want = zigzag_split(full_reference(q, k, v), cp, i)
    assert_close_16(out, want, f"{tag}: out")
    return float((out.double() - want).abs().max())


def _te_cp_checks(rank, world, seed):
    built, calls = [], []
    sys.modules.update(make_te_stub(built, calls))
    both = dist.new_group([0, 1])
    single = None
    for members in ([0], [1]):                 # every rank creates every group, in one order
        group = dist.new_group(members)
        single = group if rank in members else single
    errors = {}
    cases = [("p2p", None, 4, 2, both), ("allgather", None, 4, 1, both),
             ("a2a", None, 4, 2, both),
             ("a2a+p2p", (both, single), 4, 2, [both, single]),    # a = 2 Ulysses-style, r = 1
             ("a2a+p2p", (single, both), 2, 1, [single, both])]    # a = 1, a ring of r = 2
    for n, (kind, hierarchy, h, g, te_group) in enumerate(cases):
        attention = TEContextParallelAttention(both, kind, hierarchy)
        errors[n] = _check(attention, 2, rank, h, g, seed + n, kind)
        made = built[-1]
        assert made["cp_comm_type"] == te_cp.TE_COMM_TYPES[kind], made
        assert made["cp_group"] is te_group or made["cp_group"] == te_group, made
        assert made["cp_global_ranks"] == [0, 1] and made["cp_stream"] is None, made
        assert (made["num_attention_heads"], made["num_gqa_groups"]) == (h, g), made
        assert made["kv_channels"] == D, made
        assert made["qkv_format"] == "bshd" and made["attn_mask_type"] == "causal", made
    errors.update(_thd_checks(rank, both, seed, calls))
    errors["model"] = _model_thd_check(rank, seed, calls)
    # refusals: packed documents in bf16 with a2a (TE's thd is p2p only), key/value heads a2a
    # cannot scatter
    q = torch.zeros(B, S // 2, 4, D, dtype=torch.bfloat16)
    try:
        TEContextParallelAttention(both, "a2a")(q, q, q,
                                                document_ids=torch.zeros(B, S, dtype=torch.long))
        raise AssertionError("packed documents were not refused under a2a")
    except ConfigError as err:
        assert str(err) == documents_problem(2, "a2a"), err
    try:
        TEContextParallelAttention(both, "a2a")(q, q[:, :, :1], q[:, :, :1])
        raise AssertionError("a2a with 1 key/value head over 2 ranks was not refused")
    except LayoutError as err:
        assert str(err) == te_cp_problem("a2a", 2, 4, 1, None, False, torch.bfloat16), err
    return errors


# Packed documents: TE's thd layout ---------------------------------------------------------------

def ids_of(lengths_per_row):
    """[b, s] document ids of rows with the given document lengths (ids restart per row)."""
    rows = [torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
            for lengths in lengths_per_row]
    return torch.stack(rows)


def document_reference(q, k, v, ids, causal, scale):
    """fp64 attention over the full rows [b, s, h, d], each query against the keys of its own
    document (up to itself when causal)."""
    h, g = q.shape[2], k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))          # [b, heads, s, d]
    kd, vd = kd.repeat_interleave(h // g, 1), vd.repeat_interleave(h // g, 1)
    scores = qd @ kd.transpose(-1, -2) * scale                            # [b, h, s, s]
    s = q.shape[1]
    allowed = ids[:, :, None] == ids[:, None, :]                           # [b, s, s]
    if causal:
        allowed = allowed & torch.ones(s, s, dtype=torch.bool).tril()
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vd).transpose(1, 2)           # [b, s, h, d]


# document mixes of rows of S = 32 over cp = 2 (2cp = 4): the balanced layout's example (long
# A split per document, short ones whole), lengths 2cp does not divide (padding in TE's layout),
# one-token documents, one document the whole row (the layout is then the zigzag), a document
# spanning every rank, and two rows of different mixes
THD_MIXES = [[[16, 6, 4, 4, 2]] * 2,
             [[13, 11, 5, 3], [1] * 32],
             [[32], [3, 29]],
             [[1, 30, 1], [7, 2, 9, 1, 1, 12]]]


def _thd_checks(rank, group, seed, calls):
    """TE's thd path over 2 ranks: this rank's tokens of the balanced (and zigzag) layout in,
    outputs and q, k, v gradients equal to full-row document attention (fp64 reference of the
    same bf16 values; the stand-in computes in fp64 and rounds once)."""
    from megatron_sp.context_parallel.balance import LayoutPlanner
    errors = {}
    cases = [(kind, mix, causal, h, g) for kind in ("balanced", "zigzag") for mix in THD_MIXES
             for causal, h, g in ((True, 4, 2),)] + [("balanced", THD_MIXES[0], False, 2, 2)]
    for n, (kind, mix, causal, h, g) in enumerate(cases):
        gen = torch.Generator().manual_seed(seed + 100 + n)
        q, k, v, dout = inputs(gen, B, S, h, g, D)
        ids = ids_of(mix)
        attention = TEContextParallelAttention(group)
        attention._ring.planner = LayoutPlanner(kind, 2, rank)     # as the model shares its own
        positions = attention.planner.layout(ids, B, S).positions(rank)          # [B, S/2]
        mine = [torch.stack([t[r, positions[r]] for r in range(B)]) for t in (q, k, v, dout)]
        local = [t.clone().requires_grad_() for t in mine[:3]]
        before = len(calls)
        out = attention(*local, causal=causal, document_ids=ids)
        out.backward(mine[3])
        assert calls[before]["qkv_format"] == "thd", calls[before:]
        assert calls[before]["attn_mask_type"] == ("padding_causal" if causal else "padding")
        full = [t.double().requires_grad_() for t in (q, k, v)]      # the same bf16 values
        want = document_reference(*full, ids, causal, D ** -0.5)
        want.backward(dout.double())
        pick = (lambda t: torch.stack([t[r, positions[r]] for r in range(B)]))
        tag = f"thd {kind} {mix} causal={causal}"
        assert_close_16(out, pick(want.detach()), f"{tag}: out")
        for name, got, ref in zip("qkv", local, full):
            assert_close_16(got.grad, pick(ref.grad), f"{tag}: d{name}")
        errors[f"thd{n}"] = float((out.double() - pick(want.detach())).abs().max())
    return errors


def _model_thd_check(rank, seed, calls):
    """A llama-tiny GPTModel at cp 2 under bf16 autocast with --attention-backend te and packed
    documents: every layer's TE call is thd, the work the model counts is TE's layout's
    (thd_work, here unlike our balanced layout's), and its per-token loss and gradients equal
    the same model's with our ring (sdpa) within bf16: losses rtol / atol 2e-2, each gradient's
    difference under GRAD_NORM_RTOL of its norm (two bf16 kernels)."""
    from megatron_sp.context_parallel.te_thd import thd_work
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import GPTModel, preset
    from megatron_sp.models.init import init_parameters
    config = preset("llama-tiny", num_layers=2, hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, ffn_hidden_size=128, vocab_size=300)
    mesh = ParallelMesh.from_sizes(cp=2)
    models = {name: GPTModel(config, mesh, attention_backend=name) for name in ("te", "sdpa")}
    init_parameters(models["te"], seed=seed)
    models["sdpa"].load_state_dict(models["te"].state_dict())
    gen = torch.Generator().manual_seed(seed + 7)
    tokens, labels = (torch.randint(0, 300, (B, S), generator=gen) for _ in range(2))
    ids = ids_of(THD_MIXES[3])
    losses, before = {}, len(calls)
    for name, model in models.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[name] = model(input_ids=tokens, labels=labels, document_ids=ids)
        losses[name].float().sum().backward()
    thd_calls = [c for c in calls[before:] if c["qkv_format"] == "thd"]
    assert len(thd_calls) == config.num_layers, calls[before:]     # one forward per layer
    layout = models["te"].cp_planner.layout(ids, B, S)
    counted = models["te"].take_cp_work()
    assert counted == thd_work(layout) and counted != layout.work(), (counted, layout.work())
    assert models["sdpa"].take_cp_work() == layout.work()
    torch.testing.assert_close(losses["te"].float(), losses["sdpa"].float(), rtol=2e-2, atol=2e-2)
    worst = 0.0
    for (name, p), q in zip(models["te"].named_parameters(), models["sdpa"].parameters()):
        relative = float((p.grad - q.grad).norm() / q.grad.norm())
        assert relative < GRAD_NORM_RTOL, (name, relative)
        worst = max(worst, relative)
    return worst


@pytest.mark.timeout(120)
def test_te_context_parallelism_on_two_ranks(seed):
    """TE's exchange over 2 gloo ranks (the stand-in gathers over the groups it is given): our
    zigzag tokens in, full attention out, for every cp_comm_type; TE's arguments as documented."""
    from megatron_sp.testing import run_distributed
    for errors in run_distributed(_te_cp_checks, 2, seed):
        assert len(errors) == 5 + 2 * len(THD_MIXES) + 2, errors
        assert max(errors.values()) < 0.05, errors


class _FakeGroup:
    def __init__(self, size, rank, ranks=None):
        self.size, self.rank, self.ranks = size, rank, ranks


def test_hierarchy_must_be_tes_order(te_stub, monkeypatch):
    """a2a+p2p over 4 = 2 x 2 ranks, seen from context rank 1 (a2a rank 1, p2p rank 0): TE puts
    position p2p rank * a + a2a rank at cp_global_ranks' index, so the a2a groups must be adjacent
    in the context group; swapped groups are refused. (Process groups faked: group arithmetic.)"""
    monkeypatch.setattr(te_cp, "group_size", lambda g: 1 if g is None else g.size)
    monkeypatch.setattr(te_cp, "group_rank", lambda g: 0 if g is None else g.rank)
    monkeypatch.setattr(te_cp, "group_global_ranks", lambda g: g.ranks)
    monkeypatch.setattr(te_cp, "RingLocalAttention", lambda group: nn.Identity())
    context = _FakeGroup(4, 1, [10, 11, 12, 13])
    a2a, p2p = _FakeGroup(2, 1), _FakeGroup(2, 0)
    attention = TEContextParallelAttention(context, "a2a+p2p", (a2a, p2p))
    assert attention.hierarchical_sizes == (2, 2) and attention.cp_size == 4
    with pytest.raises(LayoutError, match=r"this rank is context rank 1 but p2p rank 1 x 2 \+ "
                                          r"a2a rank 0 = 2: Transformer Engine's a2a\+p2p needs "
                                          r"the a2a groups adjacent"):
        TEContextParallelAttention(context, "a2a+p2p", (p2p, a2a))
    with pytest.raises(LayoutError, match=r"a2a\+p2p groups of 2 x 1 ranks do not make the context "
                                          r"group of 4"):
        TEContextParallelAttention(context, "a2a+p2p", (a2a, _FakeGroup(1, 0)))


def test_the_model_picks_tes_context_parallelism_for_the_te_backend(te_stub):
    """models.gpt.ring_attention_for: under a ring (cp > 1) the te backend's local attention is
    TE's context parallelism, any other backend's our ring; selective recompute wraps either."""
    from types import SimpleNamespace

    from megatron_sp.attention.backends import SDPAAttention, TEAttention
    from megatron_sp.context_parallel import RingLocalAttention
    from megatron_sp.memory import RecomputedAttention
    from megatron_sp.models.gpt import ring_attention_for
    mesh = SimpleNamespace(cp_group=None, cp_size=2)
    assert isinstance(ring_attention_for(TEAttention(), mesh), TEContextParallelAttention)
    assert isinstance(ring_attention_for(SDPAAttention(), mesh), RingLocalAttention)
    wrapped = ring_attention_for(RecomputedAttention(TEAttention()), mesh)
    assert isinstance(wrapped, RecomputedAttention)
    assert isinstance(wrapped.backend, TEContextParallelAttention)
    wrapped = ring_attention_for(RecomputedAttention(SDPAAttention()), mesh)
    assert isinstance(wrapped.backend, RingLocalAttention)


def test_pretrain_takes_documents_under_tes_ring_at_start_up(monkeypatch):
    """pretrain_gpt's start-up check: --attention-backend te with a ring passes with and without
    packed documents (TE's thd layout, p2p); a layout TE refuses is one sentence."""
    from types import SimpleNamespace

    from megatron_sp.cli.build import parse_job
    from megatron_sp.errors import ConfigError
    from megatron_sp.models import GPTConfig
    from megatron_sp.cli import startup_checks
    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512)
    mesh = SimpleNamespace(cp_size=2, tp_size=1, sp_size=1)
    flags = ["--mock-data", "--seq-length", "64", "--context-parallel-size", "2", "--bf16",
             "--attention-backend", "te"]
    assert startup_checks.ring_is_transformer_engine(parse_job(flags))
    startup_checks.check_te_context_parallel(parse_job(flags), config, mesh)       # passes
    startup_checks.check_te_context_parallel(parse_job(flags + ["--reset-attention-mask"]),
                                             config, mesh)                      # passes: thd
    odd = GPTConfig(num_layers=2, hidden_size=48, num_attention_heads=4, vocab_size=512)
    with pytest.raises(ConfigError, match=r"multiple of 8, got 12: use --kv-channels 16"):
        startup_checks.check_te_context_parallel(parse_job(flags + ["--reset-attention-mask"]),
                                                 odd, mesh)
