"""--attention-backend flex (attention/flex.py) on CPU: FlexAttention's forward (eager: torch 2.13
has no CPU backward; gradients are checked on CUDA in tests/gpu/test_attention_cuda.py) against
the full-mask SDPA reference; the block mask built once per step for every layer (counted); the
ring block kernel's out and lse against attention_with_lse; SDPA's kernel plan (no GPU needed).

Tolerances, fp32: out and lse 1e-5.
"""
import pytest
import torch
from torch.nn.attention import SDPBackend

from megatron_sp.attention import flex, get_attention_backend, sdpa_kernel_plan
from megatron_sp.attention.flex import FlexAttention
from megatron_sp.attention.kernels import LONG_CONTEXT, warns_at
from megatron_sp.attention.lse import attention_with_lse, document_index, merge_partials
from megatron_sp.errors import ConfigError
from library_helpers import flex_attention_with_lse
from test_attention_blockwise import (allowed_mask, assert_close, random_documents,
                                                 reference)

FWD_TOL = 1e-5


@pytest.mark.parametrize("seed", range(3))
def test_flex_forward_matches_full_mask_sdpa(seed):
    """Random shapes: documents (one-token, whole-row), sliding window, GQA, causal or not;
    lengths that are not a multiple of the 128-token block. (Eager CPU flex retraces per shape and
    mask, ~1 s each: few cases.)"""
    gen = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 4, (1,), generator=gen))
    s = int(torch.randint(8, 200, (1,), generator=gen))
    g = int(torch.randint(1, 3, (1,), generator=gen))
    h, d = g * int(torch.randint(1, 4, (1,), generator=gen)), 16
    q, k, v = (torch.randn(b, s, n, d, generator=gen) for n in (h, g, g))
    ids = random_documents(gen, b, s) if seed != 1 else None
    causal = seed != 2
    window = int(torch.randint(1, s, (1,), generator=gen)) if seed in (0, 1) else None
    backend = FlexAttention()
    with torch.no_grad():
        got = backend(q, k, v, causal=causal, document_ids=ids, window=window, softmax_scale=0.2)
    want = reference(q, k, v, allowed_mask(ids, s, causal, window, b), scale=0.2)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert_close(got, want, FWD_TOL, f"b={b} s={s} h={h} g={g} causal={causal} window={window}")


def test_block_mask_is_built_once_per_step_for_every_layer(monkeypatch):
    """A 3-layer model's forward with packed documents builds ONE block mask (the layers share it);
    the next step's document_ids (a new tensor) builds one more; the model's output equals the
    SDPA model's (same weights) within 1e-5."""
    from megatron_sp.models import GPTModel, preset
    from megatron_sp.models.init import init_parameters
    calls = []
    real = flex.create_block_mask
    monkeypatch.setattr(flex, "create_block_mask",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cfg = preset("llama-tiny", num_layers=3, hidden_size=32, num_attention_heads=4,
                 num_query_groups=2, ffn_hidden_size=64, vocab_size=64)
    model, ref = GPTModel(cfg, attention_backend="flex"), GPTModel(cfg, attention_backend="sdpa")
    init_parameters(model, seed=1)
    init_parameters(ref, seed=1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, 40), generator=gen)
    with torch.no_grad():
        for step in range(2):
            docs = random_documents(gen, 2, 40)
            out = model(input_ids=ids, document_ids=docs)
            assert len(calls) == step + 1, calls
            assert_close(out, ref(input_ids=ids, document_ids=docs), FWD_TOL, f"step {step}")


def test_flex_refuses_cpu_training_and_dropout_in_one_sentence():
    q = torch.randn(1, 8, 2, 8, requires_grad=True)
    with pytest.raises(ConfigError) as err:
        FlexAttention()(q, q, q)
    assert str(err.value).startswith("--attention-backend flex cannot train on CPU: FlexAttention "
                                     "has no backward on CPU")
    assert "--attention-backend sdpa (or auto), whose blockwise path" in str(err.value)
    with pytest.raises(ConfigError, match="--attention-dropout 0"):
        FlexAttention()(q.detach(), q.detach(), q.detach(), dropout_p=0.1)
    assert get_attention_backend("flex").name == "flex"


@pytest.mark.parametrize("seed", [0])
def test_ring_block_kernel_returns_the_lse_that_merges(seed):
    """flex_attention_with_lse on ring block pairs (queries at a global offset against a key block
    at another, causal by global position, documents) equals attention_with_lse with the same
    mask, out and lse (-inf rows included); two key blocks merged = attention over both."""
    gen = torch.Generator().manual_seed(seed)
    b, c, h, g, d = 2, 24, 4, 2, 8
    s = 3 * c
    q, k, v = (torch.randn(b, s, n, d, generator=gen) for n in (h, g, g))
    doc = document_index(random_documents(gen, b, s))                  # [b, s], full row
    pos = torch.arange(s)
    qs = slice(c, 2 * c)                                               # the query block
    parts = []
    for ks in (slice(0, c), slice(c, 2 * c)):                          # behind, diagonal
        with torch.no_grad():
            out, lse = flex_attention_with_lse(
                q[:, qs], k[:, ks], v[:, ks], causal=True, q_offset=qs.start, k_offset=ks.start,
                doc_q=doc[:, qs], doc_k=doc[:, ks])
        mask = (doc[:, qs, None] == doc[:, None, ks]) & (pos[qs, None] >= pos[None, ks])
        want_out, want_lse = attention_with_lse(q[:, qs], k[:, ks], v[:, ks], causal=False,
                                                mask=mask)
        assert out.shape == (b, c, h, d) and lse.shape == (b, h, c) and lse.dtype == torch.float32
        assert_close(out, want_out, FWD_TOL, "out")
        finite = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        assert_close(lse[finite], want_lse[finite], FWD_TOL, "lse")
        parts.append((out, lse))
    merged, _ = merge_partials(*parts[0], *parts[1])
    allowed = (doc[:, qs, None] == doc[:, None, :2 * c]) & (pos[qs, None] >= pos[None, :2 * c])
    want = reference(q[:, qs], k[:, :2 * c], v[:, :2 * c], allowed)
    assert_close(merged, want, FWD_TOL, "merged")


@pytest.mark.parametrize("capability,dtype,mask,dropout,kernels,words", [
    ((9, 0), torch.bfloat16, False, 0.0, ("CUDNN_ATTENTION", "FLASH_ATTENTION",
                                          "EFFICIENT_ATTENTION"), "cuDNN attention, else flash"),
    ((9, 0), torch.bfloat16, False, 0.1, ("FLASH_ATTENTION", "EFFICIENT_ATTENTION"), "dropout"),
    ((8, 0), torch.bfloat16, False, 0.0, ("FLASH_ATTENTION", "EFFICIENT_ATTENTION"), "flash"),
    ((9, 0), torch.float32, False, 0.0, ("EFFICIENT_ATTENTION",), "fp32: flash and cuDNN"),
    ((9, 0), torch.float16, True, 0.0, ("EFFICIENT_ATTENTION",), "a mask"),
    ((7, 5), torch.float16, False, 0.0, ("EFFICIENT_ATTENTION",), "flash needs sm80+"),
    ((9, 0), torch.float64, False, 0.0, ("MATH",), "math kernel"),
    (None, torch.float32, True, 0.0, ("FLASH_ATTENTION",), "flash kernel (fp32, with a mask)"),
    (None, torch.bfloat16, False, 0.1, ("MATH",), "dropout, which the CPU flash kernel"),
])
def test_sdpa_kernel_plan(capability, dtype, mask, dropout, kernels, words):
    """The kernel choice, GPU-free: cuDNN on Hopper, else flash, else memory-efficient; math only
    when nothing else takes the call, with the reason, and warned about at long context only."""
    plan, reason = sdpa_kernel_plan(capability, dtype, mask, dropout, LONG_CONTEXT)
    assert tuple(k.name for k in plan) == kernels and words in reason, (plan, reason)
    assert SDPBackend.MATH not in plan or plan == (SDPBackend.MATH,)
    assert warns_at(plan, LONG_CONTEXT) == (kernels == ("MATH",))
    assert not warns_at(plan, LONG_CONTEXT - 1)
    assert sdpa_kernel_plan((9, 0), torch.bfloat16, False, 0.0, 512, cudnn=False)[0][0].name == \
        "FLASH_ATTENTION"                                  # torch's cuDNN switch off: flash first
