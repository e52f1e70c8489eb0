"""Attention with log-sum-exp, its block backward, the merge, blockwise attention, and the zigzag
layout and ring step plan of context parallelism (no process group; docs/design.md §14).

References: torch SDPA in fp32 with an explicit bool mask (out, and gradients by autograd) and an
fp64 logsumexp of the masked scores (lse). Tolerances, fp32: forward (out and lse) 1e-5,
gradients 1e-4. Every test draws fresh inputs from its parametrized seed.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_sp.attention.documents import document_causal_mask
from megatron_sp.attention.blockwise import blockwise_attention
from megatron_sp.attention.lse import (attention_backward_with_lse, attention_with_lse,
                                       backward_math, forward_math, merge_partials)
from megatron_sp.context_parallel import zigzag_merge, zigzag_positions, zigzag_split
from megatron_sp.mesh import LayoutError

FWD_TOL, GRAD_TOL = 1e-5, 1e-4
SEEDS = [0, 1, 2]


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _qkv(gen, b, sq, sk, h, g, d):
    q = torch.randn(b, sq, h, d, generator=gen)
    k = torch.randn(b, sk, g, d, generator=gen)
    v = torch.randn(b, sk, g, d, generator=gen)
    return q, k, v


def _allowed(b, sq, sk, causal, mask):
    """[b, sq, sk] bool: the keys each query sees (causal aligned at index 0, and the mask)."""
    allowed = torch.ones(b, sq, sk, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(sq, sk, dtype=torch.bool).tril()
    if mask is not None:
        allowed &= mask if mask.dim() == 3 else mask[None]
    return allowed


def _reference(q, k, v, allowed, scale=None):
    """(out [b, sq, h, d], lse [b, h, sq]): SDPA with an explicit mask; lse in fp64 then fp32."""
    b, sq, h, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=allowed[:, None], scale=scale,
                                         enable_gqa=True).transpose(1, 2)
    kk = k.double().repeat_interleave(h // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    lse = s.masked_fill(~allowed[:, None], float("-inf")).logsumexp(-1).float()
    return out, lse


def _random_mask(gen, b, sq, sk, batched):
    """A random bool mask with some rows fully masked (and, batched, differing per row)."""
    mask = torch.rand(b if batched else 1, sq, sk, generator=gen) < 0.6
    mask[:, torch.randperm(sq, generator=gen)[: max(1, sq // 4)]] = False
    return mask if batched else mask[0]


def _assert_close(actual, expected, tol, what):
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    err = (actual.float() - expected.float()).abs().max().item() if actual.numel() else 0.0
    assert err <= tol, f"{what}: max error {err:.3g} > {tol}"


def _assert_lse(actual, expected, what):
    """lse equal where finite, and -inf exactly where the reference is -inf."""
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(actual), finite), f"{what}: -inf rows differ"
    assert (actual[~finite] == float("-inf")).all(), f"{what}: a masked row is not -inf"
    _assert_close(actual[finite], expected[finite], FWD_TOL, what)


def _shape(gen):
    b = int(torch.randint(1, 3, (1,), generator=gen))
    g = int(torch.randint(1, 3, (1,), generator=gen))
    h = g * int(torch.randint(1, 4, (1,), generator=gen))
    sq, sk = (int(x) for x in torch.randint(1, 20, (2,), generator=gen))
    return b, sq, sk, h, g, 8


# attention_with_lse -----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("path", ["auto", "math"])
def test_attention_with_lse_matches_sdpa(seed, causal, path):
    gen = torch.Generator().manual_seed(seed)
    b, sq, sk, h, g, d = _shape(gen)
    q, k, v = _qkv(gen, b, sq, sk, h, g, d)
    scale = 0.3 if seed == 1 else None
    if path == "auto":         # unmasked on CPU: the fused flash kernel
        out, lse = attention_with_lse(q, k, v, causal=causal, scale=scale)
    else:
        out, lse = forward_math(q, k, v, causal, scale or 1 / math.sqrt(d), None)
    ref_out, ref_lse = _reference(q, k, v, _allowed(b, sq, sk, causal, None), scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    _assert_close(out, ref_out, FWD_TOL, "out")
    _assert_lse(lse, ref_lse, "lse")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batched", [False, True])
def test_attention_with_lse_masks_fully_masked_rows(seed, causal, batched):
    gen = torch.Generator().manual_seed(seed)
    b, sq, sk, h, g, d = _shape(gen)
    q, k, v = _qkv(gen, b, sq, sk, h, g, d)
    mask = _random_mask(gen, b, sq, sk, batched)
    out, lse = attention_with_lse(q, k, v, causal=causal, mask=mask)
    allowed = _allowed(b, sq, sk, causal, mask)
    ref_out, ref_lse = _reference(q, k, v, allowed)
    _assert_close(out, ref_out, FWD_TOL, "out")
    _assert_lse(lse, ref_lse, "lse")
    empty = ~allowed.any(-1)                                             # [b, sq]
    assert empty.any()
    assert (out.transpose(1, 2)[empty.unsqueeze(1).expand(b, h, sq)] == 0).all()


def test_attention_with_lse_refuses_bad_heads():
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        attention_with_lse(q, k, v, causal=True)


# merge_partials ---------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("causal", [False, True])
def test_merge_of_disjoint_key_halves_is_full_attention(seed, causal):
    gen = torch.Generator().manual_seed(seed)
    b, sq, _, h, g, d = _shape(gen)
    sk = 2 * int(torch.randint(2, 10, (1,), generator=gen))
    q, k, v = _qkv(gen, b, sq, sk, h, g, d)
    mask = torch.rand(b, sq, sk, generator=gen) < 0.7
    mask[:, 0, : sk // 2] = False                      # row 0: the first half fully masked
    mask[:, -1, sk // 2:] = False                      # last row: the second half fully masked
    mask[:, sq // 2] = False                           # a row masked in both halves
    allowed = _allowed(b, sq, sk, causal, mask)
    halves = [slice(0, sk // 2), slice(sk // 2, sk)]
    parts = [attention_with_lse(q, k[:, hs], v[:, hs], causal=False, mask=allowed[:, :, hs])
             for hs in halves]
    out, lse = merge_partials(*parts[0], *parts[1])
    ref_out, ref_lse = _reference(q, k, v, allowed)
    assert out.dtype == lse.dtype == torch.float32
    _assert_close(out, ref_out, FWD_TOL, "merged out")
    _assert_lse(lse, ref_lse, "merged lse")
    assert (out[:, sq // 2] == 0).all()


def test_merge_of_two_empty_rows_is_empty_not_nan():
    out = torch.randn(1, 3, 2, 4)
    lse = torch.full((1, 2, 3), float("-inf"))
    merged, merged_lse = merge_partials(out * 0, lse, out * 0, lse)
    assert (merged == 0).all() and (merged_lse == float("-inf")).all()
    # against an empty partial, a partial is unchanged
    lse2 = torch.randn(1, 2, 3)
    merged, merged_lse = merge_partials(torch.zeros_like(out), lse, out, lse2)
    assert torch.equal(merged, out) and torch.equal(merged_lse, lse2)


# attention_backward_with_lse --------------------------------------------------------------------

def _reference_grads(q, k, v, allowed, dout, scale=None):
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = _reference(*qkv, allowed, scale)
    out.backward(dout)
    return out.detach(), [t.grad for t in qkv]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_backward_with_lse_equals_autograd(seed, causal, masked):
    gen = torch.Generator().manual_seed(seed)
    b, sq, sk, h, g, d = _shape(gen)
    q, k, v = _qkv(gen, b, sq, sk, h, g, d)
    mask = _random_mask(gen, b, sq, sk, True) if masked else None
    allowed = _allowed(b, sq, sk, causal, mask)
    dout = torch.randn(b, sq, h, d, generator=gen)
    out, lse = attention_with_lse(q, k, v, causal=causal, mask=mask)
    ref_out, ref = _reference_grads(q, k, v, allowed, dout)
    grads = attention_backward_with_lse(q, k, v, out, dout, lse, causal=causal, mask=mask)
    math_grads = backward_math(q, k, v, out, dout, lse, causal, 1 / math.sqrt(d), mask)
    for name, got, got_math, want in zip("qkv", grads, math_grads, ref):
        assert got.shape == want.shape and got.dtype == torch.float32
        _assert_close(got, want, GRAD_TOL, f"d{name}")
        _assert_close(got_math, want, GRAD_TOL, f"d{name} (math path)")


@pytest.mark.parametrize("seed", SEEDS)
def test_block_backward_from_global_lse_sums_to_full_gradient(seed):
    """The ring's property: blocks' gradients from the GLOBAL out and lse add up to the full one."""
    gen = torch.Generator().manual_seed(seed)
    b, sq, _, h, g, d = _shape(gen)
    sk = 3 * int(torch.randint(1, 6, (1,), generator=gen))
    q, k, v = _qkv(gen, b, sq, sk, h, g, d)
    dout = torch.randn(b, sq, h, d, generator=gen)
    allowed = _allowed(b, sq, sk, False, None)
    out, lse = attention_with_lse(q, k, v, causal=False)
    _, (dq_ref, dk_ref, dv_ref) = _reference_grads(q, k, v, allowed, dout)
    dq, dks, dvs = torch.zeros_like(dq_ref), [], []
    for ks in (slice(0, sk // 3), slice(sk // 3, sk)):
        gq, gk, gv = attention_backward_with_lse(q, k[:, ks], v[:, ks], out, dout, lse,
                                                 causal=False)
        dq += gq
        dks.append(gk)
        dvs.append(gv)
    _assert_close(dq, dq_ref, GRAD_TOL, "dq")
    _assert_close(torch.cat(dks, 1), dk_ref, GRAD_TOL, "dk")
    _assert_close(torch.cat(dvs, 1), dv_ref, GRAD_TOL, "dv")


# blockwise_attention ----------------------------------------------------------------------------

def _documents(gen, b, s, kind):
    """[b, s] ids: random runs, one-token documents, or row 0 a single document (whole row)."""
    if kind == "none":
        return None
    if kind == "one-token":
        ids = torch.arange(s).expand(b, s).clone()
        ids[:, s // 2:] = s                                    # one-token docs, then a long one
        return ids
    ids = (torch.rand(b, s, generator=gen) < 0.2).cumsum(1)
    ids[0] = 7                                                 # a document spanning row 0
    return ids


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("documents", ["none", "random", "one-token"])
@pytest.mark.parametrize("causal", [True, False])
def test_blockwise_matches_reference(seed, documents, causal):
    gen = torch.Generator().manual_seed(seed)
    b, s, g = 2, 16, 2
    h, d = g * (1 + seed % 2), 8                               # MHA and GQA
    q, k, v = _qkv(gen, b, s, s, h, g, d)
    ids = _documents(gen, b, s, documents)
    dout = torch.randn(b, s, h, d, generator=gen)
    if ids is None:
        allowed = _allowed(b, s, s, causal, None)
    else:
        allowed = document_causal_mask(ids, causal=causal)[:, 0]
    ref_out, ref_grads = _reference_grads(q, k, v, allowed, dout)
    for block in (1, 3, 8, None) if causal else (2, 5, None):      # None: one block (s < 512)
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        out = blockwise_attention(*qkv, causal=causal, block=block, document_ids=ids)
        out.backward(dout)
        _assert_close(out, ref_out, FWD_TOL, f"out, block {block}")
        for name, t, want in zip("qkv", qkv, ref_grads):
            _assert_close(t.grad, want, GRAD_TOL, f"d{name}, block {block}")


class _SavedSizes:
    """Numbers of elements of every tensor saved for backward inside the context."""

    def __init__(self):
        self.sizes = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        self.sizes.append(t.numel())
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


@pytest.mark.parametrize("seed", [0])
def test_blockwise_saves_no_s_by_s_tensor(seed):
    gen = torch.Generator().manual_seed(seed)
    b, s, h, g, d = 1, 128, 2, 1, 8                            # b*s*h*d = 2048 < s*s = 16384
    q, k, v = (t.requires_grad_() for t in _qkv(gen, b, s, s, h, g, d))
    ids = (torch.rand(b, s, generator=gen) < 0.05).cumsum(1)
    with _SavedSizes() as reference:                           # the hook sees the s x s mask
        _reference(q, k, v, document_causal_mask(ids)[:, 0])[0].sum().backward()
    assert max(reference.sizes) >= s * s
    with _SavedSizes() as saved:
        out = blockwise_attention(q, k, v, causal=True, block=32, document_ids=ids)
    out.sum().backward()
    assert saved.sizes and max(saved.sizes) < s * s, saved.sizes


# zigzag layout and the ring's step plan ---------------------------------------------------------

@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_split_merge_round_trip_and_positions(cp, seed):
    s = 2 * cp * 3
    t = torch.randn(2, s, 5, generator=torch.Generator().manual_seed(seed))
    parts = [zigzag_split(t, cp, r) for r in range(cp)]
    assert torch.equal(zigzag_merge(parts, cp), t)
    for r, part in enumerate(parts):
        pos = zigzag_positions(s, cp, r)
        assert torch.equal(part, t[:, pos])
        c = s // (2 * cp)
        assert pos.tolist() == [*range(r * c, (r + 1) * c),
                                *range((2 * cp - 1 - r) * c, (2 * cp - r) * c)]
    assert sorted(torch.cat([zigzag_positions(s, cp, r) for r in range(cp)]).tolist()) == \
        list(range(s))
    t2 = t.transpose(0, 1)                                     # the sequence on dim 0
    parts = [zigzag_split(t2, cp, r, dim=0) for r in range(cp)]
    assert torch.equal(zigzag_merge(parts, cp, dim=0), t2)


def test_zigzag_refuses_a_length_with_the_numbers():
    with pytest.raises(LayoutError, match=r"sequence length of 30 .* multiple of 8, e\.g\. 24"):
        zigzag_split(torch.zeros(1, 30), cp=4, rank=0)
    with pytest.raises(LayoutError, match="multiple of 4"):
        zigzag_positions(6, cp=2, rank=1)
