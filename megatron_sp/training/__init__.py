"""The run-time pieces of training: the Trainer (one optimizer step over the global batch), the log
line and metrics, the no-pipelining schedule, the optimizer and learning-rate schedule, the fp16 loss
scaler, the batch-size ramp-up, FP8, the profiler and the model-FLOPs formula. They take the typed
configs of `megatron_sp.config`, never the argparse namespace."""
from megatron_sp.training.trainer import StepResult, Trainer, TrainState
from megatron_sp.training.metrics import MetricsWriter, format_log_line, print_rank0

__all__ = ["MetricsWriter", "StepResult", "TrainState", "Trainer", "format_log_line", "print_rank0"]
