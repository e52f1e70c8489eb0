"""The fused kernels behind blockwise and ring attention, over segments (attention/segments.py).

Forward: each SegmentBatch's partial attention, with its log-sum-exp, merged into running fp32
accumulators. Backward: each batch's gradients recomputed from the GIVEN global out and lse (what
a ring's backward needs: p = exp(q k^T scale - lse) is then the batch's slice of the global
softmax) and added into fp32 dq, dk, dv. Kernels, chosen by `block_kernel`:

    device, dtype        kernel (stock torch)                            calls      GQA
    CPU, any float       aten._scaled_dot_product_flash_attention_for_cpu   per segment  as is
                         and its _backward
    CUDA, fp16 / bf16    aten._flash_attention_forward / _backward          one per      as is
                         (FlashAttention-2, varlen: the batch's segments    batch
                         packed, cum_seq_q / cum_seq_k, at most PACK_TOKENS
                         queries per batch; a batch of one segment on views;
                         ring-flash-attention's approach)
    CUDA, fp32           aten._scaled_dot_product_efficient_attention       per segment  kv heads
                         and its _backward (lse padded to a multiple of 32)              repeated
    anything else        the fp32 math path (attention/lse.py): the tests' reference; a
                         block over MATH_LIMIT elements on CUDA is refused in one sentence

Accumulators are token-major, so a segment's rows are one slice: out [b, n, h, d] fp32 and
lse [b, n, h] fp32 (lse [b, h, n] is lse.transpose(1, 2)). No tensor larger than a segment's
[b, segment, heads, d] inputs is built here; the kernels tile the scores internally.
"""
from __future__ import annotations

import torch

from megatron_sp.attention.lse import (FUSED_CPU_DTYPES, backward_fused_cpu, backward_math,
                                       finite_lse, forward_fused_cpu, forward_math)
from megatron_sp.errors import ConfigError

MATH_LIMIT = 2048 * 2048      # query x key elements of a block the math path may take on CUDA
_HALF = (torch.float16, torch.bfloat16)


def _aten(name: str):
    """torch.ops.aten.<name> (the tests put stand-ins honouring the schemas here)."""
    return getattr(torch.ops.aten, name)


def block_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """"cpu", "flash", "efficient" or "math": the kernel a block of this device, dtype and head
    dimension runs (the table in the module docstring)."""
    if device.type == "cpu":
        return "cpu" if dtype in FUSED_CPU_DTYPES else "math"
    if device.type == "cuda":
        if dtype in _HALF and head_dim % 8 == 0 and head_dim <= 256:
            return "flash"
        if dtype in _HALF + (torch.float32,):
            return "efficient"
    return "math"


KERNEL_DESCRIPTIONS = {
    "cpu": "aten's CPU flash kernel, one call per segment",
    "flash": "FlashAttention-2 varlen (aten._flash_attention_forward/_backward), one call per "
             "batch of segments",
    "efficient": "the memory-efficient kernel (aten._scaled_dot_product_efficient_attention), "
                 "one call per segment",
    "math": "the fp32 math path (blocks up to 2048 x 2048 on CUDA)",
}


def _check_math(q, k):
    sq, sk = q.shape[1], k.shape[1]
    if q.device.type != "cpu" and sq * sk > MATH_LIMIT:
        raise ConfigError(
            f"a {sq} x {sk} attention block in {str(q.dtype).replace('torch.', '')} on "
            f"{q.device.type} has no fused kernel here and would run the fp32 math path "
            f"([b, h, {sq}, {sk}] scores): train in bf16 or fp16 (FlashAttention-2) or fp32 "
            f"(memory-efficient kernel) with a head dimension that is a multiple of 8.")


def _window_mask(q0, q1, k0, k1, window, device):
    """[1, sq, sk] bool, True = inside Mistral's window (local indices are global positions)."""
    if window is None:
        return None
    qpos = torch.arange(q0, q1, device=device)
    kpos = torch.arange(k0, k1, device=device)
    return (qpos[:, None] - kpos[None, :] < window).unsqueeze(0)


# Forward ----------------------------------------------------------------------------------------

def _merge_into(out, lse, o, l) -> None:
    """Merge a partial (o [.., h, d], l [.., h] fp32) into the accumulators out, lse (same
    leading shape, fp32, updated in place): lse' = log(e^lse + e^l), out' = out e^(lse - lse')
    + o e^(l - lse') (docs/design.md §14), -inf rows guarded."""
    hi, lo = torch.maximum(lse, l), torch.minimum(lse, l)
    new = hi + torch.log1p(torch.exp(lo - finite_lse(hi)))
    out.mul_(torch.exp(lse - finite_lse(new)).unsqueeze(-1))
    out.addcmul_(o, torch.exp(l - finite_lse(new)).unsqueeze(-1))        # no fp32 copy of o
    lse.copy_(new)


def _forward_efficient(q, k, v, causal, scale):
    """The memory-efficient kernel with its lse ([b', h, sq rounded up to 32]: the first sq
    columns are the lse); kv heads repeated for it."""
    (b, sq, h, d), g = q.shape, k.shape[2]
    kx, vx = (t.repeat_interleave(h // g, dim=2) for t in (k, v))  # [b, sk, g, d] -> [b, sk, h, d]
    out, lse = _aten("_scaled_dot_product_efficient_attention")(
        *(t.transpose(1, 2) for t in (q, kx, vx)), None, True, 0.0, causal,
        scale=scale)[:2]                                              # [b, s, n, d] -> [b, n, s, d]
    return out.transpose(1, 2), lse[:, :, :sq].float()             # [b, sq, h, d], [b, h, sq]


def _segment_forward(kernel, q, k, v, causal, scale, mask):
    """One segment: (o [b', sq, h, d], lse [b', h, sq] fp32)."""
    if kernel == "cpu":
        return forward_fused_cpu(q, k, v, causal, scale, mask)
    if kernel == "efficient" and mask is None:
        return _forward_efficient(q, k, v, causal, scale)
    _check_math(q, k)
    return forward_math(q, k, v, causal, scale, mask)


def _flash_forward(q, k, v, batch, scale, out, lse) -> None:
    """All of a batch's segments in one varlen FlashAttention-2 call, merged by token index; a
    batch of one segment (every row, or one row) runs on views, nothing copied."""
    if len(batch.segments) == 1:
        (rows, q0, q1, k0, k1), = batch.rows(q.shape[0])
        o, l = _aten("_flash_attention_forward")(
            q[rows, q0:q1], k[rows, k0:k1], v[rows, k0:k1], None, None, q1 - q0, k1 - k0, 0.0,
            batch.causal, False, scale=scale)[:2]                   # o [b', L, h, d], l [b', h, L]
        _merge_into(out[rows, q0:q1], lse[rows, q0:q1], o, l.float().transpose(1, 2))
        return
    (b, nq, h, d), (nk, g) = q.shape, k.shape[1:3]
    q_idx, k_idx, cu_q, cu_k, max_q, max_k = batch.packed(b, nq, nk, q.device)
    qp = q.reshape(b * nq, h, d).index_select(0, q_idx)             # [b, nq, h, d] -> [Tq, h, d]
    kp, vp = (t.reshape(b * nk, g, d).index_select(0, k_idx) for t in (k, v))   # [Tk, g, d]
    o, l = _aten("_flash_attention_forward")(qp, kp, vp, cu_q, cu_k, max_q, max_k, 0.0,
                                             batch.causal, False, scale=scale)[:2]
    flat_out, flat_lse = out.view(b * nq, h, d), lse.view(b * nq, h)   # token-major, flat
    acc_o, acc_l = flat_out.index_select(0, q_idx), flat_lse.index_select(0, q_idx)
    _merge_into(acc_o, acc_l, o, l.float().t())                     # l [h, Tq] -> [Tq, h]
    flat_out.index_copy_(0, q_idx, acc_o)
    flat_lse.index_copy_(0, q_idx, acc_l)


def forward_batch(q, k, v, batch, *, scale, out, lse, window=None, kernel=None) -> None:
    """Merge the attention of `batch`'s segments into out [b, nq, h, d] and lse [b, nq, h]
    (fp32, token-major, in place). q [b, nq, h, d], k, v [b, nk, g, d]. window: Mistral's
    sliding window as a per-segment mask (blockwise attention only; local = global indices)."""
    kernel = kernel or block_kernel(q.device, q.dtype, q.shape[-1])
    if kernel == "flash" and window is None:
        return _flash_forward(q, k, v, batch, scale, out, lse)
    for rows, q0, q1, k0, k1 in batch.rows(q.shape[0]):
        o, l = _segment_forward(kernel, q[rows, q0:q1], k[rows, k0:k1], v[rows, k0:k1],
                                batch.causal, scale, _window_mask(q0, q1, k0, k1, window,
                                                                  q.device))
        _merge_into(out[rows, q0:q1], lse[rows, q0:q1], o, l.transpose(1, 2))  # [b', h, L] -> [b', L, h]
    return None


# Backward ---------------------------------------------------------------------------------------

def _backward_efficient(q, k, v, out, dout, lse, causal, scale):
    """The memory-efficient kernel's backward from a given lse [b', h, sq] (padded here to a
    multiple of 32, its own layout); kv heads repeated for it and their gradients summed back."""
    (b, sq, h, d), g = q.shape, k.shape[2]
    r = h // g
    kx, vx = (t.repeat_interleave(r, dim=2) for t in (k, v))    # [b, sk, g, d] -> [b, sk, h, d]
    padded = torch.zeros(b, h, -(-sq // 32) * 32, dtype=torch.float32, device=q.device)
    padded[:, :, :sq] = lse
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = _aten("_scaled_dot_product_efficient_attention_backward")(
        *(t.transpose(1, 2) for t in (dout, q, kx, vx)), None, out.transpose(1, 2), padded,
        seed, seed, 0.0, [True, True, True, False], causal, scale=scale)[:3]   # [b, n, s, d]
    dq = dq.transpose(1, 2)                                         # [b, h, sq, d] -> [b, sq, h, d]
    dk, dv = (t.transpose(1, 2).unflatten(2, (g, r)).sum(3) for t in (dk, dv))  # -> [b, sk, g, d]
    return dq, dk, dv


def _segment_backward(kernel, q, k, v, out, dout, lse, causal, scale, mask):
    """One segment's (dq, dk, dv) from the given global out and lse [b', h, sq]."""
    if kernel == "cpu":
        return backward_fused_cpu(q, k, v, out, dout, lse, causal, scale, mask)
    if kernel == "efficient" and mask is None:
        return _backward_efficient(q, k, v, out, dout, lse, causal, scale)
    _check_math(q, k)
    return backward_math(q, k, v, out, dout, lse, causal, scale, mask)


def _flash_backward(q, k, v, out, dout, lse, batch, scale, dq, dk, dv) -> None:
    """All of a batch's segments in one varlen FlashAttention-2 backward, from the global out
    and lse; gradients added by token index (index_add_: keys may repeat across segments). A
    batch of one segment runs on views (only its lse is made contiguous, [b', h, L])."""
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)       # no dropout: unused
    unused = torch.empty(0, device=q.device)
    if len(batch.segments) == 1:
        (rows, q0, q1, k0, k1), = batch.rows(q.shape[0])
        gq, gk, gv = _aten("_flash_attention_backward")(
            dout[rows, q0:q1], q[rows, q0:q1], k[rows, k0:k1], v[rows, k0:k1], out[rows, q0:q1],
            lse[rows, q0:q1].transpose(1, 2).contiguous(), None, None, q1 - q0, k1 - k0, 0.0,
            batch.causal, rng_state, unused, scale=scale)
        dq[rows, q0:q1] += gq
        dk[rows, k0:k1] += gk
        dv[rows, k0:k1] += gv
        return
    (b, nq, h, d), (nk, g) = q.shape, k.shape[1:3]
    q_idx, k_idx, cu_q, cu_k, max_q, max_k = batch.packed(b, nq, nk, q.device)
    qp, op, dop = (t.reshape(b * nq, h, d).index_select(0, q_idx) for t in (q, out, dout))
    kp, vp = (t.reshape(b * nk, g, d).index_select(0, k_idx) for t in (k, v))   # [Tk, g, d]
    lp = lse.reshape(b * nq, h).index_select(0, q_idx).t().contiguous()   # [Tq, h] -> [h, Tq]
    gq, gk, gv = _aten("_flash_attention_backward")(dop, qp, kp, vp, op, lp, cu_q, cu_k,
                                                    max_q, max_k, 0.0, batch.causal, rng_state,
                                                    unused, scale=scale)
    dq.view(b * nq, h, d).index_add_(0, q_idx, gq.float())
    dk.view(b * nk, g, d).index_add_(0, k_idx, gk.float())
    dv.view(b * nk, g, d).index_add_(0, k_idx, gv.float())


def backward_batch(q, k, v, out, dout, lse, batch, *, scale, dq, dk, dv, window=None,
                   kernel=None) -> None:
    """Add `batch`'s gradients into dq [b, nq, h, d], dk, dv [b, nk, g, d] (fp32, in place),
    from the global out [b, nq, h, d] and lse [b, nq, h] (token-major fp32)."""
    kernel = kernel or block_kernel(q.device, q.dtype, q.shape[-1])
    if kernel == "flash" and window is None:
        return _flash_backward(q, k, v, out, dout, lse, batch, scale, dq, dk, dv)
    for rows, q0, q1, k0, k1 in batch.rows(q.shape[0]):
        gq, gk, gv = _segment_backward(
            kernel, q[rows, q0:q1], k[rows, k0:k1], v[rows, k0:k1], out[rows, q0:q1],
            dout[rows, q0:q1], lse[rows, q0:q1].transpose(1, 2), batch.causal, scale,
            _window_mask(q0, q1, k0, k1, window, q.device))         # lse [b', L, h] -> [b', h, L]
        dq[rows, q0:q1] += gq
        dk[rows, k0:k1] += gk
        dv[rows, k0:k1] += gv
    return None
