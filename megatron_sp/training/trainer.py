"""The training loop: micro-batches -> global batch step, evaluation, logging.

One step: count the global batch's unmasked tokens (summed over dp), run the schedule
(gradient accumulation, or a pipeline schedule), finish the gradient reduction over dp x sp,
clip to the global norm, step AdamW and the LR schedule (under --fp16 the loss is scaled first and
the gradients unscaled before the norm; an overflow skips the step and backs the scale off,
megatron_sp.loss_scaler), then log every --log-interval:
iteration, consumed samples, lr, lm loss, grad norm, ms/iter, tokens/s, TFLOP/s, MFU, memory,
skipped iterations and the straggler report (slowest rank's forward+backward time and its rank).

Failures (issue 9):
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
- test-only fault injection through environment variables (read once, at construction):
  MEGATRON_SP_INJECT_NAN_AT_ITER=3[,5]   the loss (and so every gradient) becomes NaN at those
                                         iterations on rank MEGATRON_SP_INJECT_RANK (default 0);
                                         "3-12" is a range
  MEGATRON_SP_INJECT_INF_GRAD_AT_ITER=3  one gradient becomes inf (the loss stays finite)
  MEGATRON_SP_INJECT_KILL_AT_ITER=3      that rank sends itself MEGATRON_SP_INJECT_SIGNAL (KILL,
                                         or STOP for a hang) after its forward+backward
  MEGATRON_SP_INJECT_KILL_IN_EVAL_AT_ITER=4  the same during the evaluation after iteration 4
  MEGATRON_SP_INJECT_SLEEP_MS=200        that rank sleeps so long every step (a straggler)
"""
from __future__ import annotations

import contextlib
import json
import os
import math
import resource
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_sp import comm_stats
from megatron_sp.errors import ConfigError, UserError
from megatron_sp.flops import device_peak_tflops
from megatron_sp.grad_sync import (all_reduce_sum, gather_step_times, model_parallel_sum,
                                   reduce_loss_and_count)
from megatron_sp.sharding import Replicated
from megatron_sp.schedules import forward_backward_no_pipelining


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


NONFINITE_POLICIES = ("skip", "stop")


class NonFiniteLossError(UserError, RuntimeError):
    """The loss or gradient norm was NaN/inf and --nonfinite-loss is stop (or too many skips)."""


class CollectiveFailure(UserError, RuntimeError):
    """A collective failed during a step: another rank died, hung past the timeout, or vanished."""
    same_on_every_rank = False      # each rank says what it saw, with its rank
    consequence = True              # quiet when the rank that caused it reported its own error


_COMM_ERROR_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe",
                       "timed out", "timeout", "socket", "peer")


def is_collective_failure(err: BaseException) -> bool:
    """True for the errors torch.distributed raises when a peer dies or a collective times out."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = f"{type(err).__name__}: {err}".lower()
    return isinstance(err, RuntimeError) and any(m in text for m in _COMM_ERROR_MARKERS)


class FaultInjection:
    """Test-only faults from MEGATRON_SP_INJECT_* (see the module docstring); inert when unset."""

    def __init__(self, rank: int, environ=os.environ):
        def ints(name):
            out = set()
            for x in environ.get(name, "").replace(" ", "").split(","):
                lo, _, hi = x.partition("-")
                out.update(range(int(lo), int(hi or lo) + 1) if x else ())
            return out
        target = int(environ.get("MEGATRON_SP_INJECT_RANK", "0"))
        mine = rank == target
        self.nan_iters = ints("MEGATRON_SP_INJECT_NAN_AT_ITER") if mine else set()
        self.inf_grad_iters = ints("MEGATRON_SP_INJECT_INF_GRAD_AT_ITER") if mine else set()
        self.kill_iters = ints("MEGATRON_SP_INJECT_KILL_AT_ITER") if mine else set()
        self.eval_kill_iters = ints("MEGATRON_SP_INJECT_KILL_IN_EVAL_AT_ITER") if mine else set()
        self.signal = getattr(signal, "SIG" + environ.get("MEGATRON_SP_INJECT_SIGNAL", "KILL").upper())
        self.sleep_s = float(environ.get("MEGATRON_SP_INJECT_SLEEP_MS", "0")) / 1000 if mine else 0.0
        self.rank = rank

    def nan_hooks(self, iteration: int, chunks) -> list:
        """Forward hooks making the last chunk's output NaN (loss, then every gradient, follow);
        or a gradient hook making one parameter's gradient inf (the loss stays finite)."""
        hooks = []
        if iteration in self.nan_iters:
            def poison(module, inputs, output):
                return output * float("nan") if torch.is_tensor(output) else output
            hooks.append(chunks[-1].register_forward_hook(poison))
        if iteration in self.inf_grad_iters:
            param = next(p for p in chunks[-1].parameters() if p.requires_grad)
            hooks.append(param.register_hook(lambda grad: torch.full_like(grad, float("inf"))))
        return hooks

    def after_compute(self, iteration: int, evaluating: bool = False):
        if self.sleep_s and not evaluating:
            time.sleep(self.sleep_s)
        if iteration in (self.eval_kill_iters if evaluating else self.kill_iters):
            print(f"[fault injection] rank {self.rank} sends itself {self.signal.name} "
                  f"{'in the evaluation after' if evaluating else 'at'} iteration {iteration} "
                  f"(t={time.time():.3f})", file=sys.stderr, flush=True)
            os.kill(os.getpid(), self.signal)


def describe_nonfinite(loss: float, grad_norm: float) -> str:
    """Which of the (reduced) loss and gradient norm is non-finite, e.g. "gradient norm inf (the
    loss 6.24 is finite)"."""
    bad_loss, bad_norm = not math.isfinite(loss), not math.isfinite(grad_norm)
    if bad_loss and bad_norm:
        return f"loss {loss} and gradient norm {grad_norm}"
    if bad_loss:
        return f"loss {loss} (the gradient norm {grad_norm:.4g} is finite)"
    return f"gradient norm {grad_norm} (the loss {loss:.4g} is finite)"


def is_logging_rank(mesh) -> bool:
    return mesh.rank == 0


def print_rank0(mesh, *msg):
    if is_logging_rank(mesh):
        print(*msg, flush=True)


def memory_report(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"mem_allocated_gb": torch.cuda.memory_allocated() / 2**30,
                "mem_peak_gb": torch.cuda.max_memory_allocated() / 2**30}
    return {"host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _records_up_to(path: str, iteration: int) -> list[str]:
    """The lines of a metrics jsonl whose iteration is <= `iteration` (all others dropped)."""
    if not os.path.isfile(path):
        return []
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line).get("iteration", 0) <= iteration:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (json.JSONDecodeError, AttributeError):
                continue                  # a line cut short by a crash
    return kept


def _start_wandb(options: dict):
    """A wandb run, or None with one sentence when wandb is not installed."""
    try:
        import wandb
    except ImportError:
        print(f"warning: --wandb-project {options['project']} is ignored: wandb is not installed "
              f"(pip install wandb); metrics still go to stdout, --metrics-jsonl and TensorBoard.",
              file=sys.stderr, flush=True)
        return None
    if options.get("dir"):
        os.makedirs(options["dir"], exist_ok=True)
    return wandb.init(**{k: v for k, v in options.items() if v is not None})


class MetricsWriter:
    """--metrics-jsonl (one JSON object per logged iteration) and TensorBoard, on rank 0 only."""

    def __init__(self, mesh, jsonl_path=None, tensorboard_dir=None, resume_iteration: int = 0,
                 wandb: dict | None = None):
        """A fresh run (resume_iteration 0) starts the jsonl anew; a resumed run continues its own
        file from the checkpoint's iteration (records written after that checkpoint are dropped).
        `wandb`: wandb.init's keyword arguments (--wandb-project, ...), used when wandb is installed."""
        self.file = self.tb = self.wandb = None
        if not is_logging_rank(mesh):
            return
        if wandb:
            self.wandb = _start_wandb(wandb)
        if jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            kept = _records_up_to(jsonl_path, resume_iteration) if resume_iteration > 0 else []
            self.file = open(jsonl_path, "w", buffering=1)
            self.file.writelines(kept)
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(log_dir=tensorboard_dir)
            except ImportError:
                print("warning: tensorboard is not installed; --tensorboard-dir ignored "
                      "(pip install tensorboard)", file=sys.stderr, flush=True)

    def write(self, record: dict):
        if self.file:   # JSON has no NaN/inf: a non-finite number is written as null
            finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                      for k, v in record.items()}
            self.file.write(json.dumps(finite, allow_nan=False) + "\n")
        if self.tb:
            step = record["iteration"]
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb:
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))},
                           step=record["iteration"])

    def close(self):
        if self.wandb:
            self.wandb.finish()
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()


class Trainer:
    """Runs steps for a list of model chunks (one unless interleaved pipelining) on one mesh."""

    def __init__(self, model_chunks, optimizer, scheduler, mesh, *, global_batch_size: int,
                 micro_batch_size: int, seq_length: int, clip_grad: float = 1.0, bf16: bool = False,
                 schedule=None, flops_per_step: float = 0.0, peak_tflops: float | None = None,
                 bucket_mb: float = 25.0, nonfinite_loss: str = "stop",
                 collective_timeout_minutes: float | None = None, max_skipped_steps: int = 10,
                 sharding=None):
        self.chunks = list(model_chunks)
        self.optimizer, self.scheduler, self.mesh = optimizer, scheduler, mesh
        per_step = micro_batch_size * mesh.dp_size
        if global_batch_size % per_step:
            raise ConfigError(
                f"--global-batch-size {global_batch_size} is not divisible by micro-batch size x dp "
                f"= {micro_batch_size} x {mesh.dp_size}: choose a multiple of {per_step}.")
        self.num_micro_batches = global_batch_size // per_step
        self.global_batch_size, self.seq_length = global_batch_size, seq_length
        self.clip_grad, self.bf16 = clip_grad, bf16
        self.schedule = schedule or forward_backward_no_pipelining
        self.flops_per_step = flops_per_step
        # The seam of sharded model state (megatron_sp.sharding): the object that owns gradient
        # reduction, norm and clipping: FSDP2's, the distributed optimizer, or replicated state.
        self.sharding = sharding or Replicated(self.chunks, mesh, bucket_mb=bucket_mb)
        self.device = self.sharding.device
        self.peak_tflops = device_peak_tflops(peak_tflops) if self.device.type == "cuda" else peak_tflops
        self.grad_sync = self.sharding          # what the schedules call start_last_backward() on
        self.params = [p for c in self.chunks for p in c.parameters() if p.requires_grad]
        self.state = TrainState()
        self.consecutive_skipped = 0     # optimizer steps skipped in a row (non-finite)
        self.set_failure_policy(nonfinite_loss, collective_timeout_minutes, max_skipped_steps)
        self.faults = FaultInjection(mesh.rank)
        self._compute_seconds = 0.0      # this rank's forward+backward time since the last log
        self._skipped_since_log = 0
        self._nan_since_log = 0          # of those, skipped for a NaN/inf (not an fp16 overflow)
        self.lr_in_samples = False       # Megatron's sample-counted schedule (megatron_sp.rampup)
        self._lr_increment = 1
        self.log_params_norm = self.log_num_zeros_in_grad = False   # --log-params-norm, ...
        self._num_zeros = None
        self.set_precision()

    def set_precision(self, fp16: bool = False, loss_scaler=None, fp8_autocast=None,
                      grad_reduce_in_bf16: bool = False):
        """--fp16 (fp16 autocast over the fp32 weights) with its LossScaler, the FP8 context of
        --fp8-format (megatron_sp.fp8), entered around every forward, and --grad-reduce-in-bf16."""
        self.fp16, self.loss_scaler, self.fp8_autocast = fp16, loss_scaler, fp8_autocast
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

    def set_failure_policy(self, nonfinite_loss: str = "stop",
                           collective_timeout_minutes: float | None = None,
                           max_skipped_steps: int = 10):
        """--nonfinite-loss skip|stop, --max-skipped-steps, and the collective timeout named in
        CollectiveFailure."""
        if nonfinite_loss not in NONFINITE_POLICIES:
            raise ValueError(f"--nonfinite-loss {nonfinite_loss!r} is not one of {NONFINITE_POLICIES}.")
        if max_skipped_steps < 1:
            raise ConfigError(f"--max-skipped-steps must be at least 1, got {max_skipped_steps}.")
        self.nonfinite_loss, self.max_skipped_steps = nonfinite_loss, max_skipped_steps
        self.collective_timeout_minutes = collective_timeout_minutes

    def autocast(self):
        """The context of every forward: bf16 / fp16 autocast, inside --fp8-format's fp8_autocast."""
        dtype = torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else None
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
        except Exception as err:
            if not is_collective_failure(err):
                raise
            raise self._collective_failure(err, f"iteration {iteration}") from err

    def _collective_failure(self, err: BaseException, where: str) -> CollectiveFailure:
        timeout = (f"{self.collective_timeout_minutes:g} min" if self.collective_timeout_minutes
                   is not None else "the process-group timeout")
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
        hooks = self.faults.nan_hooks(iteration, self.chunks)
        try:
            loss = self.schedule(self.chunks, micro_batches, self.mesh,
                                 num_tokens=num_tokens.float() / scale,
                                 grad_sync=self.grad_sync, autocast=self.autocast)
        finally:
            for hook in hooks:
                hook.remove()
        self.faults.after_compute(iteration)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._compute_seconds += time.perf_counter() - start
        self.sharding.finish()
        if self.loss_scaler is not None:
            self.loss_scaler.unscale_(self.params)
        if self.log_num_zeros_in_grad:
            self._num_zeros = model_parallel_sum(self.params, _zeros_in_grad, self.mesh)
        grad_norm = self.sharding.clip_grad_norm(self.clip_grad)
        # Reduced over every rank before deciding, so every rank takes the same branch.
        loss = reduce_loss_and_count(loss.to(self.device), self.mesh).item() / scale
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        overflow = self._update_loss_scale(math.isfinite(grad_norm)) and math.isfinite(loss)
        if not finite and not overflow and self.nonfinite_loss == "stop":
            raise NonFiniteLossError(
                f"iteration {iteration}: non-finite {describe_nonfinite(loss, grad_norm)}: "
                f"stopping (--nonfinite-loss stop); resume from the last checkpoint with a lower "
                f"--lr, or --nonfinite-loss skip skips such optimizer steps instead.")
        if finite:
            self.optimizer.step()
            self._lr_increment = self.global_batch_size if self.lr_in_samples else 1
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
                               f"--max-skipped-steps {self.max_skipped_steps}; "
                               f"{self.state.skipped_iterations} skipped in total)")
        if n >= self.max_skipped_steps:
            first = iteration - n + 1
            raise NonFiniteLossError(
                f"iterations {first}-{iteration}: {n} optimizer steps in a row were skipped for a "
                f"non-finite loss or gradient norm (last: {what}; --max-skipped-steps "
                f"{self.max_skipped_steps}), so the run has diverged: stopping with nothing saved "
                f"after iteration {first - 1}; resume from the last checkpoint with a lower --lr.")

    def evaluate(self, micro_batch_iter, num_steps: int) -> float:
        """Mean loss over num_steps global batches; raises CollectiveFailure as train_step does."""
        try:
            return self._evaluate(micro_batch_iter, num_steps)
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
            self.faults.after_compute(self.state.iteration, evaluating=True)
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
        for group in self.optimizer.param_groups:    # --decoupled-lr: Megatron logs it too
            if group.get("is_decoupled_lr") and self.scheduler.num_steps:
                record["decoupled_lr"] = self.scheduler.lr_at(self.scheduler.num_steps - self._lr_increment,
                                                              group["max_lr"], group.get("min_lr"))
        if self.log_num_zeros_in_grad and self._num_zeros is not None:
            record["num_zeros"] = int(self._num_zeros)
        if self.log_params_norm:
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


def _fixed(value: float, significant: int = 3) -> str:
    """Fixed-point (never 1e-05: scrapers read [0-9.]+) with `significant` digits, at least one
    decimal: 312.4, 0.0123, 0.000457 (TFLOP/s on a CPU is small but not zero)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:.1f}"
    decimals = max(1, significant - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def _zeros_in_grad(p) -> torch.Tensor:
    return (p.grad == 0).sum().double() if p.grad is not None else torch.zeros((), dtype=torch.float64)


def _square_sum(p) -> torch.Tensor:
    return p.detach().double().pow(2).sum()


def format_log_line(record: dict, train_iters: int) -> str:
    """Megatron-LM's log line (its field names and order, so its scrapers work), ours after it:

     iteration N/M | consumed samples: | elapsed time per iteration (ms): | throughput per GPU
     (TFLOP/s/GPU): | learning rate: | global batch size: | lm loss: | loss scale: | grad norm: |
     [num zeros: | params norm: |] number of skipped iterations: | number of nan iterations: | ...
    """
    parts = [f" iteration {record['iteration']:8d}/{train_iters:8d}",
             f"consumed samples: {record['consumed_samples']:12d}",
             f"elapsed time per iteration (ms): {record['ms_per_iter']:.1f}",
             f"throughput per GPU (TFLOP/s/GPU): {_fixed(record['tflops_per_gpu'])}",
             f"learning rate: {record['lr']:.6E}",
             f"global batch size: {record.get('global_batch_size', 0):5d}",
             f"lm loss: {record['lm_loss']:.6E}",
             f"loss scale: {record.get('loss_scale', 1.0):.1f}",
             f"grad norm: {record['grad_norm']:.3f}"]
    if "num_zeros" in record:
        parts.append(f"num zeros: {record['num_zeros']:.1f}")
    if "params_norm" in record:
        parts.append(f"params norm: {record['params_norm']:.3f}")
    parts += [f"number of skipped iterations: {record.get('skipped_iterations', 0):3d}",
              f"number of nan iterations: {record.get('nan_iterations', 0):3d}",
              f"tokens/s: {record['tokens_per_sec']:.0f}"]
    if "mfu" in record:
        parts.append(f"MFU: {100 * record['mfu']:.1f}%")
    if "mem_peak_gb" in record:
        parts.append(f"mem peak (GB): {record['mem_peak_gb']:.2f}")
    elif "host_peak_rss_gb" in record:
        parts.append(f"host peak RSS (GB): {record['host_peak_rss_gb']:.2f}")
    if record.get("skipped_iterations_total"):
        parts.append(f"skipped iterations in total: {record['skipped_iterations_total']}")
    if "straggler_rank" in record:
        parts.append(f"slowest rank: {record['straggler_rank']} (fwd+bwd {record['straggler_ms']:.1f} "
                     f"ms/iter; fastest rank {record['fastest_rank']}: {record['fastest_ms']:.1f})")
    comm = [f"{k[6:]} {comm_stats.format_bytes(v)}" for k, v in record.items() if k.startswith("bytes/")]
    if comm:
        parts.append("comm/iter: " + ", ".join(comm))
    return " | ".join(parts) + " |"
