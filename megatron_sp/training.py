"""The training loop: micro-batches -> global batch step, evaluation, logging.

One step: count the global batch's unmasked tokens (summed over dp), run the schedule
(gradient accumulation, or a pipeline schedule), finish the gradient reduction over dp x sp,
clip to the global norm, step AdamW and the LR schedule, then log every --log-interval:
iteration, consumed samples, lr, lm loss, grad norm, ms/iter, tokens/s, TFLOP/s, MFU, memory,
skipped iterations and the straggler report (slowest rank's forward+backward time and its rank).

Failures (issue 9):
- a NaN or inf loss (or gradient norm) is reported with its iteration; `nonfinite_loss="skip"`
  drops that optimizer step (Megatron-like: the LR schedule does not advance, the iteration and
  its samples are counted, the log counts skipped iterations), `"stop"` raises NonFiniteLossError.
  The decision is the same on every rank: loss and norm are reduced over every rank first.
- a collective that fails because another rank died or hung (gloo/NCCL error, or the
  --distributed-timeout-minutes timeout) is re-raised as CollectiveFailure naming the rank, the
  iteration and the timeout, never left as a hang.
- test-only fault injection through environment variables (read once, at construction):
  MEGATRON_SP_INJECT_NAN_AT_ITER=3[,5]   the loss (and so every gradient) becomes NaN at those
                                         iterations on rank MEGATRON_SP_INJECT_RANK (default 0)
  MEGATRON_SP_INJECT_KILL_AT_ITER=3      that rank sends itself MEGATRON_SP_INJECT_SIGNAL (KILL,
                                         or STOP for a hang) after its forward+backward
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
from megatron_sp.flops import device_peak_tflops
from megatron_sp.grad_sync import (GradientSync, all_reduce_sum, clip_grad_norm, gather_step_times,
                                   reduce_loss_and_count)
from megatron_sp.schedules import forward_backward_no_pipelining


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0     # validation position, stored so resume continues there
    skipped_iterations: int = 0


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    num_tokens: int
    skipped: bool = False


NONFINITE_POLICIES = ("skip", "stop")


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm was NaN/inf and --nonfinite-loss is stop."""


class CollectiveFailure(RuntimeError):
    """A collective failed during a step: another rank died, hung past the timeout, or vanished."""


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
            return {int(x) for x in environ.get(name, "").replace(" ", "").split(",") if x}
        target = int(environ.get("MEGATRON_SP_INJECT_RANK", "0"))
        mine = rank == target
        self.nan_iters = ints("MEGATRON_SP_INJECT_NAN_AT_ITER") if mine else set()
        self.kill_iters = ints("MEGATRON_SP_INJECT_KILL_AT_ITER") if mine else set()
        self.signal = getattr(signal, "SIG" + environ.get("MEGATRON_SP_INJECT_SIGNAL", "KILL").upper())
        self.sleep_s = float(environ.get("MEGATRON_SP_INJECT_SLEEP_MS", "0")) / 1000 if mine else 0.0
        self.rank = rank

    def nan_hooks(self, iteration: int, chunks) -> list:
        """Forward hooks making the last chunk's output NaN (loss, then every gradient, follow)."""
        if iteration not in self.nan_iters:
            return []
        def poison(module, inputs, output):
            return output * float("nan") if torch.is_tensor(output) else output
        return [chunks[-1].register_forward_hook(poison)]

    def after_compute(self, iteration: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if iteration in self.kill_iters:
            print(f"[fault injection] rank {self.rank} sends itself "
                  f"{self.signal.name} at iteration {iteration} (t={time.time():.3f})",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), self.signal)


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


class MetricsWriter:
    """--metrics-jsonl (one JSON object per logged iteration) and TensorBoard, on rank 0 only."""

    def __init__(self, mesh, jsonl_path=None, tensorboard_dir=None):
        self.file = self.tb = None
        if not is_logging_rank(mesh):
            return
        if jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            self.file = open(jsonl_path, "a", buffering=1)
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(log_dir=tensorboard_dir)
            except ImportError:
                print("warning: tensorboard is not installed; --tensorboard-dir ignored "
                      "(pip install tensorboard)", file=sys.stderr, flush=True)

    def write(self, record: dict):
        if self.file:
            self.file.write(json.dumps(record) + "\n")
        if self.tb:
            step = record["iteration"]
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, step)
            self.tb.flush()

    def close(self):
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
                 collective_timeout_minutes: float | None = None):
        self.chunks = list(model_chunks)
        self.optimizer, self.scheduler, self.mesh = optimizer, scheduler, mesh
        per_step = micro_batch_size * mesh.dp_size
        if global_batch_size % per_step:
            raise ValueError(
                f"--global-batch-size {global_batch_size} is not divisible by micro-batch size x dp "
                f"= {micro_batch_size} x {mesh.dp_size}: choose a multiple of {per_step}.")
        self.num_micro_batches = global_batch_size // per_step
        self.global_batch_size, self.seq_length = global_batch_size, seq_length
        self.clip_grad, self.bf16 = clip_grad, bf16
        self.schedule = schedule or forward_backward_no_pipelining
        self.flops_per_step = flops_per_step
        self.device = next(self.chunks[0].parameters()).device
        self.peak_tflops = device_peak_tflops(peak_tflops) if self.device.type == "cuda" else peak_tflops
        self.grad_sync = GradientSync(self.chunks, mesh, bucket_mb=bucket_mb)
        self.params = [p for c in self.chunks for p in c.parameters() if p.requires_grad]
        self.state = TrainState()
        self.set_failure_policy(nonfinite_loss, collective_timeout_minutes)
        self.faults = FaultInjection(mesh.rank)
        self._compute_seconds = 0.0      # this rank's forward+backward time since the last log
        self._skipped_since_log = 0

    def set_failure_policy(self, nonfinite_loss: str = "stop",
                           collective_timeout_minutes: float | None = None):
        """--nonfinite-loss skip|stop, and the collective timeout named in CollectiveFailure."""
        if nonfinite_loss not in NONFINITE_POLICIES:
            raise ValueError(f"--nonfinite-loss {nonfinite_loss!r} is not one of {NONFINITE_POLICIES}.")
        self.nonfinite_loss = nonfinite_loss
        self.collective_timeout_minutes = collective_timeout_minutes

    def autocast(self):
        if self.bf16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

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
            timeout = (f"{self.collective_timeout_minutes:g} min" if self.collective_timeout_minutes
                       is not None else "the process-group timeout")
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise CollectiveFailure(
                f"rank {self.mesh.rank}: a collective failed at iteration {iteration}: another rank "
                f"has probably died or hung (collectives give up after {timeout}, "
                f"--distributed-timeout-minutes); look for the first failing rank in the job log. "
                f"Cause: {type(err).__name__}: {first_line}") from err

    def _train_step(self, micro_batches, iteration: int) -> StepResult:
        micro_batches = self._to_device(micro_batches)
        for chunk in self.chunks:
            chunk.train()
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = self._count_tokens(micro_batches)
        start = time.perf_counter()
        hooks = self.faults.nan_hooks(iteration, self.chunks)
        try:
            loss = self.schedule(self.chunks, micro_batches, self.mesh, num_tokens=num_tokens.float(),
                                 grad_sync=self.grad_sync, autocast=self.autocast)
        finally:
            for hook in hooks:
                hook.remove()
        self.faults.after_compute(iteration)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._compute_seconds += time.perf_counter() - start
        self.grad_sync.finish()
        grad_norm = clip_grad_norm(self.params, self.clip_grad, self.mesh)
        # Reduced over every rank before deciding, so every rank takes the same branch.
        loss = reduce_loss_and_count(loss.to(self.device), self.mesh).item()
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if not finite and self.nonfinite_loss == "stop":
            raise NonFiniteLossError(
                f"iteration {iteration}: the loss is {loss} and the gradient norm {grad_norm}: "
                f"stopping (--nonfinite-loss stop); --nonfinite-loss skip skips such optimizer steps "
                f"instead.")
        if finite:
            self.optimizer.step()
            self.scheduler.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.state.skipped_iterations += 1
            self._skipped_since_log += 1
            print_rank0(self.mesh, f"iteration {iteration}: non-finite loss {loss} / gradient norm "
                                   f"{grad_norm}: optimizer step skipped (--nonfinite-loss skip; "
                                   f"{self.state.skipped_iterations} skipped so far)")
        self.state.iteration += 1
        self.state.consumed_train_samples += self.global_batch_size
        return StepResult(loss=loss, grad_norm=grad_norm, num_tokens=int(num_tokens.item()),
                          skipped=not finite)

    @torch.no_grad()
    def evaluate(self, micro_batch_iter, num_steps: int) -> float:
        """Mean loss over num_steps global batches, under the same layout (no gather)."""
        for chunk in self.chunks:
            chunk.eval()
        total, tokens = 0.0, 0.0
        for _ in range(num_steps):
            mbs = self._to_device([next(micro_batch_iter) for _ in range(self.num_micro_batches)])
            num_tokens = self._count_tokens(mbs)
            loss = self.schedule(self.chunks, mbs, self.mesh, num_tokens=num_tokens.float(),
                                 autocast=self.autocast, forward_only=True)
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
                  "lr": self.scheduler.lr_at(self.scheduler.num_steps - 1) if self.scheduler.num_steps
                  else 0.0,
                  "lm_loss": result.loss, "grad_norm": result.grad_norm, "ms_per_iter": ms,
                  "tokens_per_sec": tokens_per_sec, "tflops_per_gpu": tflops}
        if self.peak_tflops:
            record["mfu"] = tflops / self.peak_tflops
        record.update(memory_report(self.device))
        for kind, nbytes in comm_stats.snapshot().items():
            record[f"bytes/{kind}"] = nbytes / iters
        record["skipped_iterations"] = self._skipped_since_log
        record["skipped_iterations_total"] = self.state.skipped_iterations
        self._skipped_since_log = 0
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


def _format_tflops(tflops: float) -> str:
    """Two decimals on a GPU; three significant digits below 1 TFLOP/s (a CPU: 0.0123, not 0.00)."""
    return f"{tflops:.2f}" if tflops >= 1 else f"{tflops:.3g}"


def format_log_line(record: dict, train_iters: int) -> str:
    parts = [f"iteration {record['iteration']:8d}/{train_iters:8d}",
             f"consumed samples: {record['consumed_samples']:10d}",
             f"elapsed time per iteration (ms): {record['ms_per_iter']:.1f}",
             f"learning rate: {record['lr']:.6E}",
             f"lm loss: {record['lm_loss']:.6E}",
             f"grad norm: {record['grad_norm']:.3f}",
             f"tokens/s: {record['tokens_per_sec']:.0f}",
             f"TFLOP/s/GPU: {_format_tflops(record['tflops_per_gpu'])}"]
    if "mfu" in record:
        parts.append(f"MFU: {100 * record['mfu']:.1f}%")
    if "mem_peak_gb" in record:
        parts.append(f"mem peak (GB): {record['mem_peak_gb']:.2f}")
    elif "host_peak_rss_gb" in record:
        parts.append(f"host peak RSS (GB): {record['host_peak_rss_gb']:.2f}")
    if record.get("skipped_iterations_total"):
        parts.append(f"number of skipped iterations: {record['skipped_iterations']:3d} "
                     f"({record['skipped_iterations_total']} in total)")
    if "straggler_rank" in record:
        parts.append(f"slowest rank: {record['straggler_rank']} (fwd+bwd {record['straggler_ms']:.1f} "
                     f"ms/iter; fastest rank {record['fastest_rank']}: {record['fastest_ms']:.1f})")
    comm = [f"{k[6:]} {comm_stats.format_bytes(v)}" for k, v in record.items() if k.startswith("bytes/")]
    if comm:
        parts.append("comm/iter: " + ", ".join(comm))
    return " | ".join(parts)
