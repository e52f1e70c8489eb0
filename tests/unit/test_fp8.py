"""FP8 through torchao in our linears (megatron_sp.tensor_parallel.fp8, docs/design.md §17).

- The 20-step loss curves of a small Llama-style model through pretrain_gpt.py, on a corpus it
  learns (loss down by more than 0.2 in every run): FP8 (hybrid tensorwise; e4m3 rowwise)
  against the same run without FP8, in fp32 and under --bf16: every step within 2% relative (FP8's e4m3 keeps 3 mantissa bits: about 6% per value, averaged over
  the matmuls' sums), and the curves must differ (> 1e-4 relative at some step): a silent no-op
  fails.
- torch._scaled_mm (CPU) against torchao's fp32 emulation on one layer: forward and both
  gradients within 1% of their norm (the same FP8 operands; only the accumulation differs).
- FP8 reaches qkv, out-proj, fc1 and fc2 only (never the embedding, output layer, norms); a model
  with no FP8 layer under --fp8-format through torchao is refused (no silent high-precision run).
- A checkpoint saved with FP8 holds no FP8 tensor, resumes without FP8 and, saved without it,
  resumes with FP8; FP8 resumed from its own checkpoint equals the uninterrupted FP8 run (1e-6).
- MFU under FP8 takes the device's FP8 peak (the bf16 one where it has none).
- Refusals in one sentence: an unknown recipe, a recipe torchao does not run, and --fp8-format
  with neither Transformer Engine nor torchao (naming both).
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

pytest.importorskip("torchao.float8")

from megatron_sp.cli.arguments import parse_args   # noqa: E402
from megatron_sp.errors import ConfigError   # noqa: E402
from megatron_sp.mesh import ParallelMesh   # noqa: E402
from megatron_sp.tensor_parallel.fp8 import Fp8Groups, Fp8Plan, Fp8Recipe, fp8_linear   # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 20
TINY = ("--vocab-size 300 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
        "--num-query-groups 2 --ffn-hidden-size 128 --swiglu --position-embedding-type rope "
        "--normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights "
        "--seq-length 32 --micro-batch-size 4 --global-batch-size 4 --lr 3e-3 --lr-warmup-iters 2 "
        "--lr-decay-style cosine --min-lr 3e-4 --log-interval 1 --eval-iters 0 "
        "--attention-backend sdpa --attention-dropout 0 --hidden-dropout 0").split()
CURVE_RTOL = 0.02


def _main(argv):
    sys.path.insert(0, ROOT)
    import pretrain_gpt
    pretrain_gpt.main(argv)


def _losses(path):
    with open(path) as f:
        return {r["iteration"]: r["lm_loss"] for r in map(json.loads, f) if "lm_loss" in r}


def _run(tmp, name, flags, iters=STEPS, seed=5, decay=None):
    path = tmp / f"{name}.jsonl"
    data = [] if "--data-path" in flags else ["--mock-data"]
    _main(TINY + data + ["--train-iters", str(iters), "--lr-decay-iters", str(decay or iters),
                  "--seed", str(seed),
                  "--metrics-jsonl", str(path)] + flags)
    return _losses(path)


@pytest.fixture(scope="module")
def learnable(tmp_path_factory):
    """--data-path flags of a corpus a small model learns in 20 steps: 200 documents of 64 tokens,
    each token (7 t + 3) mod 300 of the one before, a random token one time in ten."""
    import numpy as np
    from megatron_sp.data import IndexedDatasetBuilder
    tmp = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(str(tmp / "c.bin"), np.uint16)
    for _ in range(200):
        doc = [int(rng.integers(0, 300))]
        for _ in range(63):
            doc.append((7 * doc[-1] + 3) % 300 if rng.random() > 0.1 else int(rng.integers(0, 300)))
        builder.add_document(np.array(doc), [len(doc)])
    builder.finalize(str(tmp / "c.idx"))
    return ["--data-path", str(tmp / "c"), "--split", "100,0,0", "--tokenizer-type",
            "NullTokenizer", "--data-cache-path", str(tmp / "cache")]


@pytest.mark.parametrize("precision,fp8s", [
    ([], [["--fp8-format", "hybrid"]]),
    (["--bf16"], [["--fp8-format", "hybrid"], ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"]]),
], ids=["fp32", "bf16"])
def test_fp8_loss_curve_follows_and_differs_from_the_run_without_fp8(tmp_path, learnable,
                                                                     precision, fp8s, seed):
    seed = seed % 1000
    base = _run(tmp_path, "base", learnable + precision, seed=seed)
    assert len(base) == STEPS and base[STEPS] < base[1] - 0.2      # it learns
    for fp8 in fp8s:
        curve = _run(tmp_path, "fp8", learnable + precision + fp8, seed=seed)
        rel = [abs(curve[i] - base[i]) / base[i] for i in range(1, STEPS + 1)]
        print(" ".join(precision + fp8), f"max rel {max(rel):.2e}", flush=True)
        assert max(rel) <= CURVE_RTOL, (fp8, rel)
        assert max(rel) > 1e-4, f"{fp8}: the FP8 curve equals the one without FP8: {rel}"
        assert curve[STEPS] < curve[1] - 0.2                               # and so does FP8


def _layer_case(recipe, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, 64, generator=g).requires_grad_()   # [b, s, K]
    w = (torch.randn(96, 64, generator=g) * 0.1).requires_grad_()   # [N, K]
    gy = torch.randn(2, 16, 96, generator=g)
    y = fp8_linear(x, w, None, Fp8Plan(recipe, Fp8Groups()))
    y.backward(gy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("fmt,recipe", [("hybrid", "tensorwise"), ("e4m3", "tensorwise"),
                                        ("hybrid", "rowwise"), ("e4m3", "rowwise_with_gw_hp")])
def test_scaled_mm_equals_emulation_and_is_near_the_exact_matmul(fmt, recipe, seed):
    real = _layer_case(Fp8Recipe(fmt, recipe, emulate=False), seed)
    emulated = _layer_case(Fp8Recipe(fmt, recipe, emulate=True), seed)
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(2, 16, 64, generator=g), torch.randn(96, 64, generator=g) * 0.1
    exact = x @ w.t()
    for a, b in zip(real, emulated):
        assert (a - b).norm() <= 0.01 * b.norm(), (fmt, recipe)
    err = (emulated[0] - exact).norm() / exact.norm()
    assert 1e-4 < err < 0.1, err          # FP8 rounding: present, and small


def test_fp8_reaches_the_four_linears_only():
    from megatron_sp.models import GPTModel, preset
    from megatron_sp.training.fp8 import enable_fp8
    cfg = preset("llama-tiny", num_layers=2, hidden_size=64, num_attention_heads=4,
                 num_query_groups=2, ffn_hidden_size=128, vocab_size=256)
    model = GPTModel(cfg)
    from megatron_sp.config import PrecisionConfig
    from megatron_sp.training.fp8 import check_layers_enabled
    precision = PrecisionConfig(fp8_format="hybrid", fp8_backend="torchao")
    with pytest.raises(ConfigError, match="no linear layer of this model runs in FP8"):
        check_layers_enabled(precision, [model])      # the Trainer's check: no silent bf16 run
    assert enable_fp8([model], Fp8Recipe(emulate=True), ParallelMesh.single()) == 8
    check_layers_enabled(precision, [model])
    on = sorted(name for name, m in model.named_modules() if getattr(m, "fp8", None) is not None)
    assert on == sorted(f"layers.{i}.{part}" for i in range(2) for part in
                        ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2"))
    assert model.output_layer.fp8 is None


def test_mfu_takes_the_fp8_peak_under_fp8():
    from megatron_sp.training.flops import peak_of
    assert peak_of("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_of("NVIDIA H100 80GB HBM3", fp8=True) == 1979.0
    assert peak_of("NVIDIA A100-SXM4-80GB", fp8=True) == 312.0      # no FP8: the bf16 peak


def _dtypes(ckpt_dir):
    from torch.distributed.checkpoint import FileSystemReader
    it = open(os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt")).read().strip()
    folder = [d for d in os.listdir(ckpt_dir) if d.startswith("iter_")
              and int(d[5:]) == int(it)][0]
    meta = FileSystemReader(os.path.join(ckpt_dir, folder)).read_metadata()
    return {str(m.properties.dtype) for m in meta.state_dict_metadata.values()
            if hasattr(m, "properties")}


def test_checkpoints_stay_high_precision_and_resume_across_fp8(tmp_path):
    fp8 = ["--fp8-format", "hybrid"]
    straight = _run(tmp_path, "straight", fp8, iters=4, decay=6)
    _run(tmp_path, "first", fp8 + ["--save", str(tmp_path / "a"), "--save-interval", "2"],
         iters=2, decay=6)
    assert not any("float8" in d for d in _dtypes(tmp_path / "a")), _dtypes(tmp_path / "a")
    again = _run(tmp_path, "again", fp8 + ["--load", str(tmp_path / "a")], iters=4, decay=6)
    for i in (3, 4):                       # no FP8 state: the resumed run is the straight one
        assert abs(again[i] - straight[i]) <= 1e-6 * straight[i], (again, straight)
    plain = _run(tmp_path, "plain", ["--load", str(tmp_path / "a"), "--save", str(tmp_path / "b"),
                                     "--save-interval", "4"], iters=4, decay=6)
    assert sorted(plain) == [3, 4]          # resumed at iteration 3 without FP8
    for i in (3, 4):
        assert 0 < abs(plain[i] - again[i]) <= CURVE_RTOL * again[i], (plain, again)
    back = _run(tmp_path, "back", fp8 + ["--load", str(tmp_path / "b")], iters=6, decay=6)
    assert sorted(back) == [5, 6] and all(torch.isfinite(torch.tensor(list(back.values()))))


def _refusal(argv):
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    message = str(err.value)
    assert "\n" not in message and message.endswith(".")
    return message


def test_refusals_name_what_runs(monkeypatch):
    message = _refusal(["--fp8-format", "hybrid", "--fp8-recipe", "fancy"])
    assert message.startswith("--fp8-recipe fancy is not a recipe") and "tensorwise" in message
    if not __import__("megatron_sp.training.fp8", fromlist=["x"]).transformer_engine_installed():
        for recipe in ("delayed", "blockwise", "mxfp8"):
            message = _refusal(["--fp8-format", "hybrid", "--fp8-recipe", recipe])
            assert f"--fp8-recipe {recipe} needs Transformer Engine" in message
            assert "tensorwise, rowwise, rowwise_with_gw_hp" in message
    monkeypatch.setitem(sys.modules, "transformer_engine", None)      # neither library imports
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    for name in ("torchao", "torchao.float8", "torchao.float8.float8_training_tensor"):
        monkeypatch.setitem(sys.modules, name, None)
    for extra in ([], ["--transformer-impl", "transformer_engine"]):
        message = _refusal(["--fp8-format", "e4m3"] + extra)
        assert message.startswith("--fp8-format needs NVIDIA Transformer Engine")
        assert "torchao" in message
