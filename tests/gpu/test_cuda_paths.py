"""Checks that need a CUDA device (skipped where none is: a real condition, not a pass).

One GPU: the model in bf16 autocast against the fp32 CPU reference, SDPA's flash kernel through our
backend, the RNG tracker's CUDA stream, pinned activation offload, fused AdamW and a bit-exact
checkpoint resume of pretrain_gpt.py on the device; Transformer Engine and flash-attn against SDPA
when they are installed. Run everything GPU-side with
`bash tests/gpu/run_gpu_checks.sh` (these tests, then the timed long-context benchmark).
"""
import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from megatron_sp.memory import MemoryOptions  # noqa: E402
from megatron_sp.models import GPTModel, preset  # noqa: E402
from megatron_sp.models.init import init_parameters  # noqa: E402


def _config():
    return preset("llama-tiny", num_layers=2, hidden_size=256, num_attention_heads=8,
                  num_query_groups=2, ffn_hidden_size=512, vocab_size=1000)


def _loss_and_grads(model, ids, device, bf16):
    model = model.to(device)
    ids = ids.to(device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
    loss.backward()
    return loss.item(), {n: p.grad.float().cpu() for n, p in model.named_parameters()}


def _check_bf16_cuda_against_fp32_cpu(cfg, ids, what: str):
    """The same weights in bf16 on the device and fp32 on CPU: loss within 2e-2 relative, every
    gradient within 0.1 relative (bf16 tolerance)."""
    ref, gpu = GPTModel(cfg), GPTModel(cfg, attention_backend="sdpa")
    init_parameters(ref, seed=3)
    init_parameters(gpu, seed=3)
    loss_ref, grads_ref = _loss_and_grads(ref, ids, "cpu", bf16=False)
    loss_gpu, grads_gpu = _loss_and_grads(gpu, ids, "cuda", bf16=True)
    assert abs(loss_gpu - loss_ref) / loss_ref < 2e-2           # bf16 tolerance
    for name, g in grads_gpu.items():
        rel = (g - grads_ref[name]).norm() / grads_ref[name].norm().clamp(min=1e-12)
        assert rel < 0.1, f"{what}: {name}: relative gradient error {rel:.3f} in bf16"


def test_bf16_cuda_matches_fp32_cpu_reference():
    cfg = _config()
    ids = torch.randint(0, cfg.vocab_size, (2, 513), generator=torch.Generator().manual_seed(0))
    _check_bf16_cuda_against_fp32_cpu(cfg, ids, "llama")


def test_sdpa_backend_runs_the_flash_kernel():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from megatron_sp.attention import SDPAAttention
    q = torch.randn(2, 1024, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 1024, 8, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ref = SDPAAttention()(q.float(), k.float(), v.float())
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):              # raises if flash cannot run
        out = SDPAAttention()(q, k, v)
    assert (out.float() - ref).abs().max().item() < 3e-2


def test_rng_tracker_cuda_streams():
    from megatron_sp.tensor_parallel import RNGTracker
    masks = []
    for tp_rank in (0, 1, 0):
        tracker = RNGTracker(42, tp_rank=tp_rank, device="cuda")
        with tracker.fork():
            forked = torch.rand(1000, device="cuda")
        masks.append((forked, torch.rand(1000, device="cuda")))
    assert not torch.equal(masks[0][0], masks[1][0])           # tp ranks differ inside the fork
    assert torch.equal(masks[0][1], masks[1][1])               # identical outside it
    assert torch.equal(masks[0][0], masks[2][0])               # reproducible from the seed


def test_pinned_offload_with_full_recompute_equals_plain():
    cfg = _config()
    ids = torch.randint(0, cfg.vocab_size, (1, 1025))
    plain = GPTModel(cfg)
    offload = GPTModel(cfg, memory=MemoryOptions(recompute_granularity="full", mlp_tiles=4,
                                                 loss_chunks=4, offload_activations=True))
    init_parameters(plain, seed=5)
    init_parameters(offload, seed=5)
    loss_a, grads_a = _loss_and_grads(plain, ids, "cuda", bf16=False)
    loss_b, grads_b = _loss_and_grads(offload, ids, "cuda", bf16=False)
    assert abs(loss_a - loss_b) <= 1e-5 * abs(loss_a)
    for name in grads_a:
        assert (grads_a[name] - grads_b[name]).abs().max().item() < 1e-4, name


def test_fused_adamw_on_cuda():
    from megatron_sp.training.optimizer import build_optimizer
    model = GPTModel(_config()).cuda()
    opt = build_optimizer([model], lr=1e-3)
    assert opt.defaults.get("fused") or type(opt).__name__ == "FusedAdam"


def test_pretrain_gpt_resume_on_cuda_is_exact(tmp_path):
    import pretrain_gpt
    common = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "128",
              "--num-attention-heads", "4", "--seq-length", "256", "--micro-batch-size", "2",
              "--global-batch-size", "4", "--log-interval", "1", "--eval-iters", "0", "--bf16",
              "--lr-decay-iters", "8"]
    straight, resumed = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    pretrain_gpt.main(common + ["--train-iters", "8", "--metrics-jsonl", str(straight)])
    pretrain_gpt.main(common + ["--train-iters", "4", "--save", str(tmp_path / "ck"),
                                "--metrics-jsonl", str(resumed)])
    pretrain_gpt.main(common + ["--train-iters", "8", "--load", str(tmp_path / "ck"),
                                "--metrics-jsonl", str(resumed)])
    read = lambda p: [json.loads(l)["lm_loss"] for l in p.read_text().splitlines() if "lm_loss" in l]
    assert read(straight) == read(resumed)


@pytest.mark.parametrize("family", ["qwen3 qk-norm yarn", "llama3.1 rope scaling"])
def test_bf16_cuda_families_match_fp32_cpu_reference(family):
    """The families' features (qk-norm with its fused bf16 norm, YaRN's cos/sin scaling, llama3
    frequencies) in bf16 on the device against fp32 on CPU."""
    shape = dict(num_layers=2, hidden_size=256, num_query_groups=2, ffn_hidden_size=512,
                 vocab_size=1000, max_position_embeddings=1024)
    if family.startswith("qwen3"):
        cfg = preset("qwen3-0.6b", num_attention_heads=4, kv_channels=128,
                     position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0,
                     yarn_original_max_position_embeddings=128, **shape)
    else:
        cfg = preset("llama3.1-8b", num_attention_heads=8, rope_original_max_position_embeddings=128,
                     **shape)
    ids = torch.randint(0, cfg.vocab_size, (2, 513), generator=torch.Generator().manual_seed(0))
    _check_bf16_cuda_against_fp32_cpu(cfg, ids, family)


@pytest.mark.parametrize("backend,module", [("te", "transformer_engine"), ("flash", "flash_attn"),
                                            ("unfused", None)])
@pytest.mark.parametrize("documents", [False, True])
def test_fused_backend_matches_sdpa(backend, module, documents):
    """Transformer Engine and flash-attn (when installed) and the unfused backend against fp32
    SDPA, GQA, causal, with and without packed documents; forward and the gradient of q (bf16
    tolerance)."""
    if module is not None:
        pytest.importorskip(module)
    from megatron_sp.attention import SDPAAttention, get_attention_backend
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2, 1024, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(2, 1024, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 1024, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    docs = None
    if documents:                                              # three documents per sequence
        docs = torch.zeros(2, 1024, dtype=torch.long, device="cuda")
        docs[:, 300:] = 1
        docs[:, 700:] = 2
    out = get_attention_backend(backend)(q, k, v, document_ids=docs)
    qf = q.detach().float().requires_grad_()
    ref = SDPAAttention()(qf, k.float(), v.float(), document_ids=docs)
    assert (out.float() - ref).abs().max().item() < 3e-2
    out.float().sum().backward()
    ref.sum().backward()
    assert ((q.grad.float() - qf.grad).norm() / qf.grad.norm()).item() < 2e-2
