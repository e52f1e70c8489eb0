"""PrecisionConfig: bf16, fp16 with Megatron-LM's loss scaling, FP8 (Transformer Engine or torchao),
and the names of the FP8 recipes."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_sp.errors import ConfigError


FP8_RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8", "rowwise", "rowwise_with_gw_hp")
"""--fp8-recipe's names: Megatron-LM's four, then torchao's rowwise ones."""


def check_fp8_recipe(recipe: str | None) -> None:
    """ConfigError (one sentence) for a --fp8-recipe that is not in FP8_RECIPES."""
    if recipe is not None and recipe not in FP8_RECIPES:
        raise ConfigError(f"--fp8-recipe {recipe} is not a recipe: use one of "
                          f"{', '.join(FP8_RECIPES)}.")


@dataclass(frozen=True)
class PrecisionConfig:
    """Mixed precision: bf16, fp16 with Megatron-LM's loss scaling, FP8 through Transformer Engine."""

    bf16: bool = False
    """--bf16"""
    fp16: bool = False
    """--fp16"""
    loss_scale: float | None = None
    """--loss-scale"""
    initial_loss_scale: float = 4294967296.0
    """--initial-loss-scale"""
    min_loss_scale: float = 1.0
    """--min-loss-scale"""
    loss_scale_window: float = 1000
    """--loss-scale-window"""
    hysteresis: int = 2
    """--hysteresis"""
    fp8_format: str | None = None
    """--fp8-format; run by fp8_backend."""
    fp8_recipe: str | None = None
    """--fp8-recipe"""
    fp8_backend: str | None = None
    """Which library runs --fp8-format: "transformer_engine" or "torchao" (the command line resolves
    it with megatron_sp.training.fp8.resolve_backend; None: Transformer Engine where installed)."""
    fp8_margin: int = 0
    """--fp8-margin"""
    fp8_interval: int = 1
    """--fp8-interval"""
    fp8_amax_history_len: int = 1
    """--fp8-amax-history-len"""
    fp8_amax_compute_algo: str = "most_recent"
    """--fp8-amax-compute-algo"""
    fp8_param_gather: bool = False
    """--fp8-param-gather"""

    def __post_init__(self):
        if self.fp16 and self.bf16:
            raise ConfigError("--fp16 and --bf16 contradict each other: pass one of them.")
        if self.fp16 and self.loss_scale is None:
            if not 0 < self.min_loss_scale <= self.initial_loss_scale:
                raise ConfigError(f"--min-loss-scale {self.min_loss_scale:g} must be positive "
                                  f"and at most --initial-loss-scale {self.initial_loss_scale:g}.")
            if self.hysteresis < 1 or self.loss_scale_window < 1:
                raise ConfigError("--hysteresis and --loss-scale-window must be at least 1.")
        if self.fp16 and self.loss_scale is not None and self.loss_scale <= 0:
            raise ConfigError(f"--loss-scale must be positive, got {self.loss_scale:g}.")
        if self.fp8_param_gather and self.fp8_format is None:
            raise ConfigError("--fp8-param-gather needs --fp8-format e4m3|hybrid.")
        check_fp8_recipe(self.fp8_recipe)
        if self.fp8_backend not in (None, "transformer_engine", "torchao"):
            raise ConfigError(f"FP8 backend {self.fp8_backend!r}: use transformer_engine or torchao.")

    @property
    def autocast_dtype(self):
        """The dtype of the forward's autocast (bf16 or fp16), or None for fp32."""
        import torch
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else None
