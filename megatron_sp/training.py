"""The training loop: micro-batches -> global batch step, evaluation, logging.

One step: count the global batch's unmasked tokens (summed over dp), run the schedule
(gradient accumulation, or a pipeline schedule), finish the gradient reduction over dp x sp,
clip to the global norm, step AdamW and the LR schedule, then log every --log-interval:
iteration, consumed samples, lr, lm loss, grad norm, ms/iter, tokens/s, TFLOP/s, MFU, memory.
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field

import torch

from megatron_sp import comm_stats
from megatron_sp.flops import device_peak_tflops
from megatron_sp.grad_sync import GradientSync, all_reduce_sum, clip_grad_norm, reduce_loss_and_count
from megatron_sp.schedules import forward_backward_no_pipelining


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_iterations: int = 0


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    num_tokens: int


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
                 bucket_mb: float = 25.0):
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
        micro_batches = self._to_device(micro_batches)
        for chunk in self.chunks:
            chunk.train()
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = self._count_tokens(micro_batches)
        loss = self.schedule(self.chunks, micro_batches, self.mesh, num_tokens=num_tokens.float(),
                             grad_sync=self.grad_sync, autocast=self.autocast)
        self.grad_sync.finish()
        grad_norm = clip_grad_norm(self.params, self.clip_grad, self.mesh)
        self.optimizer.step()
        self.scheduler.step()
        loss = reduce_loss_and_count(loss.to(self.device), self.mesh)
        self.state.iteration += 1
        self.state.consumed_train_samples += self.global_batch_size
        return StepResult(loss=loss.item(), grad_norm=grad_norm, num_tokens=int(num_tokens.item()))

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
        return total / max(tokens, 1.0)

    def log_record(self, result: StepResult, elapsed: float, iters: int) -> dict:
        ms = 1000.0 * elapsed / iters
        tokens_per_sec = self.global_batch_size * self.seq_length * iters / elapsed
        tflops = self.flops_per_step * iters / elapsed / self.mesh.world_size / 1e12
        record = {"iteration": self.state.iteration,
                  "consumed_samples": self.state.consumed_train_samples,
                  "lr": self.scheduler.lr_at(self.state.iteration - 1) if self.state.iteration else 0.0,
                  "lm_loss": result.loss, "grad_norm": result.grad_norm, "ms_per_iter": ms,
                  "tokens_per_sec": tokens_per_sec, "tflops_per_gpu": tflops}
        if self.peak_tflops:
            record["mfu"] = tflops / self.peak_tflops
        record.update(memory_report(self.device))
        for kind, nbytes in comm_stats.snapshot().items():
            record[f"bytes/{kind}"] = nbytes / iters
        return record


def format_log_line(record: dict, train_iters: int) -> str:
    parts = [f"iteration {record['iteration']:8d}/{train_iters:8d}",
             f"consumed samples: {record['consumed_samples']:10d}",
             f"elapsed time per iteration (ms): {record['ms_per_iter']:.1f}",
             f"learning rate: {record['lr']:.6E}",
             f"lm loss: {record['lm_loss']:.6E}",
             f"grad norm: {record['grad_norm']:.3f}",
             f"tokens/s: {record['tokens_per_sec']:.0f}",
             f"TFLOP/s/GPU: {record['tflops_per_gpu']:.2f}"]
    if "mfu" in record:
        parts.append(f"MFU: {100 * record['mfu']:.1f}%")
    if "mem_peak_gb" in record:
        parts.append(f"mem peak (GB): {record['mem_peak_gb']:.2f}")
    elif "host_peak_rss_gb" in record:
        parts.append(f"host peak RSS (GB): {record['host_peak_rss_gb']:.2f}")
    comm = [f"{k[6:]} {comm_stats.format_bytes(v)}" for k, v in record.items() if k.startswith("bytes/")]
    if comm:
        parts.append("comm/iter: " + ", ".join(comm))
    return " | ".join(parts)
