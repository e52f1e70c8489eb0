"""transformers.Trainer and trl.SFTTrainer under our Ulysses sp x ring cp (docs/design.md §15), two lines:

    from megatron_sp.hf.trainer import SequenceParallelTrainer      # instead of transformers.Trainer
    trainer = SequenceParallelTrainer(model=model, args=args, ..., sp_size=4, cp_size=2)

    from megatron_sp.hf.trainer import sequence_parallel_trainer    # any Trainer subclass
    trainer = sequence_parallel_trainer(SFTTrainer)(model=model, args=args, ..., sp_size=4)

launched as before (torchrun or accelerate launch, dp*sp*cp processes; DDP or FSDP2). Why a mixin and not a function that patches a
built trainer: the model must become sequence-parallel before accelerate wraps it (train() does, so
__init__ is the place), every override is an ordinary method a reader finds in one class
(`SequenceParallelMixin`, first in the MRO: it replaces the subclass's compute_loss and
prediction_step, e.g. SFTTrainer's), and a user's own Trainer subclass works the same way
(`sequence_parallel_trainer(MyTrainer)`).

What the mixin changes, and nothing else (DDP / FSDP2, optimizer, scheduler, logging, checkpoints
stay the Trainer's):
- mesh: megatron_sp.mesh.ParallelMesh (dp, cp, sp), sp ranks adjacent (rank = dp_rank*cp*sp +
  cp_rank*sp + sp_rank), built once in __init__ from the process group the Trainer's accelerate
  state started (or passed in: mesh=); the model goes through
  megatron_sp.hf.sequence_parallel(model, mesh.sp_group, mesh.cp_group): Ulysses over sp, the
  ring over cp past the head count. One line on stderr at the first step says the layout, what
  the attention runs and whether the batches have packed documents.
- data: the Trainer's own dataloaders, with accelerate's shard wrapper told the dp size and dp
  rank instead of the world's, so the sp ranks of a replica load the same batch and
  len(dataloader), max_steps, epochs and the total batch size are those of a dp-rank job without
  sp (tokens per optimizer step unchanged); each rank keeps its chunk (shard_batch's layout).
  per_device_train_batch_size is per dp replica. Each micro-batch is prepared once per step
  (labels shifted, padded, cut, its targets counted) when the Trainer counts the step's targets
  (`_get_num_items_in_batch`), which also checks in one reduction that the context's ranks
  hold the same batches; compute_loss uses that preparation.
- loss (exact, gradient accumulation included): for micro-batch m of dp replica d,
      loss = S_m,d * dp / N = megatron_sp.hf.loss(logits, shard, context, num_items_in_batch=N) * dp
  with S_m,d its summed token losses over the whole sequence (ONE all-reduce of a scalar over the
  flattened sp x cp context per loss) and N the count over the optimizer step's micro-batches and
  dp replicas (`_get_num_items_in_batch`, one count all-reduce over dp per step). The Trainer's
  DDP / FSDP2 AVERAGE gradients over the world (= dp x sp x cp), which by megatron_sp/hf/loss.py makes the gradient exactly that of
  sum(token losses of the step) / N, what one process computes with the whole batch (and what
  the unmodified Trainer computes with num_items_in_batch). `loss_is_scaled_for_ga = True`: the
  Trainer does not divide by the accumulation steps again. The logged loss (the Trainer's mean
  over the world of the summed micro-batch values) is that same global mean.
- evaluation: the exact mean of each eval batch over its dp replicas (one all-reduce over the
  world of [sum, count]); the gathered
  eval losses keep one sp rank per replica (the others are copies), so eval_loss is the
  unmodified Trainer's figure. Logits are not returned (each rank holds only its chunk): metrics
  that need predictions are not computed under sp > 1.
- token and FLOP counters (num_input_tokens_seen, total_flos): divided by sp x cp (each rank of a
  replica sees the whole batch).
- checkpoints: each one also holds megatron_sp_layout.json (sp, cp, dp, the global batch). Resuming
  one saved in another layout (say sp 2 on 2 ranks, resumed with sp 1: dp 2) changes the global
  batch with the same per_device_train_batch_size; the run goes on (layouts may change) after one
  note on stderr naming the old and new sp x dp and global batch, and the per-replica batch that
  keeps the old one.
Refused in one sentence (no traceback: megatron_sp.reporting.say_user_errors; the DeepSpeed config
and accelerate's sp/cp parallelism_config before accelerate sees them, naming the two lines to
change): DeepSpeed (use DDP or FSDP2), accelerate's own sp/cp parallelism_config,
train_sampling_strategy="batch_rebalance", dispatch_batches, torch_compile=True with sp or cp,
and a sharded streaming dataset (their sharding cannot be told the dp size).
"""
from __future__ import annotations

import functools
import json
import os
import sys

import torch
from transformers import Trainer

from megatron_sp.errors import ConfigError
from megatron_sp.fileutil import write_text_atomic
from megatron_sp.reporting import say_user_errors
from megatron_sp.hf.attention import layout_of, sequence_parallel
from megatron_sp.hf.batch import (IGNORE_INDEX, batch_checksum, check_same_batch, has_documents,
                                  prepare_shard)
from megatron_sp.hf.comm import count_over_groups
from megatron_sp.hf.loss import loss as sequence_loss
from megatron_sp.mesh import ParallelMesh


LAYOUT_FILE = "megatron_sp_layout.json"     # in every checkpoint-N folder the trainer saves
PREPARED = "_megatron_sp_shard"              # a micro-batch's preparation, kept in its dict


def _layout_words(layout: dict) -> str:
    cp = layout.get("cp", 1)
    return f"sp {layout.get('sp')}" + (f" x cp {cp}" if cp != 1 else "") + f" x dp {layout.get('dp')}"


def layout_change_note(saved: dict, now: dict, folder: str) -> str | None:
    """The note when a checkpoint saved at one sp x cp x dp is resumed at another (None if the
    same): saved, now: {"sp", "cp" (1 when absent), "dp", "global_batch",
    "per_device_train_batch_size", "gradient_accumulation_steps"}."""
    key = ("sp", "cp", "dp")
    if tuple(saved.get(k, 1) for k in key) == tuple(now.get(k, 1) for k in key):
        return None
    old, new = saved.get("global_batch"), now["global_batch"]
    text = (f"note: resuming {folder}, saved at {_layout_words(saved)} "
            f"(global batch {old}), at {_layout_words(now)}: ")
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


class SequenceParallelMixin:
    """Put first in the bases of a transformers.Trainer subclass; adds the keywords `sp_size` and
    `cp_size` (or `mesh`, a ParallelMesh with tp = pp = 1). See the module docstring."""

    def __init__(self, *args, sp_size: int | None = None, cp_size: int | None = None,
                 mesh: ParallelMesh | None = None, **kwargs):
        say_user_errors()
        _check_sizes(sp_size, cp_size)
        _check_arguments(kwargs["args"] if "args" in kwargs else
                         (args[1] if len(args) > 1 else None), sp_size, cp_size)
        super().__init__(*args, **kwargs)
        _check_trainer(self)
        if mesh is None:      # the Trainer's accelerate state has started the process group
            mesh = ParallelMesh.from_sizes(sp=sp_size or 1, cp=cp_size or 1)
        else:
            for name, size, has in (("sp_size", sp_size, mesh.sp_size),
                                    ("cp_size", cp_size, mesh.cp_size)):
                if size is not None and size != has:
                    raise ConfigError(f"SequenceParallelTrainer: {name}={size} but the mesh "
                                      f"passed has {name[:2]}={has}; pass one of them.")
        if (mesh.tp_size, mesh.pp_size) != (1, 1):
            raise ConfigError(f"SequenceParallelTrainer runs dp x sp x cp only, got {mesh!r}; "
                              f"build the mesh with ParallelMesh.from_sizes(sp=..., cp=...).")
        self.mesh = mesh
        self.sp_group, self.cp_group, self.dp_group = mesh.sp_group, mesh.cp_group, mesh.dp_group
        self.context_group = mesh.context_group()     # sp x cp as one group: one loss reduction
        self.context_size = mesh.sp_size * mesh.cp_size
        self.model = sequence_parallel(self.model, self.sp_group, self.cp_group)
        self.model_wrapped = self.model
        self.loss_is_scaled_for_ga = True        # compute_loss normalises over the whole step
        self._said_layout = False

    def startup_line(self, batch: dict) -> str:
        """The layout, what every attention layer runs, and what the first batch holds: packed
        documents (position_ids restarting at 0), padding, or neither."""
        m, state = self.mesh, layout_of(self.model)
        attention = state.describe() if state is not None else "the model's own (no sp, no cp)"
        positions, mask = batch.get("position_ids"), batch.get("attention_mask")
        # position_ids [1 | b, s] (or [s]) -> [rows, s]
        if positions is not None and has_documents(positions.reshape(-1, positions.shape[-1])):
            documents = ("packed documents detected (position_ids restart at 0): each token "
                         "attends within its document")
        elif mask is not None and not bool(mask.bool().all()):
            documents = "padding detected: no token attends to a pad"
        else:
            documents = "no packed documents or padding in the first batch"
        return (f"megatron_sp.hf: dp {m.dp_size} x sp {m.sp_size} x cp {m.cp_size} "
                f"(world {m.world_size}); attention: {attention}; {documents}")

    # Checkpoints: the layout they were saved in, a note when resumed in another -------------
    def layout(self) -> dict:
        """This run's sp x cp x dp and global batch (what LAYOUT_FILE records)."""
        return {"sp": self.mesh.sp_size, "cp": self.mesh.cp_size, "dp": self.mesh.dp_size,
                "global_batch": self.get_total_train_batch_size(self.args),
                "per_device_train_batch_size": self._train_batch_size,
                "gradient_accumulation_steps": self.args.gradient_accumulation_steps}

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
        folder = os.path.join(self._get_output_dir(trial=trial),
                              f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and os.path.isdir(folder):
            write_text_atomic(os.path.join(folder, LAYOUT_FILE), json.dumps(self.layout()))

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
    def _prepare(self, batch: dict) -> tuple[dict, torch.Tensor]:
        """(this rank's shard, the whole micro-batch's unmasked targets), prepared once."""
        m = self.mesh
        return prepare_shard(batch, m.sp_size, m.sp_rank, cp=m.cp_size, cp_rank=m.cp_rank,
                             pad_token_id=self._pad_token_id())

    def _without_repeats(self, shard: dict) -> dict:
        """An evaluation's last batch over dp: accelerate fills the replicas' batches with samples
        repeated from the start (even_batches) and drops them from the gathered losses; their
        targets are masked here too, so the batch's mean over dp is that of its real samples
        (replica d holds global samples [d*b, (d+1)*b); the first `remainder` are real)."""
        state = self.accelerator.gradient_state
        if self.mesh.dp_size == 1 or not (state.end_of_dataloader and state.remainder > 0):
            return shard
        labels = shard["shift_labels"]
        b = labels.shape[0]
        real = min(max(state.remainder - self.mesh.dp_rank * b, 0), b)
        if real == b:
            return shard
        labels = labels.clone()
        labels[real:] = IGNORE_INDEX
        return {**shard, "shift_labels": labels}

    def _get_num_items_in_batch(self, batch_samples: list, device):
        """N: unmasked targets of these micro-batches, summed over the dp replicas (the ranks of
        a replica's context hold the same batches, so each counts its replica once). Each
        micro-batch is prepared here, once, and its shard kept in its dict for compute_loss; the
        batches' checksum is compared over the context in the same pass."""
        if not batch_samples:
            return None
        local = torch.zeros((), dtype=torch.float32)
        checksum = torch.zeros((), dtype=torch.int64)
        for batch in batch_samples:
            if self.context_size > 1:
                checksum = checksum * 1000003 + batch_checksum(batch).cpu()
            shard, count = self._prepare(batch)
            batch[PREPARED] = shard
            local = local + count.cpu()
        check_same_batch(checksum if self.context_size > 1 else None, self.sp_group,
                         self.cp_group)
        return count_over_groups(local.to(device), (self.dp_group,))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """This micro-batch's share of the step's exact mean (module docstring)."""
        if not self._said_layout and model.training:
            self._said_layout = True
            if self.is_world_process_zero():
                print(self.startup_line(inputs), file=sys.stderr, flush=True)
        shard = inputs.pop(PREPARED, None)
        if shard is None:                        # not counted by the Trainer (evaluation)
            shard, _ = self._prepare(inputs)
        outputs = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                        attention_mask=shard.get("attention_mask"), use_cache=False)
        if num_items_in_batch is None:           # one batch on its own: its mean over dp
            loss = sequence_loss(outputs.logits, self._without_repeats(shard),
                                 self.mesh.dp_sp_group)
        else:                                    # sum over the context / the step's N, x dp
            loss = sequence_loss(outputs.logits, shard, self.context_group,
                                 num_items_in_batch=num_items_in_batch) * self.mesh.dp_size
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
        return super().floating_point_ops(inputs) // self.context_size

    def _track_num_input_tokens(self, inputs):
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (
            self.state.num_input_tokens_seen - before) // self.context_size

    def _pad_token_id(self):
        for owner in (self.processing_class, getattr(self.model, "config", None)):
            pad = getattr(owner, "pad_token_id", None)
            if pad is not None:
                return pad
        return None


TWO_LINES = ("make the two lines `from megatron_sp.hf.trainer import SequenceParallelTrainer` and "
             "`SequenceParallelTrainer(..., sp_size=N, cp_size=M)` the only sequence parallelism")


def _check_sizes(sp_size, cp_size) -> None:
    """sp_size / cp_size: None (1) or a positive integer; 0 is refused like -1 (it would train
    without sequence parallelism, silently)."""
    for name, size in (("sp_size", sp_size), ("cp_size", cp_size)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ConfigError(f"SequenceParallelTrainer: {name}={size!r} is not a positive "
                              f"integer; pass {name}=N with N >= 1 (1, or leaving it out, for no "
                              f"{'sequence' if name == 'sp_size' else 'context'} parallelism).")


def _check_arguments(training_args, sp_size, cp_size) -> None:
    """What accelerate would refuse (or run differently) before it sees it: a DeepSpeed config, an
    sp/cp ParallelismConfig, torch_compile under sp/cp. One sentence each, naming the change."""
    if training_args is None:
        return
    if getattr(training_args, "deepspeed", None):
        raise ConfigError(f"SequenceParallelTrainer reduces gradients through the Trainer's DDP or "
                          f"FSDP2, not DeepSpeed: remove deepspeed= from the TrainingArguments "
                          f"(for FSDP2 pass fsdp='full_shard' with fsdp_config={{'fsdp_version': "
                          f"2}}), or keep DeepSpeed and use accelerate's ParallelismConfig "
                          f"(sp_backend='deepspeed') with transformers.Trainer instead of this class.")
    pc = getattr(training_args, "parallelism_config", None)
    sizes = {k: getattr(pc, k, 1) or 1 for k in ("sp_size", "cp_size")} if pc is not None else {}
    if any(v > 1 for v in sizes.values()):
        given = ", ".join(f"{k}={v}" for k, v in sizes.items() if v > 1)
        raise ConfigError(f"SequenceParallelTrainer brings its own sequence and context "
                          f"parallelism, but the TrainingArguments' parallelism_config has "
                          f"{given}: remove parallelism_config= (or its sp_size / cp_size) and "
                          f"pass {given} to SequenceParallelTrainer(...) instead.")
    if getattr(training_args, "torch_compile", False) and (sp_size or 1) * (cp_size or 1) > 1:
        raise ConfigError("SequenceParallelTrainer: torch_compile=True is not supported under sp "
                          "or cp (the attention's all-to-alls and ring run in eager PyTorch); set "
                          "torch_compile=False.")


def _check_trainer(trainer) -> None:
    training_args = trainer.args
    if not hasattr(trainer, "loss_is_scaled_for_ga"):
        import transformers
        raise ConfigError(f"SequenceParallelTrainer needs the Trainer's loss_is_scaled_for_ga "
                          f"(transformers 5), this is transformers {transformers.__version__}; "
                          f"upgrade transformers.")
    if trainer.is_deepspeed_enabled:     # an accelerate config file's DeepSpeed plugin
        raise ConfigError("SequenceParallelTrainer reduces gradients through the Trainer's DDP or "
                          "FSDP2, not DeepSpeed: launch with an accelerate config whose "
                          "distributed_type is MULTI_GPU / MULTI_CPU (DDP) or FSDP "
                          "(fsdp_version: 2), not DEEPSPEED.")
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None and (pc.sp_enabled or pc.cp_enabled):
        raise ConfigError("SequenceParallelTrainer brings its own sequence parallelism: remove "
                          "sp_size / cp_size from the accelerate config's parallelism_config and "
                          "pass them to SequenceParallelTrainer(...) instead.")
    note = fsdp_dropped_note(training_args.fsdp, trainer.is_fsdp_enabled,
                             trainer.accelerator.distributed_type.value)
    if note and trainer.is_world_process_zero():
        print(note, file=sys.stderr, flush=True)
    if training_args.train_sampling_strategy == "batch_rebalance":
        raise ConfigError("SequenceParallelTrainer cannot tell train_sampling_strategy="
                          "'batch_rebalance' the dp size; use 'random', 'sequential' or "
                          "'group_by_length'.")
    if training_args.accelerator_config.dispatch_batches:
        raise ConfigError("SequenceParallelTrainer needs every rank to load its replica's batch; "
                          "set accelerator_config dispatch_batches to False.")


def fsdp_dropped_note(fsdp, fsdp_enabled: bool, distributed_type: str) -> str | None:
    """The note when fsdp= was asked for and accelerate dropped it (it keeps FSDP on GPUs only,
    accelerate/state.py: on CPU the Trainer silently runs DDP), else None."""
    if not fsdp or fsdp_enabled:
        return None
    import accelerate
    return (f"note: accelerate {accelerate.__version__} runs FSDP on GPUs only, so this "
            f"{distributed_type} run of fsdp={fsdp!r} is DDP (the same gradients, parameters "
            f"replicated).")


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
    """gather_for_metrics over dp replicas: gather over the world (rank = dp_rank*cp*sp +
    cp_rank*sp + sp_rank), keep context rank 0 of each replica, and drop the samples accelerate repeated to even out the last
    batch (its remainder is counted over dp, as the dataloader's shard wrapper now is)."""
    from accelerate.utils import recursively_apply

    gathered = accelerator.gather(data)
    state = accelerator.gradient_state

    def keep(t):
        context = mesh.sp_size * mesh.cp_size
        t = t.reshape(mesh.dp_size, context, -1, *t.shape[1:])[:, 0]   # [dp, cp sp, n, ..] -> [dp, n, ..]
        t = t.reshape(-1, *t.shape[2:])                                    # [dp*n, ..]
        if state.end_of_dataloader and state.remainder > 0:
            t = t[: state.remainder]
        return t

    return recursively_apply(keep, gathered)


@functools.cache
def sequence_parallel_trainer(trainer_cls: type) -> type:
    """`trainer_cls` (transformers.Trainer, trl.SFTTrainer or a subclass of yours) made
    sequence-parallel: a subclass with SequenceParallelMixin first; its __init__ takes sp_size=
    and cp_size=."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise ConfigError(f"sequence_parallel_trainer takes a transformers.Trainer subclass, got "
                          f"{trainer_cls!r}.")
    if issubclass(trainer_cls, SequenceParallelMixin):
        return trainer_cls
    return type(f"SequenceParallel{trainer_cls.__name__}", (SequenceParallelMixin, trainer_cls),
                {"__module__": __name__, "__doc__": f"{trainer_cls.__name__} under Ulysses sp x "
                                                     f"ring cp (megatron_sp.hf.trainer)."})


SequenceParallelTrainer = sequence_parallel_trainer(Trainer)
