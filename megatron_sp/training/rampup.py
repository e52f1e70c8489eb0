"""Megatron-LM's batch-size ramp-up (--rampup-batch-size) and sample-counted learning-rate schedule.

Ramp-up (Megatron's RampupBatchsizeNumMicroBatchesCalculator): the global batch starts at START and
grows by INCR each time another SAMPLES / ((GLOBAL - START) / INCR) samples have been consumed, until
it reaches --global-batch-size after SAMPLES samples. The data order is unchanged: a step simply takes
more micro-batches of micro_batch_size x dp samples from the same sequence, so consumed samples, and
a resume from a checkpoint taken mid-ramp, follow Megatron.

Schedule: Megatron counts the learning-rate schedule in samples (each step advances it by that step's
global batch): with --train-samples the --lr-*-samples flags are the steps, with --train-iters the
--lr-*-iters flags times --global-batch-size. With a constant batch this is exactly the schedule in
iterations, which is what runs then; with a ramp or the sample flags the scheduler counts samples.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSizeRampup:
    start: int
    increment: int
    ramp_samples: int
    global_batch_size: int

    @classmethod
    def from_args(cls, args) -> "BatchSizeRampup | None":
        if not getattr(args, "rampup_batch_size", None):
            return None
        start, incr, samples = args.rampup_batch_size
        gbs = args.global_batch_size
        if start <= 0 or incr <= 0 or samples < 0 or start > gbs or (gbs - start) % incr:
            raise SystemExit(f"error: --rampup-batch-size {start} {incr} {samples} does not reach "
                             f"--global-batch-size {gbs}: START and INCR must be positive and "
                             f"GLOBAL - START a multiple of INCR.")
        return cls(start, incr, samples, gbs)

    def batch_size(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after `consumed_samples` samples."""
        if consumed_samples > self.ramp_samples or self.start == self.global_batch_size \
                or self.ramp_samples == 0:
            return self.global_batch_size
        per_increment = self.ramp_samples / ((self.global_batch_size - self.start) // self.increment)
        return min(self.global_batch_size,
                   self.start + int(consumed_samples / per_increment) * self.increment)

    def check_divisible(self, per_step: int) -> None:
        """Every ramp batch must be whole micro-batches on every data-parallel rank."""
        if self.start % per_step or self.increment % per_step:
            raise SystemExit(f"error: --rampup-batch-size START {self.start} and INCR "
                             f"{self.increment} must be multiples of micro-batch size x dp = "
                             f"{per_step}.")

    def train_iters(self, train_samples: int, consumed: int = 0) -> int:
        """Iterations to consume --train-samples from `consumed` (Megatron's update_train_iters)."""
        iterations = 0
        while consumed <= self.ramp_samples and consumed <= train_samples:
            consumed += self.batch_size(consumed)
            iterations += 1
        return iterations + (train_samples - consumed) // self.global_batch_size


def counts_samples(args) -> bool:
    """True when the learning-rate schedule must be counted in samples (see the module text)."""
    return bool(getattr(args, "rampup_batch_size", None)) or args.lr_decay_samples is not None \
        or bool(args.lr_warmup_samples) or args.lr_wsd_decay_samples is not None


def schedule_steps(args) -> tuple[int, int, int | None]:
    """(warm-up, decay, WSD decay) in the scheduler's unit: iterations, or samples (counts_samples)."""
    if not counts_samples(args):
        return args.lr_warmup_iters, args.lr_decay_iters, args.lr_wsd_decay_iters
    gbs = args.global_batch_size
    if args.train_samples is not None:
        decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        warmup = (int(args.lr_warmup_fraction * decay) if args.lr_warmup_fraction is not None
                  else args.lr_warmup_samples)
        wsd = args.lr_wsd_decay_samples
    else:
        decay = args.lr_decay_iters * gbs
        warmup = (int(args.lr_warmup_fraction * decay) if args.lr_warmup_fraction is not None
                  else args.lr_warmup_iters * gbs)
        wsd = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
    return warmup, decay, wsd


def validate(args) -> None:
    """Megatron's rules for the sample flags; --train-iters from --train-samples under a ramp."""
    sample_flags = [f for f, v in (("--lr-decay-samples", args.lr_decay_samples),
                                   ("--lr-warmup-samples", args.lr_warmup_samples or None),
                                   ("--lr-wsd-decay-samples", args.lr_wsd_decay_samples))
                    if v is not None]
    if sample_flags and args.train_samples is None:
        raise SystemExit(f"error: {sample_flags[0]} counts the schedule in samples: it needs "
                         f"--train-samples instead of --train-iters (as Megatron-LM).")
    rampup = BatchSizeRampup.from_args(args)
    if rampup is not None and args.train_samples is not None:
        args.train_iters = rampup.train_iters(args.train_samples)
