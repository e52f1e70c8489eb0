"""--profile (Megatron's): profile iterations --profile-step-start .. --profile-step-end.

With --use-pytorch-profiler a torch.profiler trace (CPU, and CUDA when present) is written to
--tensorboard-dir (TensorBoard's profiler plugin reads it); without it, on CUDA the range is marked
for nsys (`nsys profile --capture-range=cudaProfilerApi`), as Megatron-LM does. Rank 0 only.
"""
from __future__ import annotations

import os
import sys

import torch


class StepProfiler:
    def __init__(self, start: int, end: int, trace_dir: str | None, use_torch: bool):
        self.start, self.end, self.trace_dir, self.use_torch = start, end, trace_dir, use_torch
        self.active = None     # the running profiler (or True for the nsys range) between start and end
        self.done = False

    @classmethod
    def from_config(cls, logging, mesh, *, train_iters: int, save: str | None = None) -> "StepProfiler":
        """The profiler of a LoggingConfig's --profile flags on rank 0 (else one that does nothing);
        the trace goes to --tensorboard-dir, else `save`/profile."""
        if not logging.profile or mesh.rank != 0:
            return _NoProfiler()
        start, end = logging.profile_step_start, logging.profile_step_end
        if start > train_iters:
            print(f"> --profile: iterations {start}-{end} come after --train-iters {train_iters}: "
                  f"nothing is profiled (--profile-step-start, --profile-step-end)",
                  file=sys.stderr, flush=True)
            return _NoProfiler()
        use_torch = logging.use_pytorch_profiler
        trace_dir = logging.tensorboard_dir or os.path.join(save or ".", "profile")
        if not use_torch and not torch.cuda.is_available():
            print("> --profile without --use-pytorch-profiler marks an nsys capture range, which "
                  "needs CUDA: nothing is profiled on CPU (add --use-pytorch-profiler)",
                  file=sys.stderr, flush=True)
            return _NoProfiler()
        return cls(start, end, trace_dir, use_torch)

    def before_step(self, iteration: int) -> None:
        if iteration != self.start or self.active is not None or self.done:
            return
        if self.use_torch:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.active = torch.profiler.profile(
                activities=activities, record_shapes=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(self.trace_dir))
            self.active.__enter__()
        else:
            torch.cuda.profiler.start()
            self.active = True

    def after_step(self, iteration: int) -> None:
        if self.active is not None and iteration >= self.end:
            self.close()

    def close(self) -> None:
        if self.active is None:
            return
        if self.use_torch:
            self.active.__exit__(None, None, None)
            print(f"> profiler trace of iterations {self.start}-{self.end} in {self.trace_dir}",
                  flush=True)
        else:
            torch.cuda.profiler.stop()
        self.active, self.done = None, True     # profiled once


class _NoProfiler:
    def before_step(self, iteration): pass
    def after_step(self, iteration): pass
    def close(self): pass
