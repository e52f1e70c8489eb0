"""Megatron-LM's math flags on one rank (docs/design.md §10): the model variants against their definitions
(and Megatron-core's own RoPE where it is installed), the loss scaler's rules, --optimizer sgd
against torch.optim.SGD, the loss scaler and SGD state through a checkpoint, and the Transformer
Engine / FP8 glue against a stand-in module with Transformer Engine's documented signatures."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
import types

import numpy as np
import pytest
import torch

from megatron_sp.cli.arguments import parse_args
from megatron_sp.cli.build import parse_job
from megatron_sp.config import JobConfig
from megatron_sp.errors import ConfigError
from megatron_sp.training.loss_scaler import LossScaler
from megatron_sp.mesh import ParallelMesh
from megatron_sp.models import GPTConfig, GPTModel
from megatron_sp.models.gpt import RotaryEmbedding, apply_rotary
from megatron_sp.models.init import init_parameters
from megatron_sp.training.optimizer import LRScheduler, build_optimizer
from megatron_sp.training import Trainer

pytestmark = pytest.mark.timeout(120)


def tiny(**overrides) -> GPTConfig:
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  vocab_size=97, ffn_hidden_size=96, normalization="RMSNorm", activation="swiglu",
                  position_embedding_type="rope", add_bias_linear=False, max_position_embeddings=32)
    return GPTConfig(**{**fields, **overrides})


def batch(seed: int, b: int = 2, s: int = 16, vocab: int = 97) -> dict:
    rng = np.random.default_rng(seed)
    text = torch.from_numpy(rng.integers(0, vocab, (b, s + 1)))
    mask = torch.from_numpy((rng.random((b, s)) > 0.25).astype(np.float32))
    return {"tokens": text[:, :-1], "labels": text[:, 1:], "loss_mask": mask,
            "position_ids": torch.arange(s).expand(b, s)}


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_layernorm_1p_is_the_norm_with_gamma_one_plus_w(normalization):
    """--apply-layernorm-1p stores w = gamma - 1 (initialised 0) and applies 1 + w: a model whose
    plain norms hold gamma = 1 + w computes the same logits (also in the q/k head norms)."""
    torch.manual_seed(3)
    one_p = GPTModel(tiny(normalization=normalization, apply_layernorm_1p=True, qk_layernorm=True))
    init_parameters(one_p, seed=5)
    norms = {n: p for n, p in one_p.named_parameters() if "norm" in n and n.endswith("weight")}
    assert norms and all(p.abs().max() == 0 for p in norms.values())   # gamma = 1 at init
    with torch.no_grad():
        for p in norms.values():
            p.normal_(0.0, 0.3)
    plain = GPTModel(tiny(normalization=normalization, qk_layernorm=True))
    state = {n: (p + 1 if n in norms else p) for n, p in one_p.state_dict().items()}
    plain.load_state_dict(state)
    tokens = batch(1)["tokens"]
    torch.testing.assert_close(one_p(tokens), plain(tokens), rtol=1e-5, atol=1e-5)


def test_rotary_percent_rotates_only_the_first_dims():
    """--rotary-percent 0.5: frequencies over int(d/2) dims (Megatron's rule), the other half of
    each head passes through unchanged; equal to Megatron-core's apply_rotary_pos_emb."""
    cfg = tiny(kv_channels=16, rotary_percent=0.5)
    rope = RotaryEmbedding(cfg.kv_channels, cfg.rotary_base, cfg)
    assert rope.inv_freq.shape == (4,)
    expected = 1.0 / (cfg.rotary_base ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    torch.testing.assert_close(rope.inv_freq, expected.float())
    x = torch.randn(2, 16, 4, 16, generator=torch.Generator().manual_seed(0))   # [b, s, h, d]
    out = apply_rotary(x, *rope(torch.arange(16).expand(2, 16)))
    torch.testing.assert_close(out[..., 8:], x[..., 8:], rtol=0, atol=0)
    assert (out[..., :8] - x[..., :8]).abs().max() > 1e-2
    from megatron.core.models.common.embeddings import rope_utils
    freqs = torch.arange(16, dtype=torch.float32)[:, None] * rope.inv_freq          # [s, r/2]
    freqs = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]                   # [s, 1, 1, r]
    theirs = rope_utils._apply_rotary_pos_emb_bshd(x.transpose(0, 1), freqs)       # [s, b, h, d]
    torch.testing.assert_close(out, theirs.transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_rotary_percent_and_1p_flags_reach_the_config_and_back():
    """config_to_flags -> the parser -> pretrain_gpt.model_config rebuilds both fields, and both
    flags sit in the model group that --use-checkpoint-args copies from a checkpoint."""
    from megatron_sp.cli.arguments import build_parser
    from megatron_sp.cli.model_flags import config_to_flags
    from megatron_sp.testing import load_script
    pretrain_gpt = load_script("pretrain_gpt.py")
    cfg = tiny(rotary_percent=0.25, apply_layernorm_1p=True)
    flags = config_to_flags(cfg)
    assert "--apply-layernorm-1p" in flags and flags[flags.index("--rotary-percent") + 1] == "0.25"
    job = parse_job(flags + ["--seq-length", "32"])
    assert pretrain_gpt.model_config(job, cfg.vocab_size).to_dict() == cfg.to_dict()
    model_group = next(g for g in build_parser()._action_groups if g.title == "model")
    dests = {a.dest for a in model_group._group_actions}
    assert {"apply_layernorm_1p", "rotary_percent"} <= dests
    with pytest.raises(ValueError, match="rotary_percent"):
        tiny(rotary_percent=0.05)                 # int(16 * 0.05) = 0 rotary dimensions


def test_dynamic_loss_scaler_follows_megatron_rules():
    """Megatron's DynamicGradScaler: the scale halves once `hysteresis` overflows are seen (then at
    every further overflow until a clean window resets the hysteresis), never below min_scale, and
    doubles after `window` clean steps."""
    s = LossScaler(1024.0, min_scale=256.0, window=3, hysteresis=2)
    scales = []
    for found_inf in [True, True, True, False, False, False, True, True, True, True]:
        s.update(found_inf)
        scales.append(s.scale)
    assert scales == [1024, 512, 256, 256, 256, 512, 512, 256, 256, 256]
    static = LossScaler(128.0, dynamic=False)
    static.update(True)
    assert static.scale == 128.0


def _train(model, optimizer, scheduler, batches, steps, **flags):
    """`steps` steps of a fresh Trainer whose JobConfig has `flags` (precision flags, ...)."""
    job = JobConfig.from_flags(dict(global_batch_size=2, micro_batch_size=1, seq_length=16,
                                    clip_grad=1.0, **flags))
    trainer = Trainer(job, ParallelMesh.single(), [model], optimizer, scheduler)
    return trainer, [trainer.train_step([{k: v[i:i + 1] for k, v in b.items()} for i in range(2)])
                     for b in batches[:steps]]


def test_sgd_matches_torch_sgd_and_its_momentum_survives_a_checkpoint(tmp_path):
    """--optimizer sgd is torch.optim.SGD with --sgd-momentum and Megatron's weight-decay groups:
    three steps equal a hand-written loop (loss 1e-6 relative, parameters 1e-6); the momentum
    buffers and the fp16 loss scaler state come back from a checkpoint."""
    from megatron_sp.checkpointing import load_checkpoint, save_checkpoint
    cfg = tiny()
    batches = [batch(10 + i) for i in range(3)]
    model = GPTModel(cfg)
    init_parameters(model, seed=7)
    reference = copy.deepcopy(model)
    optimizer = build_optimizer([model], lr=0.05, weight_decay=0.1, optimizer="sgd",
                                sgd_momentum=0.9)
    scheduler = LRScheduler(optimizer, 0.05, 0.05, warmup_iters=0, decay_iters=3, style="constant")
    trainer, results = _train(model, optimizer, scheduler, batches, 3)
    groups = [{"params": [p for n, p in reference.named_parameters() if p.ndim > 1],
               "weight_decay": 0.1},
              {"params": [p for n, p in reference.named_parameters() if p.ndim == 1],
               "weight_decay": 0.0}]
    torch_sgd = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    for b, result in zip(batches, results):
        torch_sgd.zero_grad()
        per_token = reference(b["tokens"], labels=b["labels"])
        loss = (per_token * b["loss_mask"]).sum() / b["loss_mask"].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        torch_sgd.step()
        assert abs(result.loss - loss.item()) <= 1e-6 * abs(loss.item())
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=name)
    # The scaler state and momentum buffers through a checkpoint (one rank, no process group).
    trainer, _ = _train(model, optimizer, scheduler, batches[:1], 1, fp16=True,
                        initial_loss_scale=2.0**10, loss_scale_window=2)
    save_checkpoint(str(tmp_path), trainer.state.iteration, [model], ParallelMesh.single(),
                    optimizer=optimizer, scheduler=scheduler, train_state=trainer.state, config=cfg)
    fresh = GPTModel(cfg)
    fresh_opt = build_optimizer([fresh], lr=0.05, weight_decay=0.1, optimizer="sgd")
    fresh_sched = LRScheduler(fresh_opt, 0.05, 0.05, warmup_iters=0, decay_iters=3,
                              style="constant")
    restored = Trainer(JobConfig.from_flags(dict(global_batch_size=2, micro_batch_size=1,
                                                 seq_length=16, fp16=True,
                                                 initial_loss_scale=2.0**32)),
                       ParallelMesh.single(), [fresh], fresh_opt, fresh_sched)
    load_checkpoint(str(tmp_path), [fresh], ParallelMesh.single(), optimizer=fresh_opt,
                    scheduler=fresh_sched, train_state=restored.state, config=cfg)
    assert restored._loss_scale() == trainer.loss_scaler.scale == 2.0**10
    assert restored.loss_scaler.state_dict() == trainer.loss_scaler.state_dict()
    for p, q in zip(fresh.parameters(), model.parameters()):
        torch.testing.assert_close(fresh_opt.state[p]["momentum_buffer"],
                                   optimizer.state[q]["momentum_buffer"], rtol=0, atol=0)


# Transformer Engine stand-in ----------------------------------------------------------------------

@pytest.fixture
def fake_te(monkeypatch):
    """A module with Transformer Engine's documented names and signatures, recording its calls."""
    calls = {"autocast": [], "model_init": []}
    te = types.ModuleType("transformer_engine")
    te.__version__ = "2.4.0"
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")

    class Format:
        E4M3, HYBRID = "E4M3", "HYBRID"

    class DelayedScaling:
        def __init__(self, margin=0, fp8_format=Format.HYBRID, amax_history_len=1024,
                     amax_compute_algo="max", **kwargs):
            self.kwargs = dict(margin=margin, fp8_format=fp8_format,
                               amax_history_len=amax_history_len,
                               amax_compute_algo=amax_compute_algo, **kwargs)

    recipe.Format, recipe.DelayedScaling = Format, DelayedScaling
    pytorch = types.ModuleType("transformer_engine.pytorch")

    @contextlib.contextmanager
    def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None,
                     _graph=False):
        calls["autocast"].append(dict(enabled=enabled, recipe=fp8_recipe, group=fp8_group))
        yield

    @contextlib.contextmanager
    def fp8_model_init(enabled=True, recipe=None, preserve_high_precision_init_val=False):
        calls["model_init"].append(enabled)
        yield

    pytorch.fp8_autocast, pytorch.fp8_model_init = fp8_autocast, fp8_model_init
    te.common, te.pytorch, common.recipe = common, pytorch, recipe
    for name, module in [("transformer_engine", te), ("transformer_engine.common", common),
                         ("transformer_engine.common.recipe", recipe),
                         ("transformer_engine.pytorch", pytorch)]:
        monkeypatch.setitem(sys.modules, name, module)
    return te, calls


FP8_FLAGS = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo",
             "max", "--fp8-margin", "1", "--fp8-interval", "3", "--fp8-param-gather"]


def test_fp8_flags_build_the_delayed_scaling_recipe_and_wrap_every_forward(fake_te):
    from megatron_sp.training import fp8
    te, calls = fake_te
    job = parse_job(FP8_FLAGS + ["--transformer-impl", "transformer_engine"])
    recipe = fp8.delayed_scaling_recipe(job.precision)
    assert recipe.kwargs == dict(margin=1, fp8_format="HYBRID", amax_history_len=1024,
                                 amax_compute_algo="max")          # TE >= 1.8: no interval
    te.__version__ = "1.7.0"
    assert fp8.delayed_scaling_recipe(job.precision).kwargs["interval"] == 3
    assert fp8.attention_backend(job.model) == "te"
    explicit = dataclasses.replace(job.model, attention_backend="sdpa")   # an explicit backend
    assert fp8.attention_backend(explicit) == "sdpa"                      # is kept
    with fp8.model_init_context(job.precision):
        pass
    assert calls["model_init"] == [True]
    model = GPTModel(tiny())
    init_parameters(model, seed=1)
    optimizer = build_optimizer([model], lr=1e-3)
    scheduler = LRScheduler(optimizer, 1e-3, 1e-4, warmup_iters=0, decay_iters=2)
    fp8_flags = {f: getattr(job.precision, f) for f in ("fp8_format", "fp8_margin", "fp8_interval",
                                                         "fp8_amax_history_len",
                                                         "fp8_amax_compute_algo")}
    _train(model, optimizer, scheduler, [batch(3)], 1, **fp8_flags)
    assert len(calls["autocast"]) == 2                    # one per micro-batch forward
    assert all(c["enabled"] and c["group"] is None and c["recipe"].kwargs["margin"] == 1
               for c in calls["autocast"])


def test_without_transformer_engine_fp8_is_refused_and_transformer_impl_mapped(monkeypatch):
    """FP8 without TE and without torchao: one sentence naming both (also with --transformer-impl
    transformer_engine); with torchao it runs there (tests/unit/test_fp8.py).
    --transformer-impl transformer_engine alone (Megatron's default) runs as local, said once."""
    for name in ("transformer_engine", "transformer_engine.pytorch", "torchao", "torchao.float8",
                 "torchao.float8.float8_training_tensor"):
        monkeypatch.setitem(sys.modules, name, None)      # import fails
    for flags in (FP8_FLAGS, FP8_FLAGS + ["--transformer-impl", "transformer_engine"]):
        with pytest.raises(ConfigError) as err:     # run_main prints it as "error: <message>"
            parse_args(flags)
        message = str(err.value)
        assert message.startswith("--fp8-format") and "Transformer Engine" in message
        assert "torchao" in message
        assert message.count(". ") == 0 and "\n" not in message
    args = parse_args(["--transformer-impl", "transformer_engine"])
    assert args.transformer_impl == "local" and args.attention_backend == "auto"
    notes = [n for n in args.megatron_notes if "--transformer-impl" in n]
    assert notes == ["> --transformer-impl transformer_engine runs with the local implementation: "
                     "Transformer Engine is not installed"], args.megatron_notes
    assert parse_args(["--transformer-impl", "local"]).megatron_notes == []
    assert parse_args(["--transformer-impl", "local"]).transformer_impl == "local"


def test_megatron_math_flags_parse_with_megatron_defaults():
    args = parse_args(["--fp16", "--calculate-per-token-loss", "--no-position-embedding"])
    assert (args.initial_loss_scale, args.min_loss_scale, args.loss_scale_window,
            args.hysteresis, args.loss_scale) == (2.0**32, 1.0, 1000, 2, None)
    assert args.add_position_embedding is False and args.optimizer == "adam"
    assert args.sgd_momentum == 0.9 and args.rotary_percent == 1.0
    for flags, words in [(["--fp16", "--bf16"], "contradict"),
                         (["--decoupled-min-lr", "1e-5"], "--decoupled-lr"),
                         (["--rotary-percent", "1.5"], "--rotary-percent")]:
        with pytest.raises(ConfigError, match=words):
            parse_job(flags)


def test_layernorm_1p_model_exports_to_hugging_face_as_gamma():
    """A 1p model exports with gamma = 1 + w: transformers' Llama gives the same logits (1e-4);
    --rotary-percent < 1 has no Hugging Face equivalent and is refused in one sentence."""
    import transformers
    from megatron_sp.models import families
    cfg = tiny(apply_layernorm_1p=True, tie_embeddings=False)
    model = GPTModel(cfg).eval()
    init_parameters(model, seed=4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    hf_config, state = families.megatron_sp_to_hf(cfg, families.full_tensors(model), family="llama")
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**hf_config)).eval()
    hf.load_state_dict(state)
    tokens = batch(2)["tokens"]
    with torch.no_grad():
        diff = (hf(tokens).logits.float() - model(tokens)).abs().max().item()
    assert diff <= 1e-4, f"1p export: logits differ by {diff}"
    with pytest.raises(families.ConversionError, match="--rotary-percent 0.5"):
        families.megatron_sp_to_hf(tiny(rotary_percent=0.5), {}, family="llama")


def test_adamw_updates_a_strided_parameter_in_place_of_its_elements():
    """torch's fused AdamW treats its tensors as contiguous (a strided view gets its updates on the
    wrong elements): build_optimizer keeps such parameters on foreach. Reference: AdamW on a
    contiguous copy, 1e-7 absolute after 3 steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 6, bias=False)
    model.weight = torch.nn.Parameter(torch.randn(4, 6).t())          # [6, 4], strided
    assert not model.weight.is_contiguous()
    ref = torch.nn.Parameter(model.weight.detach().contiguous().clone())
    opt = build_optimizer([model], lr=1e-2, weight_decay=0.0)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.0, foreach=False)
    for _ in range(3):
        grad = torch.randn(6, 4)
        model.weight.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    assert (model.weight.detach() - ref.detach()).abs().max() <= 1e-7
