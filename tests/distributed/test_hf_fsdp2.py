"""megatron_sp.hf.trainer.SequenceParallelTrainer under FSDP2 through the Trainer reproduces the
unmodified Trainer on one process.

The candidate is the Trainer's own FSDP2 path: TrainingArguments(fsdp="full_shard",
fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}), so
accelerate's Accelerator.prepare -> accelerate.utils.fsdp_utils.fsdp2_prepare_model ->
torch.distributed.fsdp.fully_shard shards the (already sequence-parallel) model over the world on
gloo ranks. Reference: the unmodified transformers.Trainer, one process (this pytest process), no
FSDP, same tiny llama, data and arguments (per-device batch x dp).

Test-only patch (`_fsdp2_on_cpu`, applied in the spawned ranks only): accelerate (1.x,
accelerate/state.py, AcceleratorState.__init__) switches to DistributedType.FSDP and keeps the
fsdp_plugin only for MULTI_GPU / MULTI_NPU / MULTI_XPU / ..., never for MULTI_CPU, so on CPU the
Trainer silently runs DDP (Trainer.is_fsdp_enabled is False). The patch does, for MULTI_CPU, what
that branch does for the GPU types: distributed_type = FSDP, fsdp_plugin kept. Nothing else is
needed: fsdp2_prepare_model and fully_shard run unchanged on CPU (fully_shard's default mesh is the
world over gloo).

Checked on every rank, at every optimizer step (a callback): the model the Trainer trains is an
FSDPModule whose parameters are all DTensors sharded over the whole world (local shards add up to
1/world of the model, which DDP cannot pass), and accelerate's fsdp2_prepare_model ran exactly
once. Then every logged loss, grad_norm (sensitive to the gradients' scale, which AdamW's updates
and hence the losses are nearly blind to) and the eval loss equal the reference's to RTOL; every
rank logs the same curve.

Layouts: sp 2 on 2 ranks; sp 2 x cp 2 and dp 2 x cp 2 on 4 ranks (the second test).
3 optimizer steps, gradient accumulation 2, right padding, one eval at the end.
"""
from __future__ import annotations

import os

import pytest
from test_hf_trainer import RTOL, STEPS, lm_examples, pad_collate, tiny_model

FSDP2 = dict(fsdp="full_shard",
             fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})


def _fsdp2_on_cpu() -> dict:
    """TEST-ONLY: make accelerate take its FSDP path on CPU (see the module docstring): after
    AcceleratorState's own __init__, MULTI_CPU with an fsdp_plugin becomes DistributedType.FSDP
    with that plugin, as accelerate does for MULTI_GPU. Also counts accelerate's
    fsdp2_prepare_model calls (returned dict), to show that its own preparation ran."""
    import accelerate.accelerator
    import accelerate.state
    from accelerate.utils import DistributedType

    state_init = accelerate.state.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        state_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if self.distributed_type == DistributedType.MULTI_CPU and fsdp_plugin is not None:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            accelerate.state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    calls = {"fsdp2_prepare_model": 0}
    prepare = accelerate.accelerator.fsdp2_prepare_model

    def counted(*args, **kwargs):
        calls["fsdp2_prepare_model"] += 1
        return prepare(*args, **kwargs)

    accelerate.state.AcceleratorState.__init__ = init
    accelerate.accelerator.fsdp2_prepare_model = counted
    return calls


def _sharding(model) -> dict:
    """What the trained model is: FSDP2 module, every parameter a DTensor sharded (dim 0) over a
    mesh of the whole world, and the fraction of the model this rank holds."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    params = list(model.parameters())
    dtensors = [p for p in params if isinstance(p, DTensor)]
    return {"fsdp_module": isinstance(model, FSDPModule),
            "all_dtensor": len(dtensors) == len(params) > 0,
            "sharded_over_world": all(p.device_mesh.size() == dist.get_world_size()
                                      and tuple(p.placements) == (Shard(0),) for p in dtensors),
            "local_fraction": sum(p.to_local().numel() for p in dtensors)
                              / sum(p.numel() for p in params)}


def train(sp: int | None, cp: int, batch: int, out_dir: str, calls: dict | None = None) -> dict:
    """One run; sp None: the unmodified Trainer without FSDP (the reference, one process)."""
    import logging

    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from megatron_sp.hf.trainer import SequenceParallelTrainer
    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=batch,
                             per_device_eval_batch_size=batch, max_steps=STEPS,
                             learning_rate=2e-3, logging_steps=1, eval_strategy="steps",
                             eval_steps=STEPS, save_strategy="no", report_to="none", use_cpu=True,
                             seed=7, disable_tqdm=True, dataloader_num_workers=0,
                             gradient_accumulation_steps=2, remove_unused_columns=False,
                             **(FSDP2 if sp is not None else {}))
    seen = []

    class Sharding(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen.append(_sharding(model))

    cls, extra = (Trainer, {}) if sp is None else (SequenceParallelTrainer,
                                                   {"sp_size": sp, "cp_size": cp})
    trainer = cls(model=tiny_model("llama"), args=args, train_dataset=lm_examples(48, 1),
                  eval_dataset=lm_examples(8, 2), data_collator=pad_collate,
                  callbacks=[Sharding()] if sp is not None else None, **extra)
    trainer.train()
    history = trainer.state.log_history
    out = {key: [h[key] for h in history if key in h] for key in ("loss", "grad_norm", "eval_loss")}
    out.update(max_steps=trainer.state.max_steps,
               total_batch=trainer.get_total_train_batch_size(trainer.args))
    if sp is not None:
        out.update(is_fsdp_enabled=trainer.is_fsdp_enabled,
                   distributed_type=str(trainer.accelerator.distributed_type),
                   sharding=seen, **(calls or {}))
    return out


def _spawned(rank, world, jobs, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    calls = _fsdp2_on_cpu()
    results = []
    for sp, cp, batch in jobs:
        calls["fsdp2_prepare_model"] = 0
        results.append(train(sp, cp, batch, os.path.join(out_dir, f"r{rank}"), calls))
    return results


def _check(job, world, ref, per_rank):
    sp, cp, batch = job
    got = per_rank[0]
    curve = ("loss", "grad_norm", "eval_loss", "max_steps", "total_batch")
    for r in per_rank:                                      # every rank: the same curve
        assert {k: r[k] for k in curve} == {k: got[k] for k in curve}, (job, per_rank)
    for r in per_rank:                                      # FSDP2 by accelerate, not DDP
        assert r["is_fsdp_enabled"] and r["distributed_type"] == "DistributedType.FSDP", (job, r)
        assert r["fsdp2_prepare_model"] == 1, (job, r)
        assert len(r["sharding"]) == STEPS, (job, r)
        for s in r["sharding"]:
            assert s["fsdp_module"] and s["all_dtensor"] and s["sharded_over_world"], (job, s)
            assert s["local_fraction"] <= 1 / world + 0.05, (job, s)   # dim-0 padding aside
    assert len(got["loss"]) == len(got["grad_norm"]) == len(ref["loss"]) == STEPS, (job, ref, got)
    assert len(got["eval_loss"]) == len(ref["eval_loss"]) == 1, (job, ref, got)
    for key in ("loss", "grad_norm", "eval_loss"):
        for a, b in zip(ref[key], got[key]):
            assert abs(a - b) <= RTOL * abs(a), (job, key, ref, got)
    assert (got["max_steps"], got["total_batch"]) == (ref["max_steps"], ref["total_batch"]), \
        (job, ref, got)


def _run_and_compare(tmp_path, world, jobs):
    from megatron_sp.testing import run_distributed

    per_rank = run_distributed(_spawned, world, jobs, str(tmp_path / "fsdp2"), timeout_s=240.0,
                               collective_timeout_s=120.0)
    references = {}
    for i, job in enumerate(jobs):
        sp, cp, batch = job
        dp = world // (sp * cp)
        if batch * dp not in references:
            references[batch * dp] = train(None, 1, batch * dp, str(tmp_path / "ref"))
        _check(job, world, references[batch * dp], [per_rank[r][i] for r in range(world)])


@pytest.mark.timeout(300)
def test_fsdp2_sp2_matches_one_process(tmp_path):
    """sp 2 on 2 ranks (dp 1), batch 4: the reference's batch."""
    _run_and_compare(tmp_path, 2, [(2, 1, 4)])


@pytest.mark.timeout(400)
def test_fsdp2_sp2_cp2_and_dp2_cp2_match_one_process(tmp_path):
    """On 4 ranks: sp 2 x cp 2 (dp 1, batch 4) and dp 2 x cp 2 (batch 2 per replica: 4 in all)."""
    _run_and_compare(tmp_path, 4, [(2, 2, 4), (1, 2, 2)])
