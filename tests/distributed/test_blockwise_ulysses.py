"""The blockwise path under Ulysses, sp 2 and sp 4, on 4 gloo ranks in one spawn.

Every rank draws the same full-sequence q, k, v and packed documents (one-token documents, a
document spanning a whole row), takes its contiguous chunk and runs UlyssesAttention over (a) the
SDPA backend past MASK_TOKENS (lowered to 16 here, blocks of 8: packed documents go blockwise,
the s x s mask builder is replaced by a failure) and (b) blockwise attention with Mistral's
sliding window; each is compared with full-mask SDPA on the whole sequence, sliced to the rank's
chunk, forward and gradients. fp32 tolerances: forward 1e-5, gradients 1e-4.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_sp.attention import backends, lse
from megatron_sp.attention.documents import document_causal_mask
from megatron_sp.attention.blockwise import blockwise_attention
from megatron_sp.testing import run_distributed
from megatron_sp.ulysses import UlyssesAttention

WORLD = 4
FWD_TOL, GRAD_TOL = 1e-5, 1e-4
B, S, D = 2, 32, 8


class WindowedBlockwise(nn.Module):
    """blockwise_attention with a sliding window behind the local-attention signature."""

    def __init__(self, window: int, block: int):
        super().__init__()
        self.window, self.block = window, block

    def forward(self, q, k, v, *, causal=True, softmax_scale=None, document_ids=None,
                dropout_p=0.0):
        return blockwise_attention(q, k, v, causal=causal, scale=softmax_scale, block=self.block,
                                   document_ids=document_ids, window=self.window)


def _documents(seed):
    """[B, S]: row 0 one-token documents at the start then runs crossing every chunk boundary;
    row 1 one document over the whole row."""
    gen = torch.Generator().manual_seed(seed)
    ids = (torch.rand(B, S, generator=gen) < 0.1).long().cumsum(1) + 10
    ids[0, :5] = torch.arange(5)
    ids[1] = 3
    return ids


def _reference(q, k, v, ids, window):
    allowed = document_causal_mask(ids)[:, 0]                                 # [b, s, s]
    if window is not None:
        i = torch.arange(S)
        allowed = allowed & (i[:, None] - i[None, :] < window)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=allowed[:, None],
                                          enable_gqa=True).transpose(1, 2)


def _check(group, sp, sp_rank, local, h, g, window, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, n, D, generator=gen) for n in (h, g, g))
    grad = torch.randn(B, S, h, D, generator=gen)
    ids = _documents(seed)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = _reference(*full, ids, window)
    ref.backward(grad)
    chunk = slice(sp_rank * S // sp, (sp_rank + 1) * S // sp)
    mine = [t[:, chunk].clone().requires_grad_(True) for t in (q, k, v)]
    out = UlyssesAttention(local, group)(*mine, document_ids=ids)
    out.backward(grad[:, chunk])
    case = f"sp={sp} rank={sp_rank} h={h} g={g} window={window} {type(local).__name__}"
    torch.testing.assert_close(out, ref[:, chunk], atol=FWD_TOL, rtol=0, msg=case)
    for name, m, f in zip("qkv", mine, full):
        torch.testing.assert_close(m.grad, f.grad[:, chunk], atol=GRAD_TOL, rtol=0,
                                   msg=f"grad {name}, {case}")


def _checks(rank, world):
    backends.MASK_TOKENS = 16              # this process only: S = 32 is "long"
    lse.DEFAULT_BLOCK = 8                  # and split in 4 blocks

    def no_mask(*args, **kwargs):
        raise AssertionError("an s x s mask was built past MASK_TOKENS")
    backends.document_causal_mask = no_mask
    groups = {}
    for sp in (2, 4):
        for start in range(0, world, sp):
            group = dist.new_group(list(range(start, start + sp)))   # every rank calls new_group
            if start <= rank < start + sp:
                groups[sp] = group
    for sp, group in groups.items():
        sp_rank = rank % sp
        _check(group, sp, sp_rank, backends.SDPAAttention(), 8, 2, None, seed=10 * sp)   # GQA
        _check(group, sp, sp_rank, WindowedBlockwise(window=11, block=8), 4, 4, 11, seed=sp)
    return True


def test_blockwise_under_ulysses_sp2_and_sp4():
    assert run_distributed(_checks, WORLD) == [True] * WORLD
