"""CheckpointConfig and LoggingConfig: what a run leaves behind and when it stops: checkpoints and
the exit conditions, the log line, metrics files, TensorBoard, wandb and the profiler."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_sp.errors import ConfigError


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving, loading and the exit conditions (pre-emption signals, intervals, wall time)."""

    save: str | None = None
    """--save"""
    load: str | None = None
    """--load"""
    save_interval: int | None = None
    """--save-interval"""
    no_load_optim: bool = False
    """--no-load-optim"""
    no_load_rng: bool = False
    """--no-load-rng"""
    finetune: bool = False
    """--finetune"""
    use_checkpoint_args: bool = False
    """--use-checkpoint-args"""
    exit_signal_handler: bool = False
    """--exit-signal-handler"""
    exit_interval: int | None = None
    """--exit-interval"""
    exit_duration_in_mins: float | None = None
    """--exit-duration-in-mins"""
    async_save: bool = False
    """--async-save"""
    ckpt_step: int | None = None
    """--ckpt-step"""
    no_verify_checkpoint: bool = False
    """--no-verify-checkpoint"""
    override_opt_param_scheduler: bool = False
    """--override-opt_param-scheduler"""
    use_checkpoint_opt_param_scheduler: bool = False
    """--use-checkpoint-opt_param-scheduler"""
    no_save_optim: bool = False
    """--no-save-optim"""
    no_save_rng: bool = False
    """--no-save-rng"""
    exit_on_missing_checkpoint: bool = False
    """--exit-on-missing-checkpoint"""
    ckpt_format: str | None = None
    """--ckpt-format"""
    force_unlock: bool = False
    """--force-unlock"""
    overwrite_save: bool = False
    """--overwrite-save"""
    skip_free_space_check: bool = False
    """--skip-free-space-check"""

    def __post_init__(self):
        if self.load and self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                              "contradict each other: pass one of them.")


@dataclass(frozen=True)
class LoggingConfig:
    """The log line, metrics files, TensorBoard, wandb and the profiler."""

    log_interval: int = 10
    """--log-interval"""
    tensorboard_dir: str | None = None
    """--tensorboard-dir"""
    metrics_jsonl: str | None = None
    """--metrics-jsonl"""
    debug: bool = False
    """--debug"""
    log_throughput: bool = False
    """--log-throughput"""
    log_params_norm: bool = False
    """--log-params-norm"""
    log_num_zeros_in_grad: bool = False
    """--log-num-zeros-in-grad"""
    log_timers_to_tensorboard: bool = False
    """--log-timers-to-tensorboard"""
    peak_tflops: float | None = None
    """--peak-tflops"""
    profile: bool = False
    """--profile"""
    profile_step_start: int = 10
    """--profile-step-start"""
    profile_step_end: int = 12
    """--profile-step-end"""
    use_pytorch_profiler: bool = False
    """--use-pytorch-profiler"""
    wandb_project: str | None = None
    """--wandb-project"""
    wandb_exp_name: str | None = None
    """--wandb-exp-name"""
    wandb_save_dir: str | None = None
    """--wandb-save-dir"""

    def __post_init__(self):
        if self.profile and self.profile_step_end < self.profile_step_start:
            raise ConfigError(f"--profile-step-end {self.profile_step_end} is before "
                              f"--profile-step-start {self.profile_step_start}.")
