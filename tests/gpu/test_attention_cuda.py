"""Attention paths that need a CUDA device (skipped where none is: a real condition, not a pass).

FlexAttention's gradients (compiled; CPU flex has no backward) and the blockwise path's CUDA
kernels against the full-mask SDPA reference in fp32 (forward 1e-4, gradients 1e-3: TF32-free
fp32 kernels, tolerances cover the Triton / fused kernels' accumulation order); `auto` sending
long packed documents through FlexAttention; SDPA's planned kernels running without the math
fallback warning in bf16.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from megatron_sp.attention import backends, get_attention_backend  # noqa: E402
from megatron_sp.attention.documents import document_causal_mask  # noqa: E402
from megatron_sp.attention.flex import FlexAttention  # noqa: E402
from megatron_sp.attention.blockwise import blockwise_attention  # noqa: E402
from megatron_sp.attention.lse import attention_with_lse  # noqa: E402
from library_helpers import flex_attention_with_lse  # noqa: E402  (tests/distributed)

FWD_TOL, GRAD_TOL = 1e-4, 1e-3


def _inputs(b, s, h, g, d, seed, dtype=torch.float32):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn(b, s, n, d, generator=gen, device="cuda", dtype=dtype)
                     for n in (h, g, g, h))
    ids = (torch.rand(b, s, generator=gen, device="cuda") < 0.01).long().cumsum(1)
    ids[0, :3] = torch.tensor([100, 101, 102], device="cuda")        # one-token documents
    if b > 1:
        ids[1] = 7                                                    # a whole-row document
    return q, k, v, dout, ids


def _allowed(ids, window=None):
    allowed = document_causal_mask(ids)[:, 0]
    if window is not None:
        i = torch.arange(ids.shape[1], device=ids.device)
        allowed = allowed & (i[:, None] - i[None, :] < window)
    return allowed


def _reference(q, k, v, allowed):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=allowed[:, None],
                                          enable_gqa=True).transpose(1, 2)


def _grads(fn, q, k, v, dout):
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*qkv)
    out.backward(dout)
    return out.detach(), [t.grad for t in qkv]


def _close(got, want, tol, what):
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3g} > {tol}"


def test_flex_and_blockwise_gradients_match_the_reference():
    """Documents and a sliding window together (each flex mask compiles its kernels: one case)."""
    window = 300
    q, k, v, dout, ids = _inputs(2, 1000, 8, 2, 64, seed=0)
    want, want_grads = _grads(lambda *t: _reference(*t, _allowed(ids, window)), q, k, v, dout)
    paths = {"flex": lambda *t: FlexAttention()(*t, document_ids=ids, window=window),
             "blockwise": lambda *t: blockwise_attention(*t, causal=True, block=256,
                                                         document_ids=ids, window=window)}
    for name, fn in paths.items():
        got, got_grads = _grads(fn, q, k, v, dout)
        _close(got, want, FWD_TOL, f"{name} out")
        for t, x, y in zip("qkv", got_grads, want_grads):
            _close(x, y, GRAD_TOL, f"{name} d{t}")


def test_flex_ring_block_and_fused_lse_kernels():
    """The ring block kernel (flex, offsets) and the blockwise path's fused CUDA kernels (flash in
    bf16, efficient in fp32) return the lse attention_with_lse's math path returns."""
    q, k, v, _, ids = _inputs(1, 512, 8, 2, 64, seed=1)
    out, lse = flex_attention_with_lse(q[:, 256:], k[:, :256], v[:, :256], causal=True,
                                       q_offset=256, k_offset=0)
    ref_out, ref_lse = attention_with_lse(q[:, 256:], k[:, :256], v[:, :256], causal=False,
                                          mask=torch.ones(256, 256, dtype=torch.bool,
                                                          device="cuda"))
    _close(out, ref_out, FWD_TOL, "flex ring out")
    _close(lse, ref_lse, FWD_TOL, "flex ring lse")
    for dtype, tol in ((torch.float32, FWD_TOL), (torch.bfloat16, 2e-2)):
        qd, kd, vd = (t.to(dtype) for t in (q, k, v))
        fused = attention_with_lse(qd, kd, vd, causal=True)                    # fused kernel
        math_ = attention_with_lse(qd, kd, vd, causal=True,                    # math (a mask)
                                   mask=torch.ones(512, 512, dtype=torch.bool, device="cuda"))
        _close(fused[0], math_[0], tol, f"fused out {dtype}")
        _close(fused[1], math_[1], tol, f"fused lse {dtype}")


def test_auto_sends_long_packed_documents_through_flex(monkeypatch):
    """auto without TE / flash-attn on CUDA: past MASK_TOKENS packed documents go through
    FlexAttention (one block mask per step), never the s x s mask."""
    backend = get_attention_backend("auto")
    if backend.name != "sdpa":
        pytest.skip(f"auto picked {backend.name} (TE / flash-attn installed)")
    assert backend.long_documents == "flex"
    monkeypatch.setattr(backends, "document_causal_mask",
                        lambda *a, **kw: pytest.fail("an s x s mask was built"))
    q, k, v, dout, ids = _inputs(1, 8192, 8, 2, 64, seed=2, dtype=torch.bfloat16)
    out = backend(q, k, v, document_ids=ids)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert backend._flex._masks.builds == 1


def test_sdpa_plan_runs_without_the_math_warning_in_bf16():
    q, k, v, _, _ = _inputs(2, 4096, 8, 2, 64, seed=3, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = backends.SDPAAttention()(q, k, v)
    assert not [w for w in caught if "math kernel" in str(w.message)], caught
    ref = _reference(q.float(), k.float(), v.float(),
                     torch.ones(4096, 4096, dtype=torch.bool, device="cuda").tril()[None])
    _close(out, ref, 2e-2, "bf16 SDPA")
