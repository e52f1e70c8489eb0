"""`pretrain_gpt.py --load <a Megatron-LM save folder>`: the run goes on where Megatron-LM stopped.

Carried over: the weights (into any tp / sp / cp / pp / dp layout: each rank copies its rectangle
of the full tensors, as our own checkpoints load), the iteration, the consumed train and
validation samples (our sample order is Megatron-LM's, so the next batch is the one Megatron-LM
would have read), and the learning-rate schedule's position: Megatron-LM counts its scheduler in
samples (num_steps, lr_warmup_steps, lr_decay_steps), ours in iterations, so they are divided by
the stored global batch size. Not carried over, each said in one line: the optimizer's moments
(Megatron-LM's layouts are per-rank buckets of its distributed optimizer or its non-distributed
optimizer's parameter groups; the optimizer starts fresh) and the RNG states (per rank).
A 'release' checkpoint, or --finetune, loads the weights only, at iteration 0.
"""
from __future__ import annotations

import torch

from megatron_sp.checkpointing.comm import global_rank, agree_on_error
from megatron_sp.checkpointing.format import (AgreedCheckpointError, CheckpointError,
                                              check_config, named_parameters, param_shard,
                                              schedule_to_load)
from megatron_sp.checkpointing.megatron_lm.read import MegatronCheckpoint, read_checkpoint


def our_scheduler(ckpt: MegatronCheckpoint) -> dict | None:
    """Our LRScheduler state (iterations) of Megatron-LM's opt_param_scheduler state (samples)."""
    s = ckpt.scheduler
    gbs = ckpt.stored.get("global_batch_size")
    if not s or not gbs:
        return None
    out = {"num_steps": int(s["num_steps"]) // gbs, "max_lr": s["max_lr"], "min_lr": s["min_lr"],
           "warmup_iters": int(s["lr_warmup_steps"]) // gbs,
           "decay_iters": int(s["lr_decay_steps"]) // gbs, "style": s["lr_decay_style"]}
    if ckpt.stored.get("lr_wsd_decay_iters") is not None:
        out["wsd_decay_iters"] = int(ckpt.stored["lr_wsd_decay_iters"])
    return out


def _copy_weights(ckpt: MegatronCheckpoint, chunks, mesh) -> None:
    """Each parameter's rectangle (format.param_shard's geometry) cut from the full tensor."""
    with torch.no_grad():
        for name, p in named_parameters(chunks):
            shard = param_shard(p, p.data, mesh.tp_rank, mesh.tp_size)
            if shard is None:
                continue
            full = ckpt.tensors[name]
            rows = getattr(p, "real_rows", None)
            if rows is not None:
                full = full[:rows]                                   # [V, H]
            full = full.reshape(shard.global_shape)                  # e.g. [c, n/c, ...] fused
            where = tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.local.shape))
            shard.local.copy_(full[where].to(shard.local.dtype))


def _check(ckpt: MegatronCheckpoint, chunks, config) -> None:
    """The model's shapes against the checkpoint's (one sentence naming the flags)."""
    saved = dict(ckpt.fields)
    rows = saved.pop("vocab_size")
    check_config(saved, config, ckpt.folder)
    if config is not None and config.vocab_size > rows:
        raise CheckpointError(f"checkpoint {ckpt.folder} has {rows} vocabulary rows but the model "
                              f"{config.vocab_size}; pass --use-checkpoint-args or the "
                              f"checkpoint's tokenizer.")
    names = {n for n, _ in named_parameters(chunks)}
    missing = sorted(names - set(ckpt.tensors))
    if missing:
        raise CheckpointError(f"checkpoint {ckpt.folder} has no tensor for {missing[0]}; it does "
                              f"not fit the model (pass --use-checkpoint-args).")


def load_for_training(path: str, chunks, mesh, *, optimizer=None, scheduler=None,
                      train_state=None, config=None, finetune: bool = False,
                      schedule: str | None = None) -> dict:
    """Load a Megatron-LM checkpoint into this run (collective: the ranks agree on a refusal).
    Returns a metadata dict like load_checkpoint's (iteration, format)."""
    ckpt, error, schedule_state = None, None, None
    try:
        ckpt = read_checkpoint(path)
        _check(ckpt, chunks, config)
        weights_only = finetune or ckpt.iteration == "release"
        saved = None if weights_only else our_scheduler(ckpt)
        if scheduler is not None and saved is not None:
            schedule_state = schedule_to_load(saved, scheduler, schedule, ckpt.folder)
    except CheckpointError as err:
        error = str(err)
    except OSError as err:
        error = f"cannot read checkpoint {path}: {err}; check the files' permissions and disk."
    error = agree_on_error(error)
    if error is not None:
        raise AgreedCheckpointError(error)
    _copy_weights(ckpt, chunks, mesh)
    if hasattr(optimizer, "sync_master_from_params"):   # sharded master copies follow the weights
        optimizer.sync_master_from_params()
    iteration = 0 if weights_only else ckpt.iteration
    if not weights_only:
        if schedule_state is not None:
            scheduler.load_state_dict(schedule_state)
        if train_state is not None:
            train_state.iteration = ckpt.iteration
            train_state.consumed_train_samples = ckpt.consumed_train_samples
            train_state.consumed_valid_samples = ckpt.consumed_valid_samples
    if global_rank() == 0:
        rows = ckpt.fields["vocab_size"]
        dropped = rows - config.vocab_size if config is not None else 0
        print(f"> loaded Megatron-LM checkpoint {ckpt.folder} ({ckpt.ckpt_format}, saved at tp "
              f"{ckpt.stored.get('tensor_model_parallel_size', 1)} x pp "
              f"{ckpt.stored.get('pipeline_model_parallel_size', 1)}): "
              + ("weights only, training starts at iteration 0" if weights_only else
                 f"at iteration {iteration}, {ckpt.consumed_train_samples} samples consumed")
              + (f"; its last {dropped} vocabulary rows (padding) are not used" if dropped > 0
                 else ""), flush=True)
        if optimizer is not None and not weights_only:
            print("> note: the optimizer starts fresh (Megatron-LM's Adam moments are not read)"
                  + ("" if ckpt.has_optimizer else "; the checkpoint holds none")
                  + ", and the RNG states are not restored", flush=True)
    return {"iteration": iteration, "format": "megatron_lm", "ckpt_format": ckpt.ckpt_format}
