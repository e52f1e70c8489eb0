"""Attention backends against a naive reference (explicit softmax over causal-masked scores).

TE and flash-attn cannot be installed on CPU; their glue is tested with stand-in modules injected
into sys.modules that honour the documented signatures (flash_attn.flash_attn_func /
flash_attn_varlen_func, transformer_engine.pytorch.DotProductAttention) and compute the reference.
Tolerances (fp32, reference in fp64): forward 1e-5, gradients 1e-4.
"""
import sys
import types

import pytest
import torch
from torch import nn

from megatron_sp.attention import (AttentionBackendUnavailable, FlashAttention, SDPAAttention,
                                   TEAttention, cu_seqlens_from_document_ids, document_causal_mask,
                                   get_attention_backend)
from megatron_sp.attention.backends import UnfusedAttention

FWD_TOL, GRAD_TOL = 1e-5, 1e-4


def reference_attention(q, k, v, causal=True, softmax_scale=None, document_ids=None):
    """Naive attention in fp64: q [b, s, h, d], k/v [b, s, g, d] -> [b, s, h, d] in q's dtype."""
    b, s, h, d = q.shape
    g = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))      # [b, heads, s, d]
    kd, vd = kd.repeat_interleave(h // g, 1), vd.repeat_interleave(h // g, 1)  # [b, h, s, d]
    scores = qd @ kd.transpose(-1, -2) * scale                          # [b, h, s, s]
    allowed = torch.ones(s, s, dtype=torch.bool).tril() if causal else torch.ones(s, s, dtype=torch.bool)
    allowed = allowed.expand(b, 1, s, s)
    if document_ids is not None:
        # explicit loop definition: same document = no id change between j and i
        same = torch.zeros(b, 1, s, s, dtype=torch.bool)
        for r in range(b):
            doc, ids = [], document_ids[r].tolist()
            for t in range(s):
                doc.append(0 if t == 0 else doc[-1] + (ids[t] != ids[t - 1]))
            doc = torch.tensor(doc)
            same[r, 0] = doc[:, None] == doc[None, :]
        allowed = allowed & same
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ vd).transpose(1, 2).to(q.dtype)                    # [b, s, h, d]


def random_documents(b, s, generator):
    """[b, s] increasing segment ids with random boundaries (at least one inside each row)."""
    starts = torch.rand(b, s, generator=generator) < 0.15
    starts[:, 0] = False
    starts[:, s // 2] = True
    return starts.long().cumsum(1) + 7  # arbitrary offset: only changes matter


def make_inputs(b=2, s=24, h=8, g=2, d=16, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=gen, dtype=dtype)
    k = torch.randn(b, s, g, d, generator=gen, dtype=dtype)
    v = torch.randn(b, s, g, d, generator=gen, dtype=dtype)
    grad = torch.randn(b, s, h, d, generator=gen, dtype=dtype)
    return q, k, v, grad, gen


def forward_backward(fn, q, k, v, grad, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, **kwargs)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def assert_matches_reference(backend, q, k, v, grad, **kwargs):
    out, *grads = forward_backward(backend, q, k, v, grad, **kwargs)
    ref, *ref_grads = forward_backward(reference_attention, q, k, v, grad, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=FWD_TOL, rtol=0)
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got, want, atol=GRAD_TOL, rtol=0, msg=f"grad of {name}")


def assert_matches_reference_bf16(backend, q, k, v, grad, **kwargs):
    """The fused backends take 16-bit inputs: run them in bf16 and compare against the fp32
    reference on the same (bf16-rounded) values; tolerances cover bf16 rounding (~3 digits)."""
    q, k, v, grad = (t.to(torch.bfloat16) for t in (q, k, v, grad))
    out, *grads = forward_backward(backend, q, k, v, grad, **kwargs)
    ref, *ref_grads = forward_backward(reference_attention, *(t.float() for t in (q, k, v, grad)),
                                       **kwargs)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=0)
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got.float(), want, atol=6e-2, rtol=0, msg=f"grad of {name}")


# SDPA ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("h,g", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("packed", [False, True])
def test_sdpa_matches_reference(h, g, packed):
    q, k, v, grad, gen = make_inputs(h=h, g=g, seed=h * 10 + g + packed)
    docs = random_documents(q.shape[0], q.shape[1], gen) if packed else None
    assert_matches_reference(SDPAAttention(), q, k, v, grad, document_ids=docs)


def test_sdpa_scale_and_non_causal():
    q, k, v, grad, gen = make_inputs(h=4, g=2, seed=3)
    assert_matches_reference(SDPAAttention(), q, k, v, grad, softmax_scale=0.37)
    assert_matches_reference(SDPAAttention(), q, k, v, grad, causal=False)
    docs = random_documents(2, q.shape[1], gen)
    assert_matches_reference(SDPAAttention(), q, k, v, grad, causal=False, document_ids=docs)


def test_sdpa_keeps_dtype_and_applies_dropout():
    q, k, v, _, _ = make_inputs(h=4, g=2, dtype=torch.bfloat16)
    backend = SDPAAttention()
    assert backend(q, k, v).dtype == torch.bfloat16
    q, k, v, _, _ = make_inputs(h=4, g=2)
    torch.manual_seed(0)
    dropped = backend(q, k, v, dropout_p=0.5)
    assert not torch.allclose(dropped, backend(q, k, v))


@pytest.mark.parametrize("h,g,causal,seed", [(4, 4, True, 0), (8, 2, True, 1), (6, 1, False, 2)])
def test_sdpa_long_packed_documents_run_blockwise_without_an_s_by_s_tensor(monkeypatch, h, g,
                                                                         causal, seed):
    """Past MASK_TOKENS (lowered here to keep the test small) packed documents on CPU take the
    blockwise path: the reference's results (1e-5 / 1e-4), no [b, 1, s, s] mask built and no
    [.., s, s] tensor saved for backward; below it too, unless attention dropout needs the mask."""
    from megatron_sp.attention import backends
    s = 96
    q, k, v, grad, gen = make_inputs(s=s, h=h, g=g, seed=seed)
    docs = random_documents(2, s, gen)
    docs[0, :4] = docs[0, 4] - 1                    # a short document at the start of a row
    docs[1] = docs[1, 0]                            # one document spanning the whole row
    monkeypatch.setattr(backends, "MASK_TOKENS", 32)
    masks = []
    real_mask = backends.document_causal_mask
    monkeypatch.setattr(backends, "document_causal_mask",
                        lambda *a, **kw: masks.append(1) or real_mask(*a, **kw))
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        assert_matches_reference(SDPAAttention(), q, k, v, grad, causal=causal, document_ids=docs)
    assert masks == []
    saved.clear()                  # the backend alone (the reference above saves s x s tensors)
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        SDPAAttention()(qq, kk, vv, causal=causal, document_ids=docs)
    assert saved and all(list(shape).count(s) < 2 for shape in saved), saved   # no [.., s, s]
    monkeypatch.setattr(backends, "MASK_TOKENS", s)          # at the limit: segments still,
    SDPAAttention()(q, k, v, causal=causal, document_ids=docs)   # the mask only with dropout
    assert masks == []
    SDPAAttention()(q, k, v, causal=causal, document_ids=docs, dropout_p=0.1)
    assert masks == [1]


def test_sdpa_unpacked_builds_no_mask(monkeypatch):
    """The unpacked path hands SDPA is_causal=True and no mask (no s x s tensor)."""
    seen = {}
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    q, k, v, _, _ = make_inputs(h=8, g=2)
    SDPAAttention()(q, k, v)
    assert seen["attn_mask"] is None and seen["is_causal"] is True and seen["enable_gqa"] is True


# Unfused (Megatron's --attention-backend unfused) ------------------------------------------------

@pytest.mark.parametrize("h,g", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("packed", [False, True])
def test_unfused_matches_reference(h, g, packed):
    """fp32 against the fp64 reference (1e-5 / 1e-4), GQA and packed documents; scale and
    non-causal; bf16 within bf16 rounding (its scores are rounded to bf16 before the softmax)."""
    q, k, v, grad, gen = make_inputs(h=h, g=g, seed=h * 10 + g + packed + 100)
    docs = random_documents(q.shape[0], q.shape[1], gen) if packed else None
    assert_matches_reference(UnfusedAttention(), q, k, v, grad, document_ids=docs)
    assert_matches_reference(UnfusedAttention(), q, k, v, grad, document_ids=docs, causal=False,
                             softmax_scale=0.37)
    assert_matches_reference_bf16(UnfusedAttention(), q, k, v, grad, document_ids=docs)


def test_unfused_dropout_and_megatron_flag():
    """Dropout acts on the probabilities (seeded: reproducible, and different from no dropout);
    --attention-backend unfused builds this backend."""
    q, k, v, _, _ = make_inputs(h=4, g=2, seed=5)
    backend = get_attention_backend("unfused")
    assert isinstance(backend, UnfusedAttention) and backend.name == "unfused"
    torch.manual_seed(0)
    dropped = backend(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    assert torch.equal(dropped, backend(q, k, v, dropout_p=0.5))
    assert not torch.allclose(dropped, backend(q, k, v))


def test_shape_errors():
    q, k, v, _, _ = make_inputs(h=6, g=4)
    with pytest.raises(ValueError, match="6 query heads are not a multiple of 4"):
        SDPAAttention()(q, k, v)
    q, k, v, _, _ = make_inputs(h=4, g=2)
    with pytest.raises(ValueError, match="document_ids must be"):
        SDPAAttention()(q, k, v, document_ids=torch.zeros(2, 5, dtype=torch.long))


# Document boundaries ---------------------------------------------------------------------------

def test_cu_seqlens_and_mask():
    ids = torch.tensor([[0, 0, 1, 1, 1], [3, 3, 3, 4, 4]])
    cu, max_len = cu_seqlens_from_document_ids(ids)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 8, 10] and max_len == 3
    cu, max_len = cu_seqlens_from_document_ids(torch.tensor([[5, 5, 5, 5], [2, 9, 2, 2]]))
    assert cu.tolist() == [0, 4, 5, 6, 8] and max_len == 4  # a repeated id after a change is a new doc
    mask = document_causal_mask(torch.tensor([[0, 0, 1]]))
    assert mask.shape == (1, 1, 3, 3)
    assert mask[0, 0].tolist() == [[True, False, False], [True, True, False], [False, False, True]]


# Stand-ins for flash-attn and Transformer Engine ------------------------------------------------

def _varlen_reference(q, k, v, cu_q, cu_k, causal, scale):
    """Reference on [t, heads, d] tokens, one document per cu_seqlens interval."""
    outs = []
    for i in range(len(cu_q) - 1):
        a, bq = int(cu_q[i]), int(cu_q[i + 1])
        c, e = int(cu_k[i]), int(cu_k[i + 1])
        outs.append(reference_attention(q[None, a:bq], k[None, c:e], v[None, c:e], causal, scale)[0])
    return torch.cat(outs)


def make_flash_stub(calls):
    module = types.ModuleType("flash_attn")

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                        window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                        return_attn_probs=False):
        assert q.dim() == 4 and k.dim() == 4 and q.shape[2] % k.shape[2] == 0
        calls.append(dict(fn="func", q=q.shape, k=k.shape, dropout_p=dropout_p,
                          softmax_scale=softmax_scale, causal=causal))
        return reference_attention(q, k, v, causal, softmax_scale)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                               return_attn_probs=False, block_table=None):
        assert q.dim() == 3 and k.dim() == 3 and q.shape[1] % k.shape[1] == 0
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        assert int(cu_seqlens_q[-1]) == q.shape[0] and int(cu_seqlens_k[-1]) == k.shape[0]
        assert max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        calls.append(dict(fn="varlen", q=q.shape, k=k.shape, cu_q=cu_seqlens_q.tolist(),
                          cu_k=cu_seqlens_k.tolist(), max_q=max_seqlen_q, max_k=max_seqlen_k,
                          dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal))
        return _varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)

    module.flash_attn_func = flash_attn_func
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


def make_te_stub(calls, built):
    package = types.ModuleType("transformer_engine")
    te_pytorch = types.ModuleType("transformer_engine.pytorch")

    class DotProductAttention(nn.Module):
        def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None,
                     attention_dropout=0.0, qkv_format="sbhd", attn_mask_type="causal",
                     window_size=None, sequence_parallel=False, tp_size=1,
                     get_rng_state_tracker=None, tp_group=None, layer_number=None,
                     attention_type="self", cp_group=None, cp_global_ranks=None,
                     cp_stream=None, cp_comm_type="p2p", softmax_scale=None):
            super().__init__()
            self.h, self.d = num_attention_heads, kv_channels
            self.g = num_gqa_groups or num_attention_heads
            self.dropout, self.qkv_format, self.mask_type = attention_dropout, qkv_format, attn_mask_type
            self.scale = softmax_scale
            built.append((self.h, self.g, self.d, qkv_format, attn_mask_type))

        def forward(self, query_layer, key_layer, value_layer, attention_mask=None,
                    qkv_format=None, cu_seqlens_q=None, cu_seqlens_kv=None,
                    cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None,
                    max_seqlen_kv=None, attn_mask_type=None, window_size=None,
                    checkpoint_core_attention=False, core_attention_bias_type="no_bias",
                    core_attention_bias=None, alibi_slopes=None, fast_zero_fill=True):
            fmt = qkv_format or self.qkv_format
            mask_type = attn_mask_type or self.mask_type
            assert query_layer.shape[-2:] == (self.h, self.d)
            assert key_layer.shape[-2:] == (self.g, self.d) and value_layer.shape == key_layer.shape
            calls.append(dict(fmt=fmt, mask=mask_type, q=query_layer.shape, scale=self.scale,
                              dropout=self.dropout, training=self.training,
                              cu_q=None if cu_seqlens_q is None else cu_seqlens_q.tolist(),
                              cu_kv=None if cu_seqlens_kv is None else cu_seqlens_kv.tolist(),
                              max_q=max_seqlen_q, max_kv=max_seqlen_kv))
            causal = mask_type in ("causal", "padding_causal")
            if fmt == "bshd":
                assert cu_seqlens_q is None and mask_type in ("causal", "no_mask")
                out = reference_attention(query_layer, key_layer, value_layer, causal, self.scale)
                return out.reshape(*out.shape[:2], self.h * self.d)   # TE merges the heads
            assert fmt == "thd" and mask_type.startswith("padding")
            assert cu_seqlens_q.dtype == torch.int32 and isinstance(max_seqlen_q, int)
            out = _varlen_reference(query_layer, key_layer, value_layer, cu_seqlens_q,
                                    cu_seqlens_kv, causal, self.scale)
            return out.reshape(out.shape[0], self.h * self.d)

    te_pytorch.DotProductAttention = DotProductAttention
    package.pytorch = te_pytorch
    return {"transformer_engine": package, "transformer_engine.pytorch": te_pytorch}


@pytest.fixture
def flash_stub(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", make_flash_stub(calls))
    return calls


@pytest.fixture
def te_stub(monkeypatch):
    calls, built = [], []
    for name, module in make_te_stub(calls, built).items():
        monkeypatch.setitem(sys.modules, name, module)
    return calls, built


def test_flash_glue(flash_stub):
    backend = get_attention_backend("flash")
    assert isinstance(backend, FlashAttention) and backend.name == "flash"
    q, k, v, grad, gen = make_inputs(b=2, s=20, h=8, g=2, d=16, seed=5)
    backend(q, k, v)                      # fp32: flash-attn has no fp32 kernel, SDPA runs instead
    assert flash_stub == []
    assert_matches_reference_bf16(backend, q, k, v, grad, softmax_scale=0.3)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    call = flash_stub[-1]
    assert call == dict(fn="func", q=(2, 20, 8, 16), k=(2, 20, 2, 16), dropout_p=0.0,
                        softmax_scale=0.3, causal=True)

    docs = torch.tensor([[0] * 5 + [1] * 15, [4] * 12 + [5] * 3 + [6] * 5])
    assert_matches_reference_bf16(backend, q, k, v, grad, document_ids=docs)
    call = flash_stub[-1]
    assert call["fn"] == "varlen" and call["q"] == (40, 8, 16) and call["k"] == (40, 2, 16)
    assert call["cu_q"] == call["cu_k"] == [0, 5, 20, 32, 35, 40]
    assert call["max_q"] == call["max_k"] == 15 and call["causal"] is True
    assert call["softmax_scale"] is None and call["dropout_p"] == 0.0
    backend(q, k, v, document_ids=docs, dropout_p=0.1)
    assert flash_stub[-1]["dropout_p"] == 0.1


def test_te_glue(te_stub):
    calls, built = te_stub
    backend = get_attention_backend("te")
    assert isinstance(backend, TEAttention) and backend.name == "te"
    q, k, v, grad, gen = make_inputs(b=2, s=20, h=8, g=2, d=16, seed=6)
    backend(q, k, v)                      # fp32: TE's fused kernels are 16-bit, SDPA runs instead
    assert calls == []
    assert_matches_reference_bf16(backend, q, k, v, grad)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    call = calls[-1]
    assert call["fmt"] == "bshd" and call["mask"] == "causal" and call["q"] == (2, 20, 8, 16)
    assert call["scale"] == pytest.approx(16 ** -0.5) and call["cu_q"] is None
    assert call["dropout"] == 0.0 and call["training"] is False
    backend(q, k, v)
    assert built == [(8, 2, 16, "bshd", "causal")]  # cached per shape, not rebuilt

    docs = torch.tensor([[0] * 5 + [1] * 15, [4] * 12 + [5] * 3 + [6] * 5])
    assert_matches_reference_bf16(backend, q, k, v, grad, document_ids=docs, softmax_scale=0.2)
    call = calls[-1]
    assert call["fmt"] == "thd" and call["mask"] == "padding_causal" and call["q"] == (40, 8, 16)
    assert call["cu_q"] == call["cu_kv"] == [0, 5, 20, 32, 35, 40]
    assert call["max_q"] == call["max_kv"] == 15 and call["scale"] == 0.2
    backend(q[:, :, :4], k[:, :, :1], v[:, :, :1])  # another (h, g) shape: a second module
    assert len(built) == 3
    backend(q, k, v, dropout_p=0.1)
    assert calls[-1]["dropout"] == 0.1 and calls[-1]["training"] is True


# Selection and errors --------------------------------------------------------------------------

def test_missing_backends_raise_clear_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # None in sys.modules -> ImportError
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    with pytest.raises(AttentionBackendUnavailable, match=r"flash-attn package .*pip install flash-attn"):
        get_attention_backend("flash")
    with pytest.raises(AttentionBackendUnavailable, match=r"Transformer Engine package .*transformer_engine\[pytorch\]"):
        get_attention_backend("te")
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        get_attention_backend("xformers")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert get_attention_backend("auto").name == "sdpa"  # neither importable: SDPA


def test_auto_order(monkeypatch, flash_stub, te_stub):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert get_attention_backend("auto").name == "sdpa"  # no CUDA: never TE / flash
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert get_attention_backend("auto").name == "te"
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    assert get_attention_backend("auto").name == "flash"
    assert get_attention_backend("sdpa").name == "sdpa"
