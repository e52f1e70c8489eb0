"""CheckpointConfig and LoggingConfig: what a run leaves behind and when it stops: checkpoints and
the exit conditions, the log line, metrics files, TensorBoard, wandb and the profiler."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_sp.errors import ConfigError


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving, loading and the exit conditions (pre-emption signals, intervals, wall time)."""

    save: str | None = None
    """--save: checkpoint folder to save to."""
    load: str | None = None
    """--load: checkpoint folder to resume or start from."""
    save_interval: int | None = None
    """--save-interval: save every N iterations."""
    no_load_optim: bool = False
    """--no-load-optim: do not load optimizer state."""
    no_load_rng: bool = False
    """--no-load-rng: do not load RNG state."""
    finetune: bool = False
    """--finetune: load weights only, reset iteration."""
    use_checkpoint_args: bool = False
    """--use-checkpoint-args: take the model flags from the --load checkpoint's stored config
    (explicit model flags that differ are replaced, with a warning)."""
    exit_signal_handler: bool = False
    """--exit-signal-handler: save and exit on SIGTERM/SIGUSR1."""
    exit_interval: int | None = None
    """--exit-interval: save and exit at iteration N."""
    exit_duration_in_mins: float | None = None
    """--exit-duration-in-mins: save and exit after this much wall time."""
    async_save: bool = False
    """--async-save: write checkpoints in the background (published at the next save)."""
    ckpt_step: int | None = None
    """--ckpt-step: load this iteration of --load instead of the newest (Megatron's)."""
    no_verify_checkpoint: bool = False
    """--no-verify-checkpoint: do not check checkpoint files against the checksums recorded at save
    before loading them."""
    override_opt_param_scheduler: bool = False
    """--override-opt_param-scheduler: on resume, use the learning-rate schedule of the command
    line even where it differs from the checkpoint's (Megatron's)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """--use-checkpoint-opt_param-scheduler: on resume, use the checkpoint's learning-rate schedule
    instead of the command line's (Megatron's)."""
    no_save_optim: bool = False
    """--no-save-optim: checkpoints without optimizer state."""
    no_save_rng: bool = False
    """--no-save-rng: checkpoints without RNG state."""
    exit_on_missing_checkpoint: bool = False
    """--exit-on-missing-checkpoint: stop when --load holds no checkpoint."""
    ckpt_format: str | None = None
    """--ckpt-format: torch_dist (ours: DCP); others refused."""
    force_unlock: bool = False
    """--force-unlock: take the --save lock even when its record names another host (the operator
    is sure that run is gone; docs/checkpoints.md)."""
    overwrite_save: bool = False
    """--overwrite-save: start a new run into a --save that holds another run's checkpoints
    (without it such a run is refused; --load <save> resumes instead)."""
    skip_free_space_check: bool = False
    """--skip-free-space-check: start even when --save has less free space than one checkpoint."""

    def __post_init__(self):
        if self.load and self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                              "contradict each other: pass one of them.")


@dataclass(frozen=True)
class LoggingConfig:
    """The log line, metrics files, TensorBoard, wandb and the profiler."""

    log_interval: int = 10
    """--log-interval: print the log line every N iterations."""
    tensorboard_dir: str | None = None
    """--tensorboard-dir: write TensorBoard scalars here."""
    metrics_jsonl: str | None = None
    """--metrics-jsonl: write one JSON object per logged iteration here."""
    debug: bool = False
    """--debug: print the Python traceback with an error message (also MEGATRON_SP_DEBUG=1);
    without it a user error is one line."""
    log_throughput: bool = False
    """--log-throughput: TFLOP/s per GPU in the log line (always printed here)."""
    log_params_norm: bool = False
    """--log-params-norm: the parameters' global L2 norm in the log line."""
    log_num_zeros_in_grad: bool = False
    """--log-num-zeros-in-grad: the number of zero gradient entries in the log line."""
    log_timers_to_tensorboard: bool = False
    """--log-timers-to-tensorboard: timings to TensorBoard (they always go there)."""
    peak_tflops: float | None = None
    """--peak-tflops: device peak for MFU."""
    profile: bool = False
    """--profile: profile iterations --profile-step-start to --profile-step-end."""
    profile_step_start: int = 10
    """--profile-step-start: first profiled iteration."""
    profile_step_end: int = 12
    """--profile-step-end: iteration after the last profiled one."""
    use_pytorch_profiler: bool = False
    """--use-pytorch-profiler: --profile writes a torch.profiler trace to --tensorboard-dir (else
    it marks the nsys capture range on CUDA)."""
    wandb_project: str | None = None
    """--wandb-project: Weights & Biases project (needs wandb)."""
    wandb_exp_name: str | None = None
    """--wandb-exp-name: Weights & Biases run name."""
    wandb_save_dir: str | None = None
    """--wandb-save-dir: Weights & Biases folder."""

    def __post_init__(self):
        if self.profile and self.profile_step_end < self.profile_step_start:
            raise ConfigError(f"--profile-step-end {self.profile_step_end} is before "
                              f"--profile-step-start {self.profile_step_start}.")
