"""The log line and the metrics of a run: Megatron-LM's log line (its field names and order, so its
scrapers work), --metrics-jsonl (one JSON object per logged iteration), TensorBoard and wandb, all on
rank 0 only."""
from __future__ import annotations

import json
import math
import os
import resource
import sys

import torch

from megatron_sp import comm_stats


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


def _fixed(value: float, significant: int = 3) -> str:
    """Fixed-point (never 1e-05: scrapers read [0-9.]+) with `significant` digits, at least one
    decimal: 312.4, 0.0123, 0.000457 (TFLOP/s on a CPU is small but not zero)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:.1f}"
    decimals = max(1, significant - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def format_log_line(record: dict, train_iters: int, extra: str | None = None) -> str:
    """Megatron-LM's log line (its field names and order, so its scrapers work), ours after it:

     iteration N/M | consumed samples: | elapsed time per iteration (ms): | throughput per GPU
     (TFLOP/s/GPU): | learning rate: | global batch size: | lm loss: | [load balancing loss: |
     z loss: |] loss scale: | grad norm: |
     [num zeros: | params norm: |] number of skipped iterations: | number of nan iterations: | ...

    `extra`: more fields (--report-memory's), before the ETA (remaining iterations x the median
    step time, record["eta_s"]), which comes last.
    """
    parts = [f" iteration {record['iteration']:8d}/{train_iters:8d}",
             f"consumed samples: {record['consumed_samples']:12d}",
             f"elapsed time per iteration (ms): {record['ms_per_iter']:.1f}",
             f"throughput per GPU (TFLOP/s/GPU): {_fixed(record['tflops_per_gpu'])}",
             f"learning rate: {record['lr']:.6E}",
             f"global batch size: {record.get('global_batch_size', 0):5d}",
             f"lm loss: {record['lm_loss']:.6E}"]
    if "load_balancing_loss" in record:    # a mixture-of-experts model: its router losses
        parts += [f"load balancing loss: {record['load_balancing_loss']:.6E}",
                  f"z loss: {record['z_loss']:.6E}"]
    parts += [f"loss scale: {record.get('loss_scale', 1.0):.1f}",
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
    if "cp_work_balance" in record:      # ring ranks' causal work, max / mean (1.000: balanced)
        parts.append(f"cp work balance: {record['cp_work_balance']:.3f}")
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
    if extra:
        parts.append(extra)
    if record.get("eta_s") is not None:   # last: Megatron's scrapers read the fields by name
        parts.append(f"ETA: {format_duration(record['eta_s'])}")
    return " | ".join(parts) + " |"


def format_duration(seconds: float) -> str:
    """3725 -> '1h02m05s', 65 -> '1m05s', 4.2 -> '4s'."""
    s = int(round(max(seconds, 0.0)))
    hours, rest = divmod(s, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class StepClock:
    """Wall time of the recent optimizer steps (evaluation and saves excluded), for the ETA:
    remaining iterations x the median step time (robust to a slow first step or a save)."""

    def __init__(self, window: int = 50):
        self.window, self.times = window, []

    def add(self, seconds: float) -> None:
        self.times = (self.times + [seconds])[-self.window:]

    def eta(self, remaining: int) -> float | None:
        if not self.times:
            return None
        ordered = sorted(self.times)
        return remaining * ordered[len(ordered) // 2]
