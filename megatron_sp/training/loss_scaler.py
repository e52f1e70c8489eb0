"""fp16 loss scaling, as Megatron-LM's ConstantGradScaler and DynamicGradScaler (--fp16).

fp16 has 5 exponent bits: activation gradients below 2**-24 flush to zero. The loss is multiplied by
a scale S before backward, so every gradient is S times larger, and the fp32 gradients are divided
by S (unscaled) before the norm, clipping and the optimizer step. Parameters stay fp32 (the master
weights); the forward runs under fp16 autocast.

An overflow (an inf or NaN in any unscaled gradient on any rank) skips the optimizer step. The
Trainer reads it from the global gradient norm, which is already reduced over every rank, so all
ranks decide alike without another collective. Dynamic scaling then (Megatron's rules):

    overflow:    growth_tracker = 0; hysteresis_tracker -= 1;
                 if hysteresis_tracker <= 0: S = max(S * 1/2, min_scale)
    no overflow: growth_tracker += 1;
                 if growth_tracker == window: growth_tracker = 0; hysteresis_tracker = hysteresis;
                                              S = S * 2

With --loss-scale the scale is constant (overflows still skip their step).
"""
from __future__ import annotations

import torch


class LossScaler:
    """Megatron's grad scaler; `dynamic=False` is the ConstantGradScaler."""

    def __init__(self, initial_scale: float, *, dynamic: bool = True, min_scale: float = 1.0,
                 window: int = 1000, hysteresis: int = 2, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5):
        self.scale = float(initial_scale)
        self.dynamic, self.min_scale = dynamic, float(min_scale)
        self.window, self.hysteresis = int(window), int(hysteresis)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    @classmethod
    def from_config(cls, precision) -> "LossScaler | None":
        """The scaler of a PrecisionConfig with --fp16 (None otherwise): static with --loss-scale,
        else dynamic."""
        if not precision.fp16:
            return None
        if precision.loss_scale is not None:
            return cls(precision.loss_scale, dynamic=False)
        return cls(precision.initial_loss_scale, min_scale=precision.min_loss_scale,
                   window=int(precision.loss_scale_window), hysteresis=precision.hysteresis)

    @torch.no_grad()
    def unscale_(self, params) -> None:
        """Divide every gradient by the scale, in place (before the norm and clipping)."""
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, found_inf: bool) -> None:
        """Megatron's DynamicGradScaler.update (see the module docstring)."""
        if not self.dynamic:
            return
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.window:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        """A static scaler keeps its --loss-scale (Megatron's ConstantGradScaler loads nothing)."""
        if not self.dynamic:
            return
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
