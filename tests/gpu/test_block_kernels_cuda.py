"""The block kernels' CUDA paths (attention/block_kernels.py) against their math path, on a GPU
(skipped where there is none: a real condition, not a pass).

forward_batch / backward_batch with kernel "flash" (FlashAttention-2 varlen, bf16) and
"efficient" (memory-efficient kernel, fp32, TF32 off) equal kernel "math" (fp32 einsum) on the
same inputs: one ring rank's steps (cp 2 and 4, its zigzag chunks against every held block, the
plan's segment batches) without documents, with random documents and with one-token ones, MHA
and GQA, d 64 and 128; and hand-made batches of single-query segments (FlashAttention's
max_seqlen_q == 1 path, which swaps queries and heads under GQA). Backward is given the math
forward's out (in the inputs' dtype, as the ring saves it) and lse, so each kernel's backward is
compared alone. Tolerances: bf16 flash out / lse max abs error 3e-2 (both sides round out to
bf16: one bf16 step near |out| = 3 is 1.6e-2), gradients 3e-2 of the reference's max; fp32 efficient forward 1e-4, gradients 1e-3 (as test_attention_cuda.py).
Also the one-process ring rehearsal in bf16 against SDPA per document in fp32.
"""
import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from megatron_sp.attention import block_kernels  # noqa: E402
from megatron_sp.attention.segments import SegmentBatch, document_bounds, ring_plan  # noqa: E402
from megatron_sp.context_parallel.rehearsal import ring_rehearsal  # noqa: E402
from megatron_sp.context_parallel.zigzag import zigzag_split  # noqa: E402
from megatron_sp.testing import packed_document_ids  # noqa: E402

TOL = {"flash": (torch.bfloat16, 3e-2, 3e-2), "efficient": (torch.float32, 1e-4, 1e-3)}


def _documents(kind, gen, b, s):
    return packed_document_ids(kind, gen, b, s, rate=0.02)


def _rank_steps(q, k, v, plan, kernel, dtype, cp, rank):
    """One ring rank through its plan: forward with `kernel`, the held block of rank (r - i)
    mod cp at step i. Returns out, lse (fp32 accumulators)."""
    b, n, h, d = q.shape
    out = torch.zeros(b, n, h, d, dtype=torch.float32, device="cuda")
    lse = torch.full((b, n, h), float("-inf"), dtype=torch.float32, device="cuda")
    for i, batches in enumerate(plan.steps):
        src = (rank - i) % cp
        for batch in batches:
            block_kernels.forward_batch(q, k[src], v[src], batch, scale=1 / math.sqrt(d),
                                        out=out, lse=lse, kernel=kernel)
    return out, lse


def _rank_backward(q, k, v, out, dout, lse, plan, kernel, cp, rank):
    f32 = torch.float32
    d = q.shape[-1]
    dq = torch.zeros(q.shape, dtype=f32, device="cuda")
    dk = {j: torch.zeros(k[j].shape, dtype=f32, device="cuda") for j in k}
    dv = {j: torch.zeros(v[j].shape, dtype=f32, device="cuda") for j in v}
    for i, batches in enumerate(plan.steps):
        src = (rank - i) % cp
        for batch in batches:
            block_kernels.backward_batch(q, k[src], v[src], out, dout, lse, batch,
                                         scale=1 / math.sqrt(d), dq=dq, dk=dk[src], dv=dv[src],
                                         kernel=kernel)
    return dq, dk, dv


def _close(got, want, tol, what, relative=False):
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{what}: -inf rows differ"
    got, want = got[finite].float(), want[finite].float()
    scale = want.abs().max().clamp_min(1e-6).item() if relative else 1.0
    err = (got - want).abs().max().item() / scale
    assert err <= tol, f"{what}: max error {err:.3g} > {tol}" + (" of the max" if relative else "")


def _compare(kernel, q, k, v, dout, plan, cp, rank):
    dtype, fwd_tol, grad_tol = TOL[kernel]
    got = _rank_steps(q, k, v, plan, kernel, dtype, cp, rank)
    want = _rank_steps(q, k, v, plan, "math", dtype, cp, rank)
    _close(got[0], want[0], fwd_tol, f"{kernel} out")
    _close(got[1], want[1], fwd_tol, f"{kernel} lse")
    saved = want[0].to(dtype)                     # the ring saves out in the inputs' dtype
    g = _rank_backward(q, k, v, saved, dout, want[1], plan, kernel, cp, rank)
    w = _rank_backward(q, k, v, saved, dout, want[1], plan, "math", cp, rank)
    _close(g[0], w[0], grad_tol, f"{kernel} dq", relative=True)
    for j in k:
        _close(g[1][j], w[1][j], grad_tol, f"{kernel} dk of block {j}", relative=True)
        _close(g[2][j], w[2][j], grad_tol, f"{kernel} dv of block {j}", relative=True)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("heads,d", [((8, 8), 64), ((8, 2), 128)], ids=["mha-d64", "gqa-d128"])
@pytest.mark.parametrize("kind", ["none", "random", "one-token"])
def test_block_kernels_equal_the_math_path(kernel, cp, heads, d, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    dtype = TOL[kernel][0]
    (h, g), b, s = heads, 2, 128 * cp
    ids = _documents(kind, gen, b, s)
    full = [torch.randn(b, s, n, d, generator=gen).to("cuda", dtype) for n in (h, g, g, h)]
    rank = cp - 1
    q, dout = (zigzag_split(t, cp, rank) for t in (full[0], full[3]))
    k = {j: zigzag_split(full[1], cp, j) for j in range(cp)}
    v = {j: zigzag_split(full[2], cp, j) for j in range(cp)}
    plan = ring_plan(document_bounds(ids), b, s, cp, rank, causal=True)
    _compare(kernel, q, k, v, dout, plan, cp, rank)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
@pytest.mark.parametrize("causal", [False, True])
def test_single_query_segments_with_gqa(kernel, causal, seed):
    """Batches whose every segment has one query (max_seqlen_q == 1): FlashAttention-2 then
    swaps queries and heads under GQA and lays its lse out differently."""
    gen = torch.Generator().manual_seed(seed)
    dtype = TOL[kernel][0]
    b, n, h, g, d = 2, 64, 8, 2, 64
    q, dout = (torch.randn(b, n, h, d, generator=gen).to("cuda", dtype) for _ in range(2))
    k, v = ({0: torch.randn(b, n, g, d, generator=gen).to("cuda", dtype)} for _ in range(2))
    if causal:       # one-token causal squares (one-token documents on the diagonal)
        segments = tuple((r, i, i + 1, i, i + 1) for r in range(b) for i in range(0, n, 3))
    else:            # one query against a run of keys
        segments = tuple((r, i, i + 1, max(0, i - 9), i + 1) for r in range(b)
                         for i in range(1, n, 5))
    batch = SegmentBatch(causal, segments)

    class Plan:
        steps = [[batch]]
    _compare(kernel, q, k, v, dout, Plan, 1, 0)


def test_kernel_choice_on_this_device():
    cuda = torch.device("cuda")
    assert block_kernels.block_kernel(cuda, torch.bfloat16, 128) == "flash"
    assert block_kernels.block_kernel(cuda, torch.float32, 128) == "efficient"


def test_ring_rehearsal_in_bf16_matches_fp32_attention(seed):
    gen = torch.Generator().manual_seed(seed)
    b, s, h, g, d, cp = 1, 2048, 8, 2, 128, 4
    ids = (torch.rand(b, s, generator=gen) < 0.01).long().cumsum(1).cuda()
    q, dout = (torch.randn(b, s, h, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, s, g, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_rehearsal(*leaves, cp, document_ids=ids)
    out.backward(dout)
    ref = [t.float().requires_grad_() for t in (q, k, v)]
    kr, vr = (t.repeat_interleave(h // g, dim=2) for t in ref[1:])
    lengths = torch.unique_consecutive(ids[0].cpu(), return_counts=True)[1].tolist()
    pieces, a = [], 0
    for n in lengths:
        pieces.append(F.scaled_dot_product_attention(
            *(t[:, a:a + n].transpose(1, 2) for t in (ref[0], kr, vr)),
            is_causal=True).transpose(1, 2))
        a += n
    want = torch.cat(pieces, dim=1)
    want.backward(dout.float())
    _close(out.float(), want.detach(), 2e-2, "rehearsal out")
    for name, x, y in zip("qkv", leaves, ref):
        _close(x.grad.float(), y.grad, 5e-2, f"rehearsal d{name}", relative=True)
