"""GPT model unit tests on one rank (no process group)."""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_sp.models import GPTConfig, GPTModel, preset
from megatron_sp.models.init import init_parameters
from megatron_sp.training.optimizer import LRScheduler, build_optimizer


def tiny(name, **kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=200)
    if name == "llama-tiny":
        base.update(num_query_groups=2, ffn_hidden_size=96)
    base.update(kw)
    return preset(name, **base)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_forward_shapes_loss_and_param_count(name):
    cfg = tiny(name)
    model = GPTModel(cfg)
    init_parameters(model, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    logits = model(ids)
    assert logits.shape == (2, 24, cfg.vocab_size)
    labels = torch.randint(0, cfg.vocab_size, (2, 24))
    per_token = model(ids, labels=labels)
    assert per_token.shape == (2, 24)
    ref = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(per_token.reshape(-1), ref, rtol=1e-5, atol=1e-5)
    # untrained model: loss near log(V)
    assert abs(per_token.mean().item() - math.log(cfg.vocab_size)) < 1.0
    n_params = sum(p.numel() for n, p in model.named_parameters())
    padding = (cfg.padded_vocab_size(1) - cfg.vocab_size) * cfg.hidden_size
    padding *= 1 if cfg.tie_embeddings else 2          # output layer rows are padded too
    assert n_params - padding == cfg.num_parameters()


def test_causality_future_tokens_do_not_change_past_logits():
    cfg = tiny("llama-tiny")
    model = GPTModel(cfg)
    init_parameters(model, seed=5)
    ids = torch.randint(0, cfg.vocab_size, (1, 20))
    ids2 = ids.clone()
    ids2[0, 12:] = torch.randint(0, cfg.vocab_size, (8,))
    torch.testing.assert_close(model(ids)[:, :12], model(ids2)[:, :12], rtol=0, atol=1e-6)


def test_initialisation_is_deterministic_and_scaled():
    cfg = tiny("gpt2-tiny")
    a, b = GPTModel(cfg), GPTModel(cfg)
    init_parameters(a, seed=9)
    init_parameters(b, seed=9)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    w = dict(a.named_parameters())
    assert torch.all(w["layers.0.input_norm.weight"] == 1)
    assert torch.all(w["layers.0.attention.qkv.bias"] == 0)
    std = w["layers.0.mlp.fc1.weight"].std().item()
    std_out = w["layers.0.mlp.fc2.weight"].std().item()
    assert abs(std - 0.02) < 0.002 and abs(std_out - 0.02 / math.sqrt(4)) < 0.002
    emb = w["embedding.word_embeddings.weight"]
    assert torch.all(emb[cfg.vocab_size:] == 0)        # padding rows start at zero


def test_training_reduces_loss_on_a_repeated_batch():
    torch.manual_seed(0)
    cfg = tiny("llama-tiny")
    model = GPTModel(cfg)
    init_parameters(model, seed=1)
    opt = build_optimizer([model], lr=3e-3, weight_decay=0.0)
    ids = torch.randint(0, cfg.vocab_size, (4, 33))
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_config_validation_messages():
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by num_query_groups=4"):
        GPTConfig(num_layers=1, hidden_size=48, num_attention_heads=6, num_query_groups=4,
                  vocab_size=10)
    cfg = tiny("llama-tiny")  # 4 heads, 2 groups
    with pytest.raises(ValueError, match=r"tp\*sp=4\*2=8"):
        cfg.check_parallel(tp=4, sp=2)
    with pytest.raises(ValueError, match="num_query_groups=2 is not divisible by tp=4"):
        cfg.check_parallel(tp=4, sp=1)
    cfg3 = tiny("llama-tiny", num_attention_heads=12, num_query_groups=3, hidden_size=96)
    with pytest.raises(ValueError, match="do not fit Ulysses"):
        cfg3.check_parallel(tp=1, sp=2)
    assert preset("llama-8b").padded_vocab_size(8) == 128256 + (1024 - 128256 % 1024) % 1024


def test_presets_have_published_sizes():
    assert abs(preset("gpt2-small").num_parameters() / 1e6 - 124.4) < 0.5
    assert abs(preset("llama-8b").num_parameters() / 1e9 - 8.03) < 0.02
    assert abs(preset("llama-1b").num_parameters() / 1e9 - 1.236) < 0.01


def test_lr_schedule_shapes():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    s = LRScheduler(opt, max_lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110, style="cosine")
    assert s.lr_at(0) == 0 and s.lr_at(5) == 0.5 and s.lr_at(10) == 1.0
    assert abs(s.lr_at(60) - 0.55) < 1e-9 and s.lr_at(110) == pytest.approx(0.1) and s.lr_at(500) == 0.1
    w = LRScheduler(opt, 1.0, 0.0, 0, 100, style="WSD", wsd_decay_iters=20)
    assert w.lr_at(80) == 1.0 and w.lr_at(90) == pytest.approx(0.5) and w.lr_at(100) == 0.0
    lin = LRScheduler(opt, 1.0, 0.0, 0, 100, style="linear")
    assert lin.lr_at(25) == pytest.approx(0.75)
    isr = LRScheduler(opt, 1.0, 0.1, 10, 100, style="inverse-square-root")
    assert isr.lr_at(40) == pytest.approx(0.5) and isr.lr_at(400) == 0.1   # min_lr past decay


def test_swiglu_default_ffn_is_megatrons():
    """Megatron: int(4H*2/3 / 64) * 64 (rounded down) when --ffn-hidden-size is not given."""
    for hidden, ffn in ((256, 640), (2048, 5440), (4096, 10880)):
        cfg = GPTConfig(num_layers=1, hidden_size=hidden, num_attention_heads=8, vocab_size=10,
                        activation="swiglu")
        assert cfg.ffn_hidden_size == ffn


@pytest.mark.parametrize("seed", [0, 1])
def test_rotary_function_matches_rotate_half_and_its_gradient(seed):
    """apply_rotary (an autograd function that writes the rotated halves in place and rotates
    the gradient back) equals x * cos + rotate_half(x) * sin, value and gradient: float64
    gradcheck, and fp32 / bf16 against the autograd-traced formula (tolerances: fp32 1e-6; bf16
    one bf16 ulp of the values, 2^-6 at |x| < 4, the fused version rounds twice)."""
    from megatron_sp.models.gpt import RotaryEmbedding, apply_rotary
    gen = torch.Generator().manual_seed(seed)
    cos, sin = RotaryEmbedding(8, 10000.0)(torch.randint(0, 4096, (2, 16), generator=gen))

    def reference(x):
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)

    x64 = torch.randn(2, 16, 3, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: apply_rotary(x, cos.double(), sin.double()), (x64,))
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2.0 ** -6)):
        x = torch.randn(2, 16, 3, 8, generator=gen).clamp(-3.9, 3.9).to(dtype).requires_grad_()
        g = torch.randn(2, 16, 3, 8, generator=gen).clamp(-3.9, 3.9).to(dtype)
        ours, = torch.autograd.grad(apply_rotary(x, cos, sin), x, g)
        theirs, = torch.autograd.grad(reference(x), x, g)
        assert (apply_rotary(x, cos, sin).float() - reference(x).float()).abs().max() <= tol
        assert (ours.float() - theirs.float()).abs().max() <= tol
