"""transformers.Trainer and trl.SFTTrainer under our Ulysses sp (docs/design.md §15), two lines:

    from megatron_sp.hf.trainer import SequenceParallelTrainer      # instead of transformers.Trainer
    trainer = SequenceParallelTrainer(model=model, args=args, ..., sp_size=4)

    from megatron_sp.hf.trainer import sequence_parallel_trainer    # any Trainer subclass
    trainer = sequence_parallel_trainer(SFTTrainer)(model=model, args=args, ..., sp_size=4)

launched as before (torchrun --nproc-per-node dp*sp). Why a mixin and not a function that patches a
built trainer: the model must become sequence-parallel before accelerate wraps it (train() does, so
__init__ is the place), every override is an ordinary method a reader finds in one class
(`SequenceParallelMixin`, first in the MRO: it replaces the subclass's compute_loss and
prediction_step, e.g. SFTTrainer's), and a user's own Trainer subclass works the same way
(`sequence_parallel_trainer(MyTrainer)`).

What the mixin changes, and nothing else (DDP / FSDP2, optimizer, scheduler, logging, checkpoints
stay the Trainer's):
- mesh: megatron_sp.mesh.ParallelMesh (dp, sp), sp ranks adjacent (rank = dp_rank*sp + sp_rank),
  built once in __init__ from the process group the Trainer's accelerate state started (or passed
  in: mesh=); the model goes through megatron_sp.hf.sequence_parallel(model, mesh.sp_group).
- data: the Trainer's own dataloaders, with accelerate's shard wrapper told the dp size and dp
  rank instead of the world's, so the sp ranks of a replica load the same batch and
  len(dataloader), max_steps, epochs and the total batch size are those of a dp-rank job without
  sp (tokens per optimizer step unchanged); each rank keeps its chunk with shard_batch in
  compute_loss. per_device_train_batch_size is per dp replica.
- loss (exact, gradient accumulation included): for micro-batch m of dp replica d,
      L_m,d = megatron_sp.hf.loss(logits, shard, sp_group)   (sum / count over the whole sequence)
      loss  = L_m,d * C_m,d * dp / N
  with C_m,d its unmasked targets (counted on the full batch every sp rank holds) and N the count
  over the optimizer step's micro-batches and dp replicas (`_get_num_items_in_batch`, one count
  all-reduce over dp per step). The Trainer's DDP / FSDP2 AVERAGE gradients over the world
  (= dp x sp), which by megatron_sp/hf/loss.py makes the gradient exactly that of
  sum(token losses of the step) / N, what one process computes with the whole batch (and what
  the unmodified Trainer computes with num_items_in_batch). `loss_is_scaled_for_ga = True`: the
  Trainer does not divide by the accumulation steps again. The logged loss (the Trainer's mean
  over the world of the summed micro-batch values) is that same global mean.
- evaluation: the same exact loss per eval batch (N over that batch's dp replicas); the gathered
  eval losses keep one sp rank per replica (the others are copies), so eval_loss is the
  unmodified Trainer's figure. Logits are not returned (each rank holds only its chunk): metrics
  that need predictions are not computed under sp > 1.
- token and FLOP counters (num_input_tokens_seen, total_flos): divided by sp (each sp rank of a
  replica sees the whole batch).
- checkpoints: each one also holds megatron_sp_layout.json (sp, dp, the global batch). Resuming
  one saved in another layout (say sp 2 on 2 ranks, resumed with sp 1: dp 2) changes the global
  batch with the same per_device_train_batch_size; the run goes on (layouts may change) after one
  note on stderr naming the old and new sp x dp and global batch, and the per-replica batch that
  keeps the old one.
Refused in one sentence: DeepSpeed (use DDP or FSDP2), accelerate's own sp/cp parallelism_config,
train_sampling_strategy="batch_rebalance", dispatch_batches and a sharded streaming dataset (their
sharding cannot be told the dp size).
"""
from __future__ import annotations

import functools
import json
import os
import sys

import torch
from transformers import Trainer

from megatron_sp.errors import ConfigError
from megatron_sp.hf.attention import sequence_parallel
from megatron_sp.hf.batch import IGNORE_INDEX, prepare_full, shard_batch
from megatron_sp.hf.comm import count_over_groups
from megatron_sp.hf.loss import loss as sequence_loss
from megatron_sp.mesh import ParallelMesh


LAYOUT_FILE = "megatron_sp_layout.json"     # in every checkpoint-N folder the trainer saves


def layout_change_note(saved: dict, now: dict, folder: str) -> str | None:
    """The note when a checkpoint saved at one sp x dp is resumed at another (None if the same):
    saved, now: {"sp", "dp", "global_batch", "per_device_train_batch_size",
    "gradient_accumulation_steps"}."""
    if (saved.get("sp"), saved.get("dp")) == (now["sp"], now["dp"]):
        return None
    old, new = saved.get("global_batch"), now["global_batch"]
    text = (f"note: resuming {folder}, saved at sp {saved.get('sp')} x dp {saved.get('dp')} "
            f"(global batch {old}), at sp {now['sp']} x dp {now['dp']}: ")
    if old == new:
        return text + f"the global batch stays {new} sequences per optimizer step."
    text += (f"the global batch is now {new} sequences per optimizer step, not {old} "
             f"(per_device_train_batch_size {now['per_device_train_batch_size']} per dp replica x "
             f"gradient_accumulation_steps {now['gradient_accumulation_steps']} x dp "
             f"{now['dp']}), and the steps already done are skipped in batches of {new}")
    per_replica = now["gradient_accumulation_steps"] * now["dp"]
    if isinstance(old, int) and old % per_replica == 0:
        text += (f"; per_device_train_batch_size {old // per_replica} keeps the global "
                 f"batch of {old}")
    return text + "."


def target_count(batch: dict) -> torch.Tensor:
    """Unmasked targets of a full (unsharded) batch, by shard_batch's rule (labels shifted over the
    whole sequence, -100 at row ends, document ends and padding): a float32 scalar."""
    full = prepare_full(batch, 1)
    return (full["shift_labels"] != IGNORE_INDEX).sum().to(torch.float32)


class SequenceParallelMixin:
    """Put first in the bases of a transformers.Trainer subclass; adds the keyword `sp_size`
    (or `mesh`, a ParallelMesh with tp = pp = cp = 1). See the module docstring."""

    def __init__(self, *args, sp_size: int | None = None, mesh: ParallelMesh | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        _check_trainer(self)
        if mesh is None:      # the Trainer's accelerate state has started the process group
            mesh = ParallelMesh.from_sizes(sp=sp_size or 1)
        elif sp_size is not None and sp_size != mesh.sp_size:
            raise ConfigError(f"SequenceParallelTrainer: sp_size={sp_size} but the mesh passed has "
                              f"sp={mesh.sp_size}; pass one of them.")
        if (mesh.tp_size, mesh.pp_size, mesh.cp_size) != (1, 1, 1):
            raise ConfigError(f"SequenceParallelTrainer runs dp x sp only, got {mesh!r}; build the "
                              f"mesh with ParallelMesh.from_sizes(sp=...).")
        self.mesh = mesh
        self.sp_group, self.dp_group = mesh.sp_group, mesh.dp_group
        self.model = sequence_parallel(self.model, self.sp_group)
        self.model_wrapped = self.model
        self.loss_is_scaled_for_ga = True        # compute_loss normalises over the whole step

    # Checkpoints: the layout they were saved in, a note when resumed in another -------------
    def layout(self) -> dict:
        """This run's sp x dp and global batch (what LAYOUT_FILE records)."""
        return {"sp": self.mesh.sp_size, "dp": self.mesh.dp_size,
                "global_batch": self.get_total_train_batch_size(self.args),
                "per_device_train_batch_size": self._train_batch_size,
                "gradient_accumulation_steps": self.args.gradient_accumulation_steps}

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
        folder = os.path.join(self._get_output_dir(trial=trial),
                              f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and os.path.isdir(folder):
            tmp = os.path.join(folder, f".{LAYOUT_FILE}.tmp{os.getpid()}")
            with open(tmp, "w") as f:
                json.dump(self.layout(), f)
            os.replace(tmp, os.path.join(folder, LAYOUT_FILE))

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True:      # the Trainer's own rule: the last checkpoint-N
            from transformers.trainer_utils import get_last_checkpoint
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            path = os.path.join(resume_from_checkpoint, LAYOUT_FILE)
            try:
                with open(path) as f:
                    saved = json.load(f)
            except (OSError, ValueError):     # saved by an unmodified Trainer, or an older one
                saved = None
            note = saved and layout_change_note(saved, self.layout(), str(resume_from_checkpoint))
            if note and self.is_world_process_zero():
                print(note, file=sys.stderr, flush=True)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # Data: shard over dp only --------------------------------------------------------------
    def get_train_dataloader(self):
        return _shard_over_dp(super().get_train_dataloader(), self.mesh)

    def get_eval_dataloader(self, eval_dataset=None):
        return _shard_over_dp(super().get_eval_dataloader(eval_dataset), self.mesh)

    def get_test_dataloader(self, test_dataset):
        return _shard_over_dp(super().get_test_dataloader(test_dataset), self.mesh)

    def get_total_train_batch_size(self, training_args) -> int:
        return (self._train_batch_size * training_args.gradient_accumulation_steps
                * self.mesh.dp_size)

    # Loss --------------------------------------------------------------------------------
    def _get_num_items_in_batch(self, batch_samples: list, device):
        """N: unmasked targets of these micro-batches, summed over the dp replicas (the sp ranks
        of a replica hold the same batches, so each counts its replica once)."""
        if not batch_samples:
            return None
        local = sum(target_count(batch) for batch in batch_samples).to(device)
        return count_over_groups(local, (self.dp_group,))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """This micro-batch's share of the step's exact mean (module docstring)."""
        count = target_count(inputs).to(self.args.device)
        if num_items_in_batch is None:           # one batch on its own (evaluation)
            num_items_in_batch = count_over_groups(count.clone(), (self.dp_group,))
        shard = shard_batch(inputs, self.sp_group, pad_token_id=self._pad_token_id())
        outputs = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                        attention_mask=shard.get("attention_mask"), use_cache=False)
        mean = sequence_loss(outputs.logits, shard, self.sp_group)
        scale = count * self.mesh.dp_size / torch.as_tensor(num_items_in_batch).clamp(min=1)
        loss = mean * scale
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def evaluation_loop(self, *args, **kwargs):
        # The Trainer resets gather_function at the end of every evaluation loop.
        self.gather_function = functools.partial(_gather_one_sp_rank, self.accelerator, self.mesh)
        return super().evaluation_loop(*args, **kwargs)

    # Counters ------------------------------------------------------------------------------
    def floating_point_ops(self, inputs) -> int:
        return super().floating_point_ops(inputs) // self.mesh.sp_size

    def _track_num_input_tokens(self, inputs):
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (
            self.state.num_input_tokens_seen - before) // self.mesh.sp_size

    def _pad_token_id(self):
        for owner in (self.processing_class, getattr(self.model, "config", None)):
            pad = getattr(owner, "pad_token_id", None)
            if pad is not None:
                return pad
        return None


def _check_trainer(trainer) -> None:
    training_args = trainer.args
    if not hasattr(trainer, "loss_is_scaled_for_ga"):
        import transformers
        raise ConfigError(f"SequenceParallelTrainer needs the Trainer's loss_is_scaled_for_ga "
                          f"(transformers 5), this is transformers {transformers.__version__}; "
                          f"upgrade transformers.")
    if trainer.is_deepspeed_enabled:
        raise ConfigError("SequenceParallelTrainer reduces gradients through the Trainer's DDP or "
                          "FSDP2, not DeepSpeed; remove the deepspeed config (for DeepSpeed's own "
                          "ALST use accelerate's ParallelismConfig instead of this class).")
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None and (pc.sp_enabled or pc.cp_enabled):
        raise ConfigError("SequenceParallelTrainer brings its own sequence parallelism; remove "
                          "sp_size / cp_size from the parallelism_config.")
    if training_args.train_sampling_strategy == "batch_rebalance":
        raise ConfigError("SequenceParallelTrainer cannot tell train_sampling_strategy="
                          "'batch_rebalance' the dp size; use 'random', 'sequential' or "
                          "'group_by_length'.")
    if training_args.accelerator_config.dispatch_batches:
        raise ConfigError("SequenceParallelTrainer needs every rank to load its replica's batch; "
                          "set accelerator_config dispatch_batches to False.")


def _shard_over_dp(loader, mesh: ParallelMesh):
    """Tell accelerate's shard wrapper (BatchSamplerShard for map-style datasets,
    IterableDatasetShard for iterable ones) the dp size and dp rank instead of the world's: it
    reads them on every iteration and for len(). The sp ranks of a replica then load the same
    batches, the ones an unmodified job on dp ranks would."""
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard

    if mesh.world_size == 1:
        return loader
    sampler = getattr(loader, "batch_sampler", None)
    shards = [x for x in (sampler, getattr(loader, "sampler", None), getattr(loader, "dataset", None))
              if isinstance(x, (BatchSamplerShard, IterableDatasetShard))]
    if not shards:
        raise ConfigError(f"SequenceParallelTrainer: the dataloader over "
                          f"{type(getattr(loader, 'dataset', None)).__name__} is not sharded by "
                          f"accelerate's BatchSamplerShard or IterableDatasetShard (a streaming "
                          f"dataset split by shards?), so its sp ranks would load different data; "
                          f"use a map-style or torch IterableDataset.")
    for shard in shards:
        shard.num_processes, shard.process_index = mesh.dp_size, mesh.dp_rank
        if mesh.dp_size == 1 and isinstance(shard, BatchSamplerShard):
            shard.even_batches = False  # one replica: a short last batch, as with no wrapper
    return loader


def _gather_one_sp_rank(accelerator, mesh: ParallelMesh, data, **_):
    """gather_for_metrics over dp replicas: gather over the world (rank = dp_rank*sp + sp_rank),
    keep sp rank 0 of each replica, and drop the samples accelerate repeated to even out the last
    batch (its remainder is counted over dp, as the dataloader's shard wrapper now is)."""
    from accelerate.utils import recursively_apply

    gathered = accelerator.gather(data)
    state = accelerator.gradient_state

    def keep(t):
        t = t.reshape(mesh.dp_size, mesh.sp_size, -1, *t.shape[1:])[:, 0]   # [dp, sp, n, ..] -> [dp, n, ..]
        t = t.reshape(-1, *t.shape[2:])                                    # [dp*n, ..]
        if state.end_of_dataloader and state.remainder > 0:
            t = t[: state.remainder]
        return t

    return recursively_apply(keep, gathered)


@functools.cache
def sequence_parallel_trainer(trainer_cls: type) -> type:
    """`trainer_cls` (transformers.Trainer, trl.SFTTrainer or a subclass of yours) made
    sequence-parallel: a subclass with SequenceParallelMixin first; its __init__ takes sp_size=."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise ConfigError(f"sequence_parallel_trainer takes a transformers.Trainer subclass, got "
                          f"{trainer_cls!r}.")
    if issubclass(trainer_cls, SequenceParallelMixin):
        return trainer_cls
    return type(f"SequenceParallel{trainer_cls.__name__}", (SequenceParallelMixin, trainer_cls),
                {"__module__": __name__, "__doc__": f"{trainer_cls.__name__} under Ulysses sp "
                                                     f"(megatron_sp.hf.trainer)."})


SequenceParallelTrainer = sequence_parallel_trainer(Trainer)
