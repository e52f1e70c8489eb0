"""AdamW with Megatron's weight-decay groups, and Megatron's learning-rate schedule.

The optimizer is torch's AdamW (fused kernel on CUDA and CPU: one pass over each parameter, 3-6x
faster than foreach on CPU) or apex's FusedAdam when apex is importable on CUDA. Parameters stay fp32 (the master weights); bf16 runs use autocast for the
forward, so gradients and optimizer states are fp32 (docs/design.md §9: 4+4+4+4 bytes per parameter).
"""
from __future__ import annotations

import math

import torch


def param_groups(modules, weight_decay: float, decoupled_lr: float | None = None,
                 decoupled_min_lr: float | None = None) -> list[dict]:
    """No weight decay on biases and norm weights (1-D parameters), as Megatron does.

    --decoupled-lr (Megatron's): the parameters marked `is_embedding_or_output_parameter` (word
    embeddings, every copy, and the output layer) get their own group whose schedule peaks at
    decoupled_lr and ends at decoupled_min_lr (default: the scheduler's min_lr); LRScheduler reads
    a group's "max_lr" / "min_lr".
    """
    groups = {}
    for module in modules:
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            no_decay = p.ndim == 1 or name.endswith(".bias")
            decoupled = decoupled_lr is not None and getattr(p, "is_embedding_or_output_parameter",
                                                             False)
            groups.setdefault((no_decay, decoupled), []).append(p)
    out = []
    for no_decay, decoupled in [(False, False), (True, False), (False, True), (True, True)]:
        if (no_decay, decoupled) not in groups and decoupled:
            continue
        group = {"params": groups.get((no_decay, decoupled), []),
                 "weight_decay": 0.0 if no_decay else weight_decay}
        if decoupled:
            group.update(is_decoupled_lr=True, max_lr=decoupled_lr)
            if decoupled_min_lr is not None:
                group["min_lr"] = decoupled_min_lr
        out.append(group)
    return out


def fused_adamw(groups: list[dict], lr: float, betas=(0.9, 0.999), eps: float = 1e-8):
    """torch's AdamW with its fused kernel (one pass over each parameter and its state; on CPU
    3-10x the foreach step, on FSDP2's DTensors their local shards), except for strided parameters,
    which step on foreach: the fused kernel treats its tensors as contiguous and would update the
    wrong elements of a strided view (seen on CPU with the column pieces of fused tp projections).
    A group holding both kinds is split in two with the same settings; other groups stay as given."""
    out = []
    for g in groups:
        strided = [p for p in g["params"] if not p.is_contiguous()]
        if not strided:
            out.append(g)
            continue
        contiguous = [p for p in g["params"] if p.is_contiguous()]
        out += [{**g, "params": part, "fused": fused, "foreach": not fused}
                for part, fused in ((contiguous, True), (strided, False)) if part]
    return torch.optim.AdamW(out, lr=lr, betas=betas, eps=eps, fused=True)


def build_optimizer(modules, lr: float, weight_decay: float = 0.01, betas=(0.9, 0.999),
                    eps: float = 1e-8, *, optimizer: str = "adam", sgd_momentum: float = 0.9,
                    decoupled_lr: float | None = None,
                    decoupled_min_lr: float | None = None) -> torch.optim.Optimizer:
    """--optimizer adam (AdamW, Megatron's decoupled weight decay) or sgd (torch's SGD with
    --sgd-momentum and L2 weight decay, as Megatron's)."""
    groups = param_groups(modules, weight_decay, decoupled_lr, decoupled_min_lr)
    if optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=sgd_momentum, weight_decay=weight_decay)
    if optimizer != "adam":
        raise ValueError(f"--optimizer {optimizer!r} is not one of ('adam', 'sgd').")
    on_cuda = any(p.is_cuda for g in groups for p in g["params"])
    sharded = any(hasattr(p, "to_local") for g in groups for p in g["params"])   # FSDP2 DTensors
    contiguous = all(p.is_contiguous() for g in groups for p in g["params"])
    if on_cuda and not sharded and contiguous:      # (apex's kernels assume contiguous too)
        try:
            from apex.optimizers import FusedAdam  # NVIDIA apex, optional
            return FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
        except ImportError:
            pass
    return fused_adamw(groups, lr, betas, eps)


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

    def lr_at(self, step: int, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """The learning rate at `step`; max_lr / min_lr: a param group's own (--decoupled-lr)."""
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return max_lr * step / self.warmup_iters
        if self.style == "constant":
            return max_lr
        if step > self.decay_iters:
            return min_lr
        if self.style == "inverse-square-root":
            warm = max(self.warmup_iters, 1)
            return max(min_lr, max_lr * math.sqrt(warm) / math.sqrt(max(step, 1)))
        delta = max_lr - min_lr
        if self.style == "WSD":
            start = self.decay_iters - self.wsd_decay_iters
            if step <= start:
                return max_lr
            return min_lr + delta * (1.0 - (step - start) / max(self.wsd_decay_iters, 1))
        ratio = (step - self.warmup_iters) / max(self.decay_iters - self.warmup_iters, 1)
        if self.style == "linear":
            return min_lr + delta * (1.0 - ratio)
        return min_lr + delta * 0.5 * (math.cos(math.pi * ratio) + 1.0)   # cosine

    def _apply(self):
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.num_steps, group.get("max_lr"), group.get("min_lr"))

    def step(self, increment: int = 1):
        self.num_steps += increment
        self._apply()

    @property
    def lr(self) -> float:
        return self.lr_at(self.num_steps)

    # The schedule itself is saved too: a resumed run compares it with its flags (checkpointing's
    # --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler, as Megatron-LM).
    SCHEDULE = ("max_lr", "min_lr", "warmup_iters", "decay_iters", "style", "wsd_decay_iters")

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, **{k: getattr(self, k) for k in self.SCHEDULE}}

    def load_state_dict(self, state: dict):
        for k in self.SCHEDULE:
            if k in state:
                setattr(self, k, state[k])
        self.num_steps = int(state["num_steps"])
        self._apply()
