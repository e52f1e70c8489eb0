"""Attention that returns its log-sum-exp, the block backward from a given lse, and the merge.

These are the pieces of every blockwise attention (FlashAttention's online softmax, ring
attention, Liu et al. 2023, Megatron-LM's context parallelism; docs/design.md §14). For queries
q_i and a key set K, with scores s_ij = q_i . k_j * scale,

    lse_i = log sum_{j in K} exp(s_ij)          [b, h, sq], fp32, -inf when row i sees no key
    out_i = sum_{j in K} exp(s_ij - lse_i) v_j  [b, sq, h, d], 0 when row i sees no key

Two partial results over DISJOINT key sets K1, K2 merge exactly (merge_partials, in fp32):

    lse = log(exp(lse1) + exp(lse2)) = max + log1p(exp(min - max))
    out = out1 exp(lse1 - lse) + out2 exp(lse2 - lse)

and the backward of any block needs only q, k, v of the block and the GLOBAL out and lse of the
merged result (attention_backward_with_lse): p = exp(s - lse) is then the block's slice of the
global softmax, so the blocks' gradients sum to the full gradient.

Blockwise attention (attention/blockwise.py) and ring attention (context_parallel/ring.py) run
these formulas through attention/block_kernels.py, over segments (attention/segments.py): it calls
the per-kernel pieces here (forward_math, forward_fused_cpu and their backwards; finite_lse) and
merges each partial into running fp32 accumulators in place with its own merge (the same formula
as merge_partials). attention_with_lse, attention_backward_with_lse and merge_partials are the
whole-block forms: the tests' reference, also for FlexAttention's ring block pair
(tests/distributed/library_helpers.py).

Shapes: q [b, sq, h, d], k, v [b, sk, g, d] with h % g == 0 (grouped-query attention: query head
i uses key/value head i // (h/g), the repeat_interleave layout of megatron_sp/ulysses/attention.py).
Kernels here: on CPU the fused `aten._scaled_dot_product_flash_attention_for_cpu` and its
backward (GQA as is, the lse returned / accepted; a window mask goes in as an additive 0 / -inf
mask of the block's size); on CUDA SDPA's flash op (fp16/bf16) or memory-efficient op for the
unmasked forward; the plain fp32 math path is the reference the tests use (block_kernels refuses
it for long blocks on CUDA).
"""
from __future__ import annotations

import math

import torch

from megatron_sp.attention.documents import document_index   # also imported from here (flex, tests)

FUSED_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


# Shapes and masks -------------------------------------------------------------------------------

def heads_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    """(h, g) of q [b, sq, h, d], k, v [b, sk, g, d]; refuses shapes GQA cannot take."""
    h, g = q.shape[2], k.shape[2]
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} (expected [b, sq, h, d] and [b, sk, g, d] twice).")
    if h % g != 0:
        raise ValueError(f"grouped-query attention needs the query heads h = {h} to be a multiple "
                         f"of the key/value heads g = {g}.")
    return h, g


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 inputs (fp64 inputs compute in fp64; the lse is fp32 always)."""
    return torch.promote_types(dtype, torch.float32)


def _allowed(causal: bool, mask, sq: int, sk: int, device) -> torch.Tensor | None:
    """The keys each query may see, [1 or b, sq, sk] bool (None: all of them)."""
    if mask is not None:
        mask = mask.to(device=device, dtype=torch.bool)
        mask = mask if mask.dim() == 3 else mask.unsqueeze(0)           # [sq, sk] -> [1, sq, sk]
    if causal:   # query i sees keys j <= i, both counted from index 0 of the block
        tril = torch.ones(sq, sk, dtype=torch.bool, device=device).tril().unsqueeze(0)
        mask = tril if mask is None else mask & tril
    return mask


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf rows (no key seen) replaced by 0, so that exp(s - lse) is 0 there, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


# Forward ----------------------------------------------------------------------------------------

def _scores(q, k, scale, allowed):
    """q [b, sq, h, d], k [b, sk, g, d] -> fp32 scores [b, g, h/g, sq, sk], -inf where masked."""
    dtype = _compute_dtype(q.dtype)
    g = k.shape[2]
    qg = q.to(dtype).unflatten(2, (g, -1))                   # [b, sq, h, d] -> [b, sq, g, h/g, d]
    s = torch.einsum("bqgrd,bkgd->bgrqk", qg, k.to(dtype)) * scale       # [b, g, h/g, sq, sk]
    if allowed is not None:
        s = s.masked_fill(~allowed[:, None, None], float("-inf"))  # mask [b|1, 1, 1, sq, sk]
    return s


def forward_math(q, k, v, causal, scale, mask):
    """The fp32 reference: (out [b, sq, h, d] in q's dtype, lse [b, h, sq] fp32)."""
    b, sq, h, d = q.shape
    s = _scores(q, k, scale, _allowed(causal, mask, sq, k.shape[1], q.device))
    lse = torch.logsumexp(s, dim=-1)                                     # [b, g, h/g, sq]
    p = torch.exp(s - finite_lse(lse).unsqueeze(-1))                          # [b, g, h/g, sq, sk]
    out = torch.einsum("bgrqk,bkgd->bqgrd", p, v.to(p.dtype))            # [b, sq, g, h/g, d]
    return out.reshape(b, sq, h, d).to(q.dtype), lse.reshape(b, h, sq).float()  # (g, h/g) -> h


def _additive(allowed, dtype):
    """[b or 1, sq, sk] bool (True = attend) -> [b or 1, 1, sq, sk] additive mask, 0 / -inf, in
    `dtype` (the CPU kernel takes a float mask of the query's dtype)."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed, float("-inf")).unsqueeze(1)


def forward_fused_cpu(q, k, v, causal, scale, mask=None):
    """aten's CPU flash kernel: takes [b, heads, s, d] (GQA as is), returns out, lse [b, h, sq].

    With a mask (causal folded into it) the kernel gives a row that sees no key out = 0 but
    lse = 0: such rows are set to lse = -inf here, as the merge expects."""
    allowed = None if mask is None else _allowed(causal, mask, q.shape[1], k.shape[1], q.device)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),     # [b, s, n, d] -> [b, n, s, d]
        0.0, causal and allowed is None, scale=scale,
        attn_mask=None if allowed is None else _additive(allowed, q.dtype))
    # out [b, h, sq, d] (laid out as [b, sq, h, d]) -> [b, sq, h, d]; lse [b, h, sq] (as [b, sq, h])
    lse = lse.float().contiguous()
    if allowed is not None:
        lse = lse.masked_fill(~allowed.any(-1).unsqueeze(1), float("-inf"))   # [b|1, 1, sq]
    return out.transpose(1, 2), lse


def _forward_fused_cuda(q, k, v, causal, scale):
    """SDPA's CUDA kernels with their log-sum-exp: flash for fp16 / bf16 (lse [b, h, sq]), else the
    memory-efficient kernel (any float dtype; its log_sumexp is [b, h, sq rounded up to 32]: the
    first sq columns are the lse). Neither takes GQA: the key/value heads are expanded."""
    r = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(r, dim=2) for t in (k, v))       # [b, sk, g, d] -> [b, sk, h, d]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))          # [b, s, h, d] -> [b, h, s, d]
    if q.dtype in (torch.float16, torch.bfloat16):
        try:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                qt, kt, vt, 0.0, causal, scale=scale)[:2]
            return out.transpose(1, 2), lse[:, :, :q.shape[1]].float()   # [b, sq, h, d], [b, h, sq]
        except RuntimeError:     # head dim / architecture flash does not take: efficient
            pass
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        qt, kt, vt, None, True, 0.0, causal, scale=scale)[:2]
    return out.transpose(1, 2), lse[:, :, :q.shape[1]].float()   # [b, sq, h, d], [b, h, sq]


def _use_fused_cpu(q, k, mask) -> bool:
    # The CPU kernel dies with SIGFPE on an empty query or key block (torch 2.13): never pass one.
    return (q.device.type == "cpu" and q.dtype in FUSED_CPU_DTYPES
            and q.shape[1] > 0 and k.shape[1] > 0)


def attention_with_lse(q, k, v, *, causal: bool, scale: float | None = None, mask=None):
    """Softmax attention of q [b, sq, h, d] over k, v [b, sk, g, d] and its log-sum-exp.

    Returns (out [b, sq, h, d] in q's dtype, lse [b, h, sq] fp32). causal: query i attends keys
    j <= i, both aligned at index 0 (the diagonal block of a ring or of blockwise attention).
    mask: optional bool [sq, sk] or [b, sq, sk], True = attend (document boundaries inside a
    block), combined with causal. A row that attends no key has lse = -inf and out = 0.
    """
    heads_of(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if _use_fused_cpu(q, k, mask):
        return forward_fused_cpu(q, k, v, causal, scale, mask)
    if q.device.type == "cuda" and mask is None and q.shape[1] > 0 and k.shape[1] > 0:
        try:
            return _forward_fused_cuda(q, k, v, causal, scale)
        except RuntimeError:     # head dim / alignment the kernel does not take: the math path
            pass
    return forward_math(q, k, v, causal, scale, mask)


# Backward ---------------------------------------------------------------------------------------

def backward_math(q, k, v, out, dout, lse, causal, scale, mask):
    """The block backward in fp32 from the given (global) out and lse; (dq, dk, dv) fp32."""
    b, sq, h, d = q.shape
    g = k.shape[2]
    s = _scores(q, k, scale, _allowed(causal, mask, sq, k.shape[1], q.device))
    dtype = s.dtype
    lse = finite_lse(lse.to(dtype)).reshape(b, g, h // g, sq)             # [b, h, sq] -> [b, g, h/g, sq]
    p = torch.exp(s - lse.unsqueeze(-1))                                 # [b, g, h/g, sq, sk]
    do = dout.to(dtype).unflatten(2, (g, -1))                            # [b, sq, g, h/g, d]
    delta = (do * out.to(dtype).unflatten(2, (g, -1))).sum(-1)           # [b, sq, g, h/g]
    dv = torch.einsum("bgrqk,bqgrd->bkgd", p, do)                        # sums the group's heads
    dp = torch.einsum("bqgrd,bkgd->bgrqk", do, v.to(dtype))              # [b, g, h/g, sq, sk]
    ds = p * (dp - delta.permute(0, 2, 3, 1).unsqueeze(-1))          # delta -> [b, g, h/g, sq, 1]
    dq = torch.einsum("bgrqk,bkgd->bqgrd", ds, k.to(dtype)) * scale      # [b, sq, g, h/g, d]
    dk = torch.einsum("bgrqk,bqgrd->bkgd", ds, q.to(dtype).unflatten(2, (g, -1))) * scale
    return dq.reshape(b, sq, h, d), dk, dv                               # dk, dv [b, sk, g, d]


def backward_fused_cpu(q, k, v, out, dout, lse, causal, scale, mask=None):
    """aten's CPU flash backward, run in fp32; it takes the lse it is given (GQA reduced inside)
    and recomputes p = exp(s - lse): a row with lse = -inf (no key seen anywhere) is given +inf,
    so that its p, and its gradients, are 0. A mask goes in as an additive one, causal folded in."""
    f = _compute_dtype(q.dtype)
    allowed = None if mask is None else _allowed(causal, mask, q.shape[1], k.shape[1], q.device)
    lse = lse.to(f).masked_fill(lse == float("-inf"), float("inf"))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *(t.to(f).transpose(1, 2) for t in (dout, q, k, v, out)),     # [b, s, n, d] -> [b, n, s, d]
        lse, 0.0, causal and allowed is None, scale=scale,
        attn_mask=None if allowed is None else _additive(allowed, f))
    return tuple(t.transpose(1, 2) for t in (dq, dk, dv))                # -> [b, s, n, d]


def attention_backward_with_lse(q, k, v, out, dout, lse, *, causal: bool,
                                scale: float | None = None, mask=None):
    """Gradients of one attention block, recomputed from q, k and a GIVEN lse [b, h, sq].

    out [b, sq, h, d] and lse are those of the merged (global) result, as ring attention needs:
    p = exp(q k^T scale - lse), dv = p^T dout, dp = dout v^T, delta = rowsum(dout * out),
    ds = p (dp - delta), dq = ds k scale, dk = ds^T q scale. Returns (dq [b, sq, h, d],
    dk, dv [b, sk, g, d]) in fp32 (fp64 for fp64 inputs); dk, dv are summed over the query heads
    of each group. Rows with lse = -inf (no key seen) contribute 0.
    """
    heads_of(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if _use_fused_cpu(q, k, mask):
        return backward_fused_cpu(q, k, v, out, dout, lse, causal, scale, mask)
    return backward_math(q, k, v, out, dout, lse, causal, scale, mask)


# Merge ------------------------------------------------------------------------------------------

def merge_partials(out1, lse1, out2, lse2):
    """Merge two attention results over disjoint key sets, in fp32 (docs/design.md §14).

    out [b, sq, h, d], lse [b, h, sq] each -> (out fp32, lse fp32). A row empty in both stays
    lse = -inf, out = 0 (the exps are guarded, never NaN).
    """
    lse1, lse2 = lse1.float(), lse2.float()
    hi, lo = torch.maximum(lse1, lse2), torch.minimum(lse1, lse2)
    lse = hi + torch.log1p(torch.exp(lo - finite_lse(hi)))                # both -inf: -inf + log1p(0)
    w1 = torch.exp(lse1 - finite_lse(lse)).transpose(1, 2).unsqueeze(-1)  # [b, h, sq] -> [b, sq, h, 1]
    w2 = torch.exp(lse2 - finite_lse(lse)).transpose(1, 2).unsqueeze(-1)
    return out1.float() * w1 + out2.float() * w2, lse
