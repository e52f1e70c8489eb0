"""Megatron-LM's math flags in parallel layouts against one rank (docs/design.md §10), one 4-rank spawn
(dp fills the ranks a layout leaves):

- --apply-layernorm-1p (RMSNorm with qk-norm, tp2 x sp2 sequence-parallel; LayerNorm, tp2 x sp2),
  --rotary-percent 0.5 (sp2, tp2), --decoupled-lr (dp4; pp2 x dp2 with tied embeddings, both copies
  of the embedding on the decoupled schedule): losses 1e-5 relative, full gradients and updated
  parameters 1e-4 over three optimizer steps;
- --fp16 with dynamic loss scaling (dp4) against fp32 on one rank: losses within 1e-3 relative
  (fp16's epsilon), gradients within 5e-4 (and not bit-equal: fp16 really ran), the scale doubling
  after its window;
- an inf injected into one gradient on one rank (pp2 x dp2, two steps in a row): both steps
  skipped on every rank, the scale halved at the second (hysteresis 2), no parameter moved, the
  scheduler not advanced, then a normal step;
- --calculate-per-token-loss: the dp4 loss and gradients equal Megatron's per-token loss
  (sum of masked per-token losses over the global token count) computed in one piece, which here
  differs from Megatron's default per-micro-batch mean;
- --grad-reduce-in-bf16 (dp4): half the bytes on the wire, loss equal, gradients within bf16's
  rounding (1e-2 of each tensor's largest entry); with the distributed optimizer: half the
  reduce-scatter bytes, parameters after two steps within 1e-2 of the fp32 reduction's.
"""
from __future__ import annotations

import pytest
import torch

from megatron_sp.testing import run_distributed

from layout_utils import build_chunks, compare, global_batches, micro_batches

pytestmark = pytest.mark.timeout(300)

QWEN3_1P = dict(model="qwen3-0.6b", overrides=dict(num_layers=2, hidden_size=64,
                                                   num_attention_heads=4, num_query_groups=2,
                                                   kv_channels=32, ffn_hidden_size=128,
                                                   vocab_size=300, max_position_embeddings=64,
                                                   apply_layernorm_1p=True))
LLAMA = dict(model="llama-tiny", overrides=dict(num_layers=2, hidden_size=64,
                                                num_attention_heads=4, num_query_groups=2,
                                                ffn_hidden_size=128, vocab_size=300,
                                                max_position_embeddings=64))
GPT_1P = dict(model="gpt2-tiny", overrides=dict(num_layers=2, hidden_size=64, vocab_size=300,
                                                max_position_embeddings=64,
                                                apply_layernorm_1p=True))
ROPE_HALF = dict(LLAMA, overrides=dict(LLAMA["overrides"], rotary_percent=0.5))
TIED = dict(LLAMA, overrides=dict(LLAMA["overrides"], tie_embeddings=True))
DECOUPLED = dict(decoupled_lr=5e-3, decoupled_min_lr=3e-4)
SEQ, GLOBAL_BATCH, STEPS = 32, 4, 3
CASES = [
    dict(QWEN3_1P, name="1p RMSNorm + qk-norm tp2 x sp2 sequence-parallel", tp=2, sp=2,
         micro_batch=2, sequence_parallel=True),
    dict(GPT_1P, name="1p LayerNorm tp2 x sp2", tp=2, sp=2, micro_batch=4),
    dict(ROPE_HALF, name="rotary-percent 0.5 sp2 (x dp2)", sp=2, micro_batch=1),
    dict(ROPE_HALF, name="rotary-percent 0.5 tp2 (x dp2)", tp=2, micro_batch=2),
    dict(LLAMA, name="decoupled-lr dp4", micro_batch=1, optimizer=DECOUPLED),
    dict(TIED, name="decoupled-lr pp2 x dp2 tied embeddings", pp=2, micro_batch=1,
         optimizer=DECOUPLED),
]


def _trainer(mesh, cfg, micro_batch, *, sequence_parallel=False, optimizer=None, precision=None):
    """precision: flat precision flags (fp16, initial_loss_scale, grad_reduce_in_bf16, ...)."""
    from megatron_sp.config import JobConfig
    from megatron_sp.training.optimizer import LRScheduler, build_optimizer
    from megatron_sp.training import Trainer
    chunks, schedule = build_chunks(mesh, cfg, sequence_parallel=sequence_parallel)
    opt = build_optimizer(chunks, lr=1e-3, weight_decay=0.1, **(optimizer or {}))
    scheduler = LRScheduler(opt, 1e-3, 1e-4, warmup_iters=1, decay_iters=STEPS, style="cosine")
    job = JobConfig.from_flags({"global_batch_size": GLOBAL_BATCH, "micro_batch_size": micro_batch,
                                "seq_length": SEQ, "clip_grad": 1.0, "grad_bucket_size_mb": 0.05,
                                **(precision or {})})
    return Trainer(job, mesh, chunks, opt, scheduler, schedule=schedule)


def _full(trainer, what):
    """{name: full tensor} of the parameters (what="param") or gradients this rank holds."""
    from megatron_sp.tensor_parallel import gather_full_like
    return {name: gather_full_like(p.detach() if what == "param" else p.grad, p,
                                   trainer.mesh.tp_group)
            for chunk in trainer.chunks for name, p in chunk.named_parameters()
            if what == "param" or p.grad is not None}        # a skipped step drops its gradients


def _run(trainer, batches, before_step=None):
    history, results = [], []
    for i, batch in enumerate(batches):
        hooks = before_step(i, trainer) if before_step else []
        micro_batch = GLOBAL_BATCH // (trainer.num_micro_batches * trainer.mesh.dp_size)
        mbs = micro_batches(batch, micro_batch, trainer.mesh.dp_rank, trainer.mesh.dp_size)
        result = trainer.train_step(mbs)
        for hook in hooks:
            hook.remove()
        history.append((result.loss, result.grad_norm, _full(trainer, "grad")))
        results.append(result)
    return history, results


def _params_close(reference, candidate, what, atol=1e-4):
    ref, cand = _full(reference, "param"), _full(candidate, "param")
    for name, value in cand.items():
        rows = min(value.shape[0], ref[name].shape[0])     # padded vocabulary differs with tp
        diff = (value[:rows] - ref[name][:rows]).abs().max().item()
        assert diff <= atol, f"{what}: updated {name} differs by {diff:.2e}"


def _layouts(cases):
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import preset
    out = []
    for case in cases:
        cfg = preset(case["model"], **case["overrides"])
        batches = global_batches(cfg.vocab_size, SEQ, GLOBAL_BATCH, STEPS, seed=21)
        reference = _trainer(ParallelMesh.single(), cfg, GLOBAL_BATCH,
                             optimizer=case.get("optimizer"))
        ref_history, _ = _run(reference, batches)
        mesh = ParallelMesh.from_sizes(tp=case.get("tp", 1), sp=case.get("sp", 1),
                                       pp=case.get("pp", 1))
        candidate = _trainer(mesh, cfg, case["micro_batch"], optimizer=case.get("optimizer"),
                             sequence_parallel=case.get("sequence_parallel", False))
        history, _ = _run(candidate, batches)
        out.append((case["name"],) + compare(ref_history, history, case["name"]))
        _params_close(reference, candidate, case["name"])
        if case.get("optimizer"):   # the decoupled group follows its own schedule
            lrs = {bool(g.get("is_decoupled_lr")): g["lr"] for g in candidate.optimizer.param_groups
                   if g["params"]}
            sched = candidate.scheduler
            assert lrs[True] == pytest.approx(sched.lr_at(sched.num_steps, 5e-3, 3e-4))
            assert lrs[False] == pytest.approx(sched.lr_at(sched.num_steps)) != lrs[True]
    return out


def _fp16_against_fp32():
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import preset
    cfg = preset(LLAMA["model"], **LLAMA["overrides"])
    batches = global_batches(cfg.vocab_size, SEQ, GLOBAL_BATCH, STEPS, seed=22)
    ref_history, _ = _run(_trainer(ParallelMesh.single(), cfg, GLOBAL_BATCH), batches)
    scaler = dict(initial_loss_scale=2.0**12, loss_scale_window=2, hysteresis=2)
    candidate = _trainer(ParallelMesh.from_sizes(), cfg, 1,
                         precision=dict(fp16=True, **scaler))
    history, results = _run(candidate, batches)
    worst = compare(ref_history, history, "fp16 dp4", loss_rtol=1e-3, grad_atol=5e-4)
    assert worst[1] > 1e-6, "fp16 autocast did not round anything (fp32 layouts differ by ~1e-8)"
    assert [r.loss_scale for r in results] == [2.0**12, 2.0**13, 2.0**13]
    assert not any(r.skipped for r in results)
    return ("fp16 dynamic loss scaling dp4 vs fp32",) + worst


def _overflow_backoff():
    """An inf in one gradient on rank 0 only (pp2 x dp2: stage 1 never sees it) at steps 1, 2."""
    import torch.distributed as dist
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import preset
    cfg = preset(LLAMA["model"], **LLAMA["overrides"])
    batches = global_batches(cfg.vocab_size, SEQ, GLOBAL_BATCH, STEPS, seed=23)
    trainer = _trainer(ParallelMesh.from_sizes(pp=2), cfg, 1,
                       precision=dict(fp16=True, initial_loss_scale=2.0**12, hysteresis=2))
    before, after_skips = _full(trainer, "param"), {}

    def inject(step, t):
        if step == 2:
            after_skips.update(_full(t, "param"))
        if step >= 2 or dist.get_rank() != 0:
            return []
        p = next(t.chunks[0].parameters())
        return [p.register_hook(lambda g: g * float("inf"))]

    _, results = _run(trainer, batches, before_step=inject)
    assert [r.skipped for r in results] == [True, True, False]
    assert [r.loss_scale for r in results] == [2.0**12, 2.0**11, 2.0**11]
    assert all(r.loss == r.loss for r in results)                      # the loss stayed finite
    assert trainer.state.skipped_iterations == 2 and trainer.scheduler.num_steps == 1
    record = trainer.log_record(results[-1], elapsed=1.0, iters=3)
    assert record["loss_scale"] == 2.0**11 and record["skipped_iterations_total"] == 2
    moved = [n for n in before if not torch.equal(before[n], after_skips[n])]
    assert not moved, f"a skipped step moved {moved}"
    steps = {int(st["step"]) for st in trainer.optimizer.state.values()}
    assert steps == {1}, f"the optimizer stepped {steps} times, expected once"
    return ("overflow backoff pp2 x dp2", 0.0, 0.0)


def _per_token_loss():
    """Megatron's --calculate-per-token-loss formula in one piece equals the dp4 Trainer."""
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import preset
    cfg = preset(LLAMA["model"], **LLAMA["overrides"])
    (batch,) = global_batches(cfg.vocab_size, SEQ, GLOBAL_BATCH, 1, seed=24)
    batch["loss_mask"][0] = 0.0
    batch["loss_mask"][0, :2] = 1.0        # very uneven token counts per micro-batch
    batch["loss_mask"][1] = 1.0
    reference = _trainer(ParallelMesh.single(), cfg, GLOBAL_BATCH)
    (model,) = reference.chunks
    per_token = model(batch["tokens"], labels=batch["labels"])             # [b, s]
    mask = batch["loss_mask"]
    per_token_loss = (per_token * mask).sum() / mask.sum()
    per_token_loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())).item()
    if norm > 1.0:                                  # the Trainer clips to --clip-grad 1.0
        grads = {n: g * (1.0 / (norm + 1e-6)) for n, g in grads.items()}
    # Megatron's default: each micro-batch's own mean, averaged over micro-batches and dp.
    default = torch.stack([(per_token[i] * mask[i]).sum() / mask[i].sum()
                           for i in range(GLOBAL_BATCH)]).mean()
    assert abs(default.item() - per_token_loss.item()) > 1e-4 * per_token_loss.item()   # >> 1e-5
    history, _ = _run(_trainer(ParallelMesh.from_sizes(), cfg, 1), [batch])
    compare([(per_token_loss.item(), history[0][1], grads)], history, "per-token loss dp4")
    return ("calculate-per-token-loss dp4", abs(history[0][0] / per_token_loss.item() - 1), 0.0)


def _grad_reduce_in_bf16():
    from megatron_sp import comm_stats
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import preset
    cfg = preset(LLAMA["model"], **LLAMA["overrides"])
    (batch,) = global_batches(cfg.vocab_size, SEQ, GLOBAL_BATCH, 1, seed=25)
    ref_history, _ = _run(_trainer(ParallelMesh.single(), cfg, GLOBAL_BATCH), [batch])
    sent = {}
    for bf16 in (False, True):
        comm_stats.reset()
        history, _ = _run(_trainer(ParallelMesh.from_sizes(), cfg, 1,
                                   precision=dict(grad_reduce_in_bf16=bf16)), [batch])
        sent[bf16] = comm_stats.snapshot()["dp_sp/all_reduce"]
    assert sent[True] < 0.51 * sent[False]
    (l0, _, g0), (l1, _, g1) = ref_history[0], history[0]
    assert abs(l1 - l0) <= 1e-5 * abs(l0)
    worst = 0.0
    for name, g in g1.items():
        diff = (g - g0[name]).abs().max().item() / max(g0[name].abs().max().item(), 1e-12)
        assert diff <= 1e-2, f"bf16 reduction: {name} differs by {diff:.2e} of its largest entry"
        worst = max(worst, diff)
    assert worst > 0.0        # the reduction really was rounded to bf16
    return ("grad-reduce-in-bf16 dp4", 0.0, worst)


def _distributed_optimizer_trainer(mesh, cfg, bf16_reduce: bool):
    from megatron_sp.config import JobConfig
    from megatron_sp.training.optimizer import LRScheduler
    from megatron_sp.sharding.distributed_optimizer import DistributedOptimizer
    from megatron_sp.training import Trainer
    chunks, schedule = build_chunks(mesh, cfg)
    opt = DistributedOptimizer(chunks, mesh, lr=1e-3, weight_decay=0.1, bucket_mb=0.05)
    scheduler = LRScheduler(opt, 1e-3, 1e-4, warmup_iters=1, decay_iters=STEPS, style="cosine")
    job = JobConfig.from_flags({"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 1,
                                "seq_length": SEQ, "clip_grad": 1.0,
                                "grad_reduce_in_bf16": bf16_reduce})
    return Trainer(job, mesh, chunks, opt, scheduler, schedule=schedule, sharding=opt)


def _grad_reduce_in_bf16_distributed_optimizer():
    """The distributed optimizer's reduce-scatter in bf16: half the bytes, the same loss at step 1,
    parameters after two steps within bf16's rounding of the fp32 reduction's (and not equal)."""
    from megatron_sp import comm_stats
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import preset
    cfg = preset(LLAMA["model"], **LLAMA["overrides"])
    batches = global_batches(cfg.vocab_size, SEQ, GLOBAL_BATCH, 2, seed=26)
    runs, sent = {}, {}
    for bf16 in (False, True):
        comm_stats.reset()
        trainer = _distributed_optimizer_trainer(ParallelMesh.from_sizes(), cfg, bf16)
        for batch in batches:
            trainer.train_step(micro_batches(batch, 1, trainer.mesh.dp_rank, trainer.mesh.dp_size))
        sent[bf16] = comm_stats.snapshot()["dp_sp/reduce_scatter"]
        runs[bf16] = _full(trainer, "param")
    assert sent[True] < 0.51 * sent[False]
    worst = max((runs[True][n] - p).abs().max().item() for n, p in runs[False].items())
    assert 0.0 < worst <= 1e-2, f"bf16 reduce-scatter moved parameters by {worst:.2e}"
    return ("grad-reduce-in-bf16 distributed optimizer dp4", 0.0, worst)


def _rank_main(rank, world):
    torch.manual_seed(100 + rank)
    return (_layouts(CASES) + [_fp16_against_fp32(), _overflow_backoff(), _per_token_loss(),
                               _grad_reduce_in_bf16(), _grad_reduce_in_bf16_distributed_optimizer()])


def test_megatron_math_flags_in_parallel_layouts():
    results = run_distributed(_rank_main, 4, timeout_s=280)
    for name, loss_diff, grad_diff in results[0]:
        print(f"{name}: worst loss rel diff {loss_diff:.2e}, worst grad diff {grad_diff:.2e}")
