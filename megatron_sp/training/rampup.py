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

from megatron_sp.errors import ConfigError


@dataclass(frozen=True)
class BatchSizeRampup:
    """--rampup-batch-size START INCR SAMPLES up to --global-batch-size (TrainingConfig.rampup()
    builds it; the config has checked that START and INCR reach the global batch)."""

    start: int
    increment: int
    ramp_samples: int
    global_batch_size: int

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
            raise ConfigError(f"--rampup-batch-size START {self.start} and INCR "
                              f"{self.increment} must be multiples of micro-batch size x dp = "
                              f"{per_step}.")

    def train_iters(self, train_samples: int, consumed: int = 0) -> int:
        """Iterations to consume --train-samples from `consumed` (Megatron's update_train_iters)."""
        iterations = 0
        while consumed <= self.ramp_samples and consumed <= train_samples:
            consumed += self.batch_size(consumed)
            iterations += 1
        return iterations + (train_samples - consumed) // self.global_batch_size


def schedule_steps(training) -> tuple[int, int, int | None]:
    """(warm-up, decay, WSD decay) of a TrainingConfig in the scheduler's unit: iterations, or
    samples (training.counts_samples)."""
    t = training
    if not t.counts_samples:
        return t.lr_warmup_iters, t.lr_decay_iters, t.lr_wsd_decay_iters
    gbs = t.global_batch_size
    if t.train_samples is not None:
        decay = t.lr_decay_samples if t.lr_decay_samples is not None else t.train_samples
        warmup = (int(t.lr_warmup_fraction * decay) if t.lr_warmup_fraction is not None
                  else t.lr_warmup_samples)
        wsd = t.lr_wsd_decay_samples
    else:
        decay = t.lr_decay_iters * gbs
        warmup = (int(t.lr_warmup_fraction * decay) if t.lr_warmup_fraction is not None
                  else t.lr_warmup_iters * gbs)
        wsd = t.lr_wsd_decay_iters * gbs if t.lr_wsd_decay_iters is not None else None
    return warmup, decay, wsd
