"""AdamW with Megatron's weight-decay groups, and Megatron's learning-rate schedule.

The optimizer is torch's AdamW (fused kernel on CUDA and CPU: one pass over each parameter, 3-6x
faster than foreach on CPU) or apex's FusedAdam when apex is importable on CUDA. Parameters stay fp32 (the master weights); bf16 runs use autocast for the
forward, so gradients and optimizer states are fp32 (DESIGN 9: 4+4+4+4 bytes per parameter).
"""
from __future__ import annotations

import math

import torch


def param_groups(modules, weight_decay: float) -> list[dict]:
    """No weight decay on biases and norm weights (1-D parameters), as Megatron does."""
    decay, no_decay = [], []
    for module in modules:
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(modules, lr: float, weight_decay: float = 0.01, betas=(0.9, 0.999),
                    eps: float = 1e-8) -> torch.optim.Optimizer:
    groups = param_groups(modules, weight_decay)
    on_cuda = any(p.is_cuda for g in groups for p in g["params"])
    if on_cuda:
        try:
            from apex.optimizers import FusedAdam  # NVIDIA apex, optional
            return FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
        except ImportError:
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)


class LRScheduler:
    """Megatron's OptimizerParamScheduler, counted in iterations.

    Linear warm-up from 0 to max_lr over warmup_iters, then `style` decay to min_lr over
    decay_iters (counted from 0, warm-up included): constant | linear | cosine |
    inverse-square-root | WSD (warmup-stable-decay: constant, then a linear decay over the
    last wsd_decay_iters).
    """

    STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")

    def __init__(self, optimizer, max_lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                 style: str = "linear", wsd_decay_iters: int | None = None):
        if style not in self.STYLES:
            raise ValueError(f"--lr-decay-style {style!r} is not one of {self.STYLES}.")
        if decay_iters < warmup_iters:
            raise ValueError(f"--lr-decay-iters ({decay_iters}) is smaller than --lr-warmup-iters "
                             f"({warmup_iters}).")
        self.optimizer, self.max_lr, self.min_lr = optimizer, max_lr, min_lr
        self.warmup_iters, self.decay_iters, self.style = warmup_iters, decay_iters, style
        self.wsd_decay_iters = wsd_decay_iters if wsd_decay_iters is not None else decay_iters // 10
        self.num_steps = 0
        self._apply()

    def lr_at(self, step: int) -> float:
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.max_lr * step / self.warmup_iters
        if self.style == "constant":
            return self.max_lr
        if step > self.decay_iters:
            return self.min_lr
        if self.style == "inverse-square-root":
            warm = max(self.warmup_iters, 1)
            return max(self.min_lr, self.max_lr * math.sqrt(warm) / math.sqrt(max(step, 1)))
        delta = self.max_lr - self.min_lr
        if self.style == "WSD":
            start = self.decay_iters - self.wsd_decay_iters
            if step <= start:
                return self.max_lr
            return self.min_lr + delta * (1.0 - (step - start) / max(self.wsd_decay_iters, 1))
        ratio = (step - self.warmup_iters) / max(self.decay_iters - self.warmup_iters, 1)
        if self.style == "linear":
            return self.min_lr + delta * (1.0 - ratio)
        return self.min_lr + delta * 0.5 * (math.cos(math.pi * ratio) + 1.0)   # cosine

    def _apply(self):
        lr = self.lr_at(self.num_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, increment: int = 1):
        self.num_steps += increment
        self._apply()

    @property
    def lr(self) -> float:
        return self.lr_at(self.num_steps)

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict):
        self.num_steps = int(state["num_steps"])
        self._apply()
