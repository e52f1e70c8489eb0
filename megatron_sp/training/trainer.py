"""The training loop: micro-batches -> global batch step, evaluation, logging.

One step: count the global batch's unmasked tokens (summed over dp), run the schedule
(gradient accumulation, or a pipeline schedule), finish the gradient reduction over dp x sp,
clip to the global norm, step AdamW and the LR schedule (under --fp16 the loss is scaled first and
the gradients unscaled before the norm; an overflow skips the step and backs the scale off,
megatron_sp.training.loss_scaler), then log every --log-interval:
iteration, consumed samples, lr, lm loss, grad norm, ms/iter, tokens/s, TFLOP/s, MFU, memory,
skipped iterations and the straggler report (slowest rank's forward+backward time and its rank).

Failures (docs/design.md §12):
- a NaN or inf loss (or gradient norm) is reported with its iteration, saying which of the two
  was non-finite; `nonfinite_loss="skip"` drops that optimizer step (Megatron-like: the LR
  schedule does not advance, the iteration and its samples are counted, the log counts skipped
  iterations) and raises NonFiniteLossError after `max_skipped_steps` skipped steps in a row (the
  run diverged), `"stop"` raises NonFiniteLossError at once. The decision is the same on every
  rank: loss and norm are reduced over every rank first. The metrics jsonl writes a non-finite
  value as null (JSON has no NaN/inf); TensorBoard gets the value as it is.
- a collective that fails because another rank died or hung (gloo/NCCL error, or the
  --distributed-timeout-minutes timeout) is re-raised as CollectiveFailure naming the rank, the
  iteration and the timeout, never left as a hang.
- step hooks (`step_hooks`): objects with `before_forward(iteration, chunks) -> [handles]` and
  `after_compute(iteration, evaluating)`, called around every step's forward+backward; the
  test-only fault injection (megatron_sp.testing.FaultInjection, MEGATRON_SP_INJECT_*) is one.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch

from megatron_sp import comm_stats
from megatron_sp.errors import (CollectiveFailure, ConfigError, NonFiniteLossError, Terminated,
                                is_collective_failure)
from megatron_sp.context_parallel.balance import work_balance
from megatron_sp.training.flops import device_peak_tflops
from megatron_sp.grad_sync import (all_reduce_sum, gather_step_times, model_parallel_sum,
                                   reduce_loss_and_count)
from megatron_sp.sharding import Replicated
from megatron_sp.training.loss_scaler import LossScaler
from megatron_sp.training.metrics import memory_report, print_rank0
from megatron_sp.training.schedules import forward_backward_no_pipelining


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0     # validation position, stored so resume continues there
    skipped_iterations: int = 0
    loss_scaler: dict | None = None     # --fp16: the loss scaler's state (saved with the run)


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    num_tokens: int
    skipped: bool = False
    loss_scale: float = 1.0             # --fp16: the loss scale after this step (Megatron's log)



def describe_nonfinite(loss: float, grad_norm: float) -> str:
    """Which of the (reduced) loss and gradient norm is non-finite, e.g. "gradient norm inf (the
    loss 6.24 is finite)"."""
    bad_loss, bad_norm = not math.isfinite(loss), not math.isfinite(grad_norm)
    if bad_loss and bad_norm:
        return f"loss {loss} and gradient norm {grad_norm}"
    if bad_loss:
        return f"loss {loss} (the gradient norm {grad_norm:.4g} is finite)"
    return f"gradient norm {grad_norm} (the loss {loss:.4g} is finite)"


class Trainer:
    """Runs steps for a list of model chunks (one unless interleaved pipelining) on one mesh.

        trainer = Trainer(job, mesh, chunks, optimizer, scheduler, sharding=..., schedule=...)
        result = trainer.train_step(micro_batches)

    `job` is the run's megatron_sp.config.JobConfig: the batch, clipping and non-finite policy
    (training), bf16 / fp16 with its loss scaler / FP8 (precision), the bucket size, bf16 gradient
    reduction and collective timeout (parallel), MFU peak and the optional log fields (logging).
    `sharding`: the seam of sharded model state (megatron_sp.sharding), replicated when None;
    `schedule`: a pipeline schedule, gradient accumulation when None; `flops_per_step`: the model
    FLOPs of one global batch (training.flops); `step_hooks`: see the module docstring.
    """

    def __init__(self, job, mesh, model_chunks, optimizer, scheduler, *, sharding=None,
                 schedule=None, flops_per_step: float = 0.0, step_hooks=()):
        t, par = job.training, job.parallel
        self.job, self.mesh = job, mesh
        self.chunks = list(model_chunks)
        self.optimizer, self.scheduler = optimizer, scheduler
        per_step = t.micro_batch_size * mesh.dp_size
        if t.global_batch_size % per_step:
            raise ConfigError(
                f"--global-batch-size {t.global_batch_size} is not divisible by micro-batch size x "
                f"dp = {t.micro_batch_size} x {mesh.dp_size}: choose a multiple of {per_step}.")
        self.num_micro_batches = t.global_batch_size // per_step
        self.global_batch_size, self.seq_length = t.global_batch_size, t.seq_length
        self.schedule = schedule or forward_backward_no_pipelining
        self.flops_per_step = flops_per_step
        # The seam of sharded model state (megatron_sp.sharding): the object that owns gradient
        # reduction, norm and clipping: FSDP2's, the distributed optimizer, or replicated state.
        self.sharding = sharding or Replicated(self.chunks, mesh, bucket_mb=par.grad_bucket_size_mb)
        self.device = self.sharding.device
        peak = job.logging.peak_tflops
        fp8 = job.precision.fp8_format is not None        # MFU against the FP8 peak
        self.peak_tflops = device_peak_tflops(peak, fp8) if self.device.type == "cuda" else peak
        self.grad_sync = self.sharding          # what the schedules call start_last_backward() on
        self.params = [p for c in self.chunks for p in c.parameters() if p.requires_grad]
        self.state = TrainState()
        self.consecutive_skipped = 0     # optimizer steps skipped in a row (non-finite)
        self.step_hooks = list(step_hooks)
        self._compute_seconds = 0.0      # this rank's forward+backward time since the last log
        self._skipped_since_log = 0
        self._nan_since_log = 0          # of those, skipped for a NaN/inf (not an fp16 overflow)
        self._lr_increment = 1
        self._num_zeros = None
        # Mixture of experts: the same on every rank (the model config), so the reduction of the
        # router losses in log_record is called by all of them or none.
        self.has_moe = any(getattr(getattr(c, "config", None), "num_experts", None) is not None
                           for c in self.chunks)
        self._moe_sum = self._moe_losses = None
        self._cp_work = None        # the last step's causal pairs per ring rank (cp_log_fields)
        self._set_precision(job.precision, par.grad_reduce_in_bf16)

    def _set_precision(self, precision, grad_reduce_in_bf16: bool):
        """--fp16 (fp16 autocast over the fp32 weights) with its LossScaler, the FP8 context of
        --fp8-format (megatron_sp.training.fp8), entered around every forward, and
        --grad-reduce-in-bf16."""
        from megatron_sp.training import fp8
        self.loss_scaler = LossScaler.from_config(precision)
        self.fp8_autocast = fp8.fp8_autocast_factory(precision, self.mesh)
        fp8.check_layers_enabled(precision, self.chunks)    # torchao: no silent bf16 run
        if grad_reduce_in_bf16:      # the replicated all-reduce or the distributed optimizer's
            if not hasattr(self.sharding, "reduce_dtype") and not isinstance(self.sharding, Replicated):
                raise ConfigError("--grad-reduce-in-bf16 with --use-torch-fsdp2: FSDP2 reduces "
                                  "gradients in bf16 under --bf16 already; drop the flag.")
            target = self.sharding.grad_sync if isinstance(self.sharding, Replicated) else self.sharding
            target.reduce_dtype = torch.bfloat16
        self._loss_scaler_state = None

    def set_global_batch_size(self, global_batch_size: int) -> None:
        """--rampup-batch-size: this step's global batch (whole micro-batches per dp rank)."""
        if global_batch_size == self.global_batch_size:
            return
        per_step = self.num_micro_batches and self.global_batch_size // self.num_micro_batches
        self.flops_per_step *= global_batch_size / self.global_batch_size
        self.global_batch_size = global_batch_size
        self.num_micro_batches = global_batch_size // per_step

    def autocast(self):
        """The context of every forward: bf16 / fp16 autocast, inside --fp8-format's fp8_autocast."""
        dtype = self.job.precision.autocast_dtype
        cast = (torch.autocast(device_type=self.device.type, dtype=dtype) if dtype is not None
                else contextlib.nullcontext())
        if self.fp8_autocast is None:
            return cast
        stack = contextlib.ExitStack()
        stack.enter_context(cast)
        stack.enter_context(self.fp8_autocast())
        return stack

    def _loss_scale(self) -> float:
        """The loss scale of this step (1 without --fp16). A checkpoint load replaces
        state.loss_scaler with the saved dict: the scaler adopts it here."""
        if self.loss_scaler is None:
            return 1.0
        saved = self.state.loss_scaler
        if saved is not None and saved is not self._loss_scaler_state:
            self.loss_scaler.load_state_dict(saved)
        return self.loss_scaler.scale

    def _count_tokens(self, micro_batches) -> torch.Tensor:
        """Unmasked tokens of the global batch: this dp rank's micro-batches summed over dp."""
        count = sum(mb["loss_mask"].sum() for mb in micro_batches).double().reshape(()).to(self.device)
        all_reduce_sum(count, self.mesh.dp_group)
        return count.clamp(min=1.0)

    def _to_device(self, micro_batches):
        return [{k: v.to(self.device, non_blocking=True) for k, v in mb.items()} for mb in micro_batches]

    def train_step(self, micro_batches) -> StepResult:
        """One global batch. Raises NonFiniteLossError (policy stop) or CollectiveFailure."""
        iteration = self.state.iteration + 1
        try:
            return self._train_step(micro_batches, iteration)
        except NonFiniteLossError:
            raise
        except Terminated as err:     # the launcher's SIGTERM: said with where it stopped
            err.where = err.where or f"iteration {iteration}"
            raise
        except Exception as err:
            if not is_collective_failure(err):
                raise
            raise self._collective_failure(err, f"iteration {iteration}") from err

    def _collective_failure(self, err: BaseException, where: str) -> CollectiveFailure:
        minutes = self.job.parallel.distributed_timeout_minutes
        timeout = f"{minutes:g} min" if minutes is not None else "the process-group timeout"
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return CollectiveFailure(
            f"rank {self.mesh.rank}: a collective failed at {where}: another rank "
            f"has probably died or hung (collectives give up after {timeout}, "
            f"--distributed-timeout-minutes); look for the first failing rank in the job log. "
            f"Cause: {type(err).__name__}: {first_line}")

    def _train_step(self, micro_batches, iteration: int) -> StepResult:
        micro_batches = self._to_device(micro_batches)
        for chunk in self.chunks:
            chunk.train()
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = self._count_tokens(micro_batches)
        self.sharding.begin_step(self.num_micro_batches)
        scale = self._loss_scale()      # --fp16: the loss (so every gradient) times the scale
        start = time.perf_counter()
        hooks = [h for hook in self.step_hooks for h in hook.before_forward(iteration, self.chunks)]
        hooks += self._moe_begin_step()
        self._take_cp_work()            # forgets what evaluation counted
        try:
            loss = self.schedule(self.chunks, micro_batches, self.mesh,
                                 num_tokens=num_tokens.float() / scale,
                                 grad_sync=self.grad_sync, autocast=self.autocast)
        finally:
            for hook in hooks:
                hook.remove()
        self._cp_work = self._take_cp_work()
        if self._moe_sum is not None:     # the step's router losses, mean over its micro-batches
            self._moe_losses = self._moe_sum / self.num_micro_batches
        for hook in self.step_hooks:
            hook.after_compute(iteration, evaluating=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._compute_seconds += time.perf_counter() - start
        self.sharding.finish()
        if self.loss_scaler is not None:
            self.loss_scaler.unscale_(self.params)
        if self.job.logging.log_num_zeros_in_grad:
            self._num_zeros = model_parallel_sum(self.params, _zeros_in_grad, self.mesh)
        grad_norm = self.sharding.clip_grad_norm(self.job.training.clip_grad)
        # Reduced over every rank before deciding, so every rank takes the same branch.
        loss = reduce_loss_and_count(loss.to(self.device), self.mesh).item() / scale
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        overflow = self._update_loss_scale(math.isfinite(grad_norm)) and math.isfinite(loss)
        if not finite and not overflow and self.job.training.nonfinite_loss == "stop":
            raise NonFiniteLossError(
                f"iteration {iteration}: non-finite {describe_nonfinite(loss, grad_norm)}: "
                f"stopping (--nonfinite-loss stop); resume from the last checkpoint with a lower "
                f"--lr, or --nonfinite-loss skip skips such optimizer steps instead.")
        if finite:
            self.optimizer.step()
            self._lr_increment = self.global_batch_size if self.job.training.counts_samples else 1
            self.scheduler.step(self._lr_increment)
            self.consecutive_skipped = 0
        elif overflow:   # --fp16: the scale backs off; the step is only counted, as in Megatron
            self.optimizer.zero_grad(set_to_none=True)
            self.state.skipped_iterations += 1
            self._skipped_since_log += 1
        else:
            self._skip_step(iteration, loss, grad_norm)
        self.state.iteration += 1
        self.state.consumed_train_samples += self.global_batch_size
        return StepResult(loss=loss, grad_norm=grad_norm, num_tokens=int(num_tokens.item()),
                          skipped=not finite, loss_scale=self._loss_scale())

    def _moe_begin_step(self) -> list:
        """Mixture of experts: the router losses' gradient 1 / (micro-batches x dp), so that they
        are averaged over the micro-batches and the data-parallel replicas as Megatron averages
        them (the gradients are summed over dp; the LM loss is already normalised by the global
        batch's tokens); and a forward hook on every chunk that adds up the router losses of
        each micro-batch (summed over the chunk's MoE layers, no host sync). Returns the hooks'
        handles (none for a dense model)."""
        if not self.has_moe:
            return []
        scale = 1.0 / (self.num_micro_batches * self.mesh.dp_size)
        for chunk in self.chunks:
            if hasattr(chunk, "set_moe_aux_loss_scale"):
                chunk.set_moe_aux_loss_scale(scale)
        self._moe_sum = torch.zeros(2, dtype=torch.float64, device=self.device)
        return [chunk.register_forward_hook(self._add_router_losses) for chunk in self.chunks
                if hasattr(chunk, "moe_layers")]

    def _add_router_losses(self, chunk, inputs, output) -> None:
        """After a chunk's forward of one micro-batch: its MoE layers' load-balancing and z losses
        (the detached values GPTModel.moe_router_losses reads, kept as tensors) into the sum."""
        for mlp in chunk.moe_layers():
            aux = getattr(mlp, "last_aux", None)
            if aux is not None:
                values = torch.stack([aux["load_balancing_loss"].reshape(()).double(),
                                      aux["z_loss"].reshape(()).double()])
                self._moe_sum += values.to(self._moe_sum.device)

    def moe_log_fields(self) -> dict:
        """The last step's router losses for the log line and the metrics ({} for a dense model):
        the mean over the model's MoE layers (as Megatron logs them; summed across the pipeline
        stages, each holding its own layers, then divided by their number), averaged over the
        step's micro-batches and over the data-parallel replicas.
        Within a context group (sp x cp) every rank has the same values already (the router
        statistics are reduced over whole sequences). Collective over dp and pp: every rank
        calls it at the same iteration (log_record does)."""
        if not self.has_moe or self._moe_losses is None:
            return {}
        values = self._moe_losses.clone()
        all_reduce_sum(values, self.mesh.dp_group)
        values /= self.mesh.dp_size
        all_reduce_sum(values, self.mesh.pp_group, "pp/all_reduce")
        config = next(c.config for c in self.chunks if getattr(c, "config", None) is not None)
        values /= max(1, sum(config.is_moe_layer(i) for i in range(config.num_layers)))
        lb, z = values.tolist()
        return {"load_balancing_loss": lb, "z_loss": z}

    def _take_cp_work(self) -> list[int] | None:
        """The step's causal (query, key) pairs per ring rank, summed over its micro-batches
        (GPTModel.take_cp_work of the first chunk that counted; every chunk is reset)."""
        found = None
        for chunk in self.chunks:
            work = chunk.take_cp_work() if hasattr(chunk, "take_cp_work") else None
            found = found if found is not None else work
        return found

    def cp_log_fields(self) -> dict:
        """cp_work_balance of the last step ({} without packed documents under a ring): the max
        over ring ranks of the step's causal attention (query, key) pairs divided by their mean
        (context_parallel/balance.py), the worst data-parallel replica's. Collective over dp:
        every rank calls it at the same iteration (log_record does)."""
        work = self._cp_work
        if work is None:
            return {}
        rows = torch.zeros(self.mesh.dp_size, len(work), dtype=torch.float64, device=self.device)
        rows[self.mesh.dp_rank] = torch.tensor(work, dtype=torch.float64)
        all_reduce_sum(rows, self.mesh.dp_group)             # [dp, cp]: every replica's ranks
        return {"cp_work_balance": max(work_balance(row) for row in rows.tolist())}

    def _update_loss_scale(self, grads_finite: bool) -> bool:
        """--fp16: update the scaler from this step's overflow; True when the step overflowed."""
        if self.loss_scaler is None:
            return False
        self.loss_scaler.update(not grads_finite)
        self.state.loss_scaler = self._loss_scaler_state = self.loss_scaler.state_dict()
        return not grads_finite

    def _skip_step(self, iteration: int, loss: float, grad_norm: float):
        """--nonfinite-loss skip: no optimizer step; NonFiniteLossError after max_skipped_steps in a
        row (nothing is updated, and pretrain_gpt saves nothing, from the first of them on)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.state.skipped_iterations += 1
        self._skipped_since_log += 1
        self._nan_since_log += 1
        self.consecutive_skipped += 1
        what, n = describe_nonfinite(loss, grad_norm), self.consecutive_skipped
        print_rank0(self.mesh, f"iteration {iteration}: non-finite {what}: optimizer step skipped "
                               f"(--nonfinite-loss skip; {n} in a row, the run stops at "
                               f"--max-skipped-steps {self.job.training.max_skipped_steps}; "
                               f"{self.state.skipped_iterations} skipped in total)")
        if n >= self.job.training.max_skipped_steps:
            first = iteration - n + 1
            raise NonFiniteLossError(
                f"iterations {first}-{iteration}: {n} optimizer steps in a row were skipped for a "
                f"non-finite loss or gradient norm (last: {what}; --max-skipped-steps "
                f"{self.job.training.max_skipped_steps}), so the run has diverged: stopping with nothing saved "
                f"after iteration {first - 1}; resume from the last checkpoint with a lower --lr.")

    def evaluate(self, micro_batch_iter, num_steps: int) -> float:
        """Mean loss over num_steps global batches; raises CollectiveFailure as train_step does."""
        try:
            return self._evaluate(micro_batch_iter, num_steps)
        except Terminated as err:
            err.where = err.where or f"the evaluation after iteration {self.state.iteration}"
            raise
        except Exception as err:
            if not is_collective_failure(err):
                raise
            raise self._collective_failure(err, f"the evaluation after iteration "
                                                f"{self.state.iteration}") from err

    @torch.no_grad()
    def _evaluate(self, micro_batch_iter, num_steps: int) -> float:
        """Mean loss over num_steps global batches, under the same layout (no gather)."""
        for chunk in self.chunks:
            chunk.eval()
        total, tokens = 0.0, 0.0
        for _ in range(num_steps):
            mbs = self._to_device([next(micro_batch_iter) for _ in range(self.num_micro_batches)])
            num_tokens = self._count_tokens(mbs)
            loss = self.schedule(self.chunks, mbs, self.mesh, num_tokens=num_tokens.float(),
                                 autocast=self.autocast, forward_only=True)
            for hook in self.step_hooks:
                hook.after_compute(self.state.iteration, evaluating=True)
            loss = reduce_loss_and_count(loss.to(self.device), self.mesh)
            total += loss.item() * num_tokens.item()
            tokens += num_tokens.item()
            self.state.consumed_valid_samples += self.global_batch_size
        return total / max(tokens, 1.0)

    def log_record(self, result: StepResult, elapsed: float, iters: int) -> dict:
        ms = 1000.0 * elapsed / iters
        tokens_per_sec = self.global_batch_size * self.seq_length * iters / elapsed
        tflops = self.flops_per_step * iters / elapsed / self.mesh.world_size / 1e12
        record = {"iteration": self.state.iteration,
                  "consumed_samples": self.state.consumed_train_samples,
                  "lr": self.scheduler.lr_at(self.scheduler.num_steps - self._lr_increment)
                  if self.scheduler.num_steps else 0.0,
                  "global_batch_size": self.global_batch_size,
                  "lm_loss": result.loss, "grad_norm": result.grad_norm, "ms_per_iter": ms,
                  "tokens_per_sec": tokens_per_sec, "tflops_per_gpu": tflops,
                  "loss_scale": result.loss_scale}
        record.update(self.moe_log_fields())
        record.update(self.cp_log_fields())
        for group in self.optimizer.param_groups:    # --decoupled-lr: Megatron logs it too
            if group.get("is_decoupled_lr") and self.scheduler.num_steps:
                record["decoupled_lr"] = self.scheduler.lr_at(self.scheduler.num_steps - self._lr_increment,
                                                              group["max_lr"], group.get("min_lr"))
        if self.job.logging.log_num_zeros_in_grad and self._num_zeros is not None:
            record["num_zeros"] = int(self._num_zeros)
        if self.job.logging.log_params_norm:
            record["params_norm"] = math.sqrt(model_parallel_sum(self.params, _square_sum, self.mesh))
        if self.peak_tflops:
            record["mfu"] = tflops / self.peak_tflops
        record.update(memory_report(self.device))
        for kind, nbytes in comm_stats.snapshot().items():
            record[f"bytes/{kind}"] = nbytes / iters
        record["skipped_iterations"] = self._skipped_since_log
        record["nan_iterations"] = self._nan_since_log
        record["skipped_iterations_total"] = self.state.skipped_iterations
        self._skipped_since_log = self._nan_since_log = 0
        record.update(self.straggler_report(iters))
        return record

    def straggler_report(self, iters: int) -> dict:
        """Every rank's forward+backward ms/iter since the last log -> slowest and fastest rank.

        Collective over the world: every rank calls it at the same iteration (log_record does).
        The time excludes the wait for the gradient reduction, so with dp the slow rank stands out.
        """
        ms = 1000.0 * self._compute_seconds / max(iters, 1)
        self._compute_seconds = 0.0
        if self.mesh.world_size == 1:
            return {}
        times = gather_step_times(ms, self.device if self.device.type == "cuda" else None)
        slow = max(range(len(times)), key=times.__getitem__)
        fast = min(range(len(times)), key=times.__getitem__)
        return {"straggler_rank": slow, "straggler_ms": times[slow],
                "fastest_rank": fast, "fastest_ms": times[fast]}


def _zeros_in_grad(p) -> torch.Tensor:
    return (p.grad == 0).sum().double() if p.grad is not None else torch.zeros((), dtype=torch.float64)


def _square_sum(p) -> torch.Tensor:
    return p.detach().double().pow(2).sum()
