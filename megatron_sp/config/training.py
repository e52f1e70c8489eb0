"""DataConfig and TrainingConfig: where the tokens come from, and the batch, length of training,
optimizer, learning-rate schedule, evaluation and non-finite policy (with the values Megatron-LM
derives from other flags)."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_sp.config.section import resolve_fields as _resolve
from megatron_sp.errors import ConfigError

NONFINITE_POLICIES = ("skip", "stop")


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from and how samples are cut (docs/design.md §7)."""

    data_path: tuple[str, ...] | None = None
    """--data-path"""
    split: str = "969,30,1"
    """--split"""
    data_cache_path: str | None = None
    """--data-cache-path"""
    tokenizer_type: str | None = None
    """--tokenizer-type"""
    tokenizer_model: str | None = None
    """--tokenizer-model"""
    vocab_file: str | None = None
    """--vocab-file"""
    merge_file: str | None = None
    """--merge-file"""
    trust_remote_code: bool = False
    """--trust-remote-code"""
    vocab_size: int | None = None
    """--vocab-size"""
    reset_position_ids: bool = False
    """--reset-position-ids"""
    reset_attention_mask: bool = False
    """--reset-attention-mask"""
    eod_mask_loss: bool = False
    """--eod-mask-loss"""
    mock_data: bool = False
    """--mock-data"""
    cache_dir: str | None = None
    """--cache-dir"""
    num_workers: int = 0
    """--num-workers"""
    dataloader_type: str = "single"
    """--dataloader-type"""

    def __post_init__(self):
        if self.data_path is not None:
            _resolve(self, data_path=tuple(self.data_path))
        self.split_weights()     # one sentence (DataError) for a --split that cannot be used

    def split_weights(self) -> list[float]:
        """--split as three non-negative weights, train, valid, test (commas or slashes, as
        Megatron-LM; a DataError naming the flag for anything else)."""
        from megatron_sp.data.builder import parse_split
        return parse_split(self.split)


@dataclass(frozen=True)
class TrainingConfig:
    """The batch, the length of training, the optimizer and its learning-rate schedule, evaluation
    and the non-finite policy."""

    micro_batch_size: int = 1
    """--micro-batch-size"""
    global_batch_size: int | None = None
    """--global-batch-size"""
    seq_length: int | None = None
    """--seq-length"""
    train_iters: int | None = None
    """--train-iters"""
    train_samples: int | None = None
    """--train-samples"""
    rampup_batch_size: tuple[int, ...] | None = None
    """--rampup-batch-size"""
    lr: float = 0.0003
    """--lr"""
    min_lr: float = 0.0
    """--min-lr"""
    lr_warmup_iters: int = 0
    """--lr-warmup-iters"""
    lr_warmup_fraction: float | None = None
    """--lr-warmup-fraction"""
    lr_decay_style: str = "linear"
    """--lr-decay-style"""
    lr_decay_iters: int | None = None
    """--lr-decay-iters"""
    lr_wsd_decay_iters: int | None = None
    """--lr-wsd-decay-iters"""
    lr_decay_samples: int | None = None
    """--lr-decay-samples"""
    lr_warmup_samples: int = 0
    """--lr-warmup-samples"""
    lr_wsd_decay_samples: int | None = None
    """--lr-wsd-decay-samples"""
    weight_decay: float = 0.01
    """--weight-decay"""
    clip_grad: float = 1.0
    """--clip-grad"""
    adam_beta1: float = 0.9
    """--adam-beta1"""
    adam_beta2: float = 0.999
    """--adam-beta2"""
    adam_eps: float = 1e-08
    """--adam-eps"""
    optimizer: str = "adam"
    """--optimizer"""
    sgd_momentum: float = 0.9
    """--sgd-momentum"""
    decoupled_lr: float | None = None
    """--decoupled-lr"""
    decoupled_min_lr: float | None = None
    """--decoupled-min-lr"""
    calculate_per_token_loss: bool = False
    """--calculate-per-token-loss"""
    seed: int = 1234
    """--seed"""
    eval_interval: int = 1000
    """--eval-interval"""
    eval_iters: int = 10
    """--eval-iters"""
    nonfinite_loss: str = "stop"
    """--nonfinite-loss"""
    max_skipped_steps: int = 10
    """--max-skipped-steps"""
    torch_compile: bool = False
    """--torch-compile"""
    torch_compile_backend: str = "inductor"
    """--torch-compile-backend"""

    def __post_init__(self):
        """Megatron-LM's defaults that follow from other flags, then its rules, one sentence each."""
        if self.rampup_batch_size is not None:
            _resolve(self, rampup_batch_size=tuple(self.rampup_batch_size))
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise ConfigError("--decoupled-min-lr needs --decoupled-lr (the embedding and "
                              "output layer's peak learning rate).")
        if self.global_batch_size is None:
            _resolve(self, global_batch_size=self.micro_batch_size)
        if self.train_iters is None:   # Megatron: --train-samples counts samples, a constant batch
            _resolve(self, train_iters=(self.train_samples // self.global_batch_size
                                        if self.train_samples is not None else 100))
        if self.lr_decay_iters is None:
            _resolve(self, lr_decay_iters=self.train_iters if self.train_iters else 1)
        if self.lr_warmup_fraction is not None:
            _resolve(self, lr_warmup_iters=int(self.lr_warmup_fraction * self.lr_decay_iters))
        if self.train_samples is None and self.lr_warmup_iters > self.lr_decay_iters:
            raise ConfigError(f"--lr-warmup-iters {self.lr_warmup_iters} is longer than the "
                              f"learning-rate decay, --lr-decay-iters {self.lr_decay_iters}"
                              + (" (which defaults to --train-iters)"
                                 if self.lr_decay_iters == self.train_iters else "")
                              + "; lower --lr-warmup-iters or raise --lr-decay-iters.")
        self._check_sample_schedule()
        if self.rampup_batch_size is not None and self.train_samples is not None:
            _resolve(self, train_iters=self.rampup().train_iters(self.train_samples))
        _resolve(self, eval_iters=max(self.eval_iters, 0))  # train_llama3.sh's -1: no evaluation
        if self.nonfinite_loss not in NONFINITE_POLICIES:
            raise ConfigError(f"--nonfinite-loss {self.nonfinite_loss!r} is not one of "
                              f"{NONFINITE_POLICIES}.")
        if self.max_skipped_steps < 1:
            raise ConfigError(f"--max-skipped-steps must be at least 1, got {self.max_skipped_steps}.")

    def _check_sample_schedule(self) -> None:
        """Megatron's rules for the sample flags; the ramp-up reaches --global-batch-size."""
        sample_flags = [f for f, v in (("--lr-decay-samples", self.lr_decay_samples),
                                       ("--lr-warmup-samples", self.lr_warmup_samples or None),
                                       ("--lr-wsd-decay-samples", self.lr_wsd_decay_samples))
                        if v is not None]
        if sample_flags and self.train_samples is None:
            raise ConfigError(f"{sample_flags[0]} counts the schedule in samples: it needs "
                              f"--train-samples instead of --train-iters (as Megatron-LM).")
        if self.rampup_batch_size is not None:
            start, incr, samples = self.rampup_batch_size
            gbs = self.global_batch_size
            if start <= 0 or incr <= 0 or samples < 0 or start > gbs or (gbs - start) % incr:
                raise ConfigError(f"--rampup-batch-size {start} {incr} {samples} does not reach "
                                  f"--global-batch-size {gbs}: START and INCR must be positive and "
                                  f"GLOBAL - START a multiple of INCR.")

    def rampup(self):
        """The batch-size ramp-up of --rampup-batch-size (megatron_sp.training.rampup), or None."""
        if self.rampup_batch_size is None:
            return None
        from megatron_sp.training.rampup import BatchSizeRampup
        return BatchSizeRampup(*self.rampup_batch_size, self.global_batch_size)

    def end_iteration(self, iteration: int = 0, consumed_samples: int = 0) -> int:
        """The iteration training stops at, from a run's state after --load: --train-iters, or
        with --train-samples the iterations that consume the samples still due (with another
        --global-batch-size or mid-ramp after a resume, as Megatron-LM's update_train_iters)."""
        if self.train_samples is None:
            return self.train_iters
        ramp = self.rampup()
        if ramp is not None:
            return iteration + ramp.train_iters(self.train_samples, consumed_samples)
        return iteration + max(0, self.train_samples - consumed_samples) // self.global_batch_size

    @property
    def counts_samples(self) -> bool:
        """True when the learning-rate schedule is counted in samples (a ramp-up or the
        --lr-*-samples flags; megatron_sp.training.rampup)."""
        return bool(self.rampup_batch_size) or self.lr_decay_samples is not None \
            or bool(self.lr_warmup_samples) or self.lr_wsd_decay_samples is not None
