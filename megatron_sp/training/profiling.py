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
    def from_args(cls, args, mesh) -> "StepProfiler":
        if not getattr(args, "profile", False) or mesh.rank != 0:
            return _NoProfiler()
        if args.profile_step_end < args.profile_step_start:
            raise SystemExit(f"error: --profile-step-end {args.profile_step_end} is before "
                             f"--profile-step-start {args.profile_step_start}.")
        if args.profile_step_start > args.train_iters:
            print(f"> --profile: iterations {args.profile_step_start}-{args.profile_step_end} come "
                  f"after --train-iters {args.train_iters}: nothing is profiled "
                  f"(--profile-step-start, --profile-step-end)", file=sys.stderr, flush=True)
            return _NoProfiler()
        use_torch = args.use_pytorch_profiler
        trace_dir = args.tensorboard_dir or os.path.join(args.save or ".", "profile")
        if not use_torch and not torch.cuda.is_available():
            print("> --profile without --use-pytorch-profiler marks an nsys capture range, which "
                  "needs CUDA: nothing is profiled on CPU (add --use-pytorch-profiler)",
                  file=sys.stderr, flush=True)
            return _NoProfiler()
        return cls(args.profile_step_start, args.profile_step_end, trace_dir, use_torch)

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
