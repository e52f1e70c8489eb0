"""FP8 matmuls for the tensor-parallel linears through torchao's float8 primitives
(docs/design.md §17).

Current (dynamic) scaling as torchao's Float8Linear does it, for our column / row parallel layers:
each operand of the three matmuls of a linear layer (forward y = x W^T, input gradient
dx = dy W, weight gradient dW = dy^T x) is cast to FP8 with scale = fp8_max / amax / 2^margin and
multiplied with torchao's Float8TrainingTensor matmul (torch._scaled_mm, or fp32 emulation):

    tensorwise          one scale per tensor (x and W cast once, reused in backward)
    rowwise             one scale per row of each operand along the contraction dimension, powers
                        of two (torchao's "rowwise" recipe)
    rowwise_with_gw_hp  rowwise, the weight gradient in high precision (torchao's recipe)

The formats are Transformer Engine's: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 for the
output gradient).

What one rank would compute: a scale is a max over the elements it covers, so on a sharded tensor
each rank's amax is reduced with MAX (megatron_sp.tensor_parallel.fp8_comm) over the ranks holding
the other elements of that reduction: tp where the reduced dimension is split over tp (W, the
row-parallel input, the column-parallel output gradient), and the data group (dp x cp x sp) over
the tokens of a micro-batch. The tokens gathered under --sequence-parallel are cast after the
gather. The scales, and so the FP8 values, are then those of one rank training on the global
micro-batch (mb x dp) of the full sequence.

The parameters stay in high precision (FP8 is a compute format): checkpoints do not change.
torchao is imported lazily, when FP8 is switched on.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from megatron_sp.tensor_parallel import fp8_comm, mappings

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
FORMATS = ("e4m3", "hybrid")


@dataclass(frozen=True)
class Fp8Recipe:
    """How the FP8 linears cast: --fp8-format, --fp8-recipe (torchao's), --fp8-margin.

    emulate: matmuls in fp32 on the dequantised operands (torchao's emulate=True) instead of
    torch._scaled_mm. reduce_amax=False keeps each rank's own amax: scales then differ from one
    rank's under tp / sp / cp / dp (tests show that the reduction matters; never in training).
    """

    format: str = "hybrid"
    recipe: str = "tensorwise"
    margin: int = 0
    emulate: bool = False
    reduce_amax: bool = True

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"FP8 format {self.format!r}: expected one of {FORMATS}.")
        if self.recipe not in RECIPES:
            raise ValueError(f"FP8 recipe {self.recipe!r}: expected one of {RECIPES}.")

    @property
    def forward_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def grad_dtype(self) -> torch.dtype:
        """The output gradient's format: e5m2 under hybrid (its wider range), else e4m3."""
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn

    @property
    def rowwise(self) -> bool:
        return self.recipe != "tensorwise"


@dataclass(frozen=True)
class Fp8Groups:
    """The groups over which each dimension of a linear layer's operands is split.

    tokens: the tokens of one micro-batch (dp x cp x sp); in_features / out_features: tp for the
    row- / column-parallel layer; sequence: the tp group whose sequence shards are all-gathered
    before the matmul (--sequence-parallel column-parallel input), None otherwise.
    """

    tokens: object = None
    in_features: object = None
    out_features: object = None
    sequence: object = None


@dataclass(frozen=True)
class Fp8Plan:
    """What one layer needs to run in FP8: the recipe and its groups (set as `layer.fp8`)."""

    recipe: Fp8Recipe
    groups: Fp8Groups


# Scales and casts ----------------------------------------------------------------------------

@contextlib.contextmanager
def _quiet_import():
    """torchao's import warns about its CUDA-only kernels off CUDA (and torch about an enum it
    registers): not the user's concern, so those loggers are raised to ERROR meanwhile."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _torchao():
    """torchao's float8 pieces used here (imported on first use)."""
    with _quiet_import():
        import torchao.float8   # noqa: F401
    from torchao.float8 import float8_training_tensor as ftt
    from torchao.float8.float8_utils import amax_to_scale
    return ftt, amax_to_scale


def mm_config(recipe: Fp8Recipe):
    """torchao's LinearMMConfig for the three matmuls (fast accumulation in the forward only, as
    torchao's Float8LinearConfig; the inner dimension padded to 16 for torch._scaled_mm)."""
    ftt, _ = _torchao()
    make = lambda fast: ftt.ScaledMMConfig(recipe.emulate, fast, False, True)  # noqa: E731
    return ftt.LinearMMConfig(make(True), make(False), make(False))


def compute_scale(t: torch.Tensor, dtype: torch.dtype, recipe: Fp8Recipe, reduce_dim, dim_groups):
    """The FP8 scale of a 2-D tensor t [R, C] whose dims are split over dim_groups (g_R, g_C).

    reduce_dim None: one scale (the amax of the whole tensor, reduced over both groups); 0 or -1:
    one per column [1, C] / per row [R, 1] (the amax along reduce_dim, reduced over its group).
    """
    _, amax_to_scale = _torchao()
    with torch.no_grad():
        if reduce_dim is None:
            amax, groups = t.abs().amax().float(), dim_groups
        else:
            amax = t.abs().amax(dim=reduce_dim, keepdim=True).float().contiguous()
            groups = (dim_groups[reduce_dim],)
        if recipe.reduce_amax:
            amax = fp8_comm.max_over_groups_(amax.contiguous(), groups)
        scale = amax_to_scale(amax, dtype, round_scales_to_power_of_2=recipe.rowwise)
        return scale / (2.0 ** recipe.margin)


def to_fp8(t, scale, dtype, config, role: str, reduce_dim=None):
    """t cast with `scale` to a torchao Float8TrainingTensor in the matmul role
    ("input" | "weight" | "grad_output")."""
    ftt, _ = _torchao()
    return ftt.hp_tensor_and_scale_to_float8(t, scale, dtype, config, ftt.GemmInputRole(role),
                                             axiswise_dim=reduce_dim)


def cast(t, dtype, recipe, config, role, reduce_dim, dim_groups, scale=None):
    """to_fp8 with the scale computed here (compute_scale) unless given."""
    if scale is None:
        scale = compute_scale(t, dtype, recipe, reduce_dim, dim_groups)
    return to_fp8(t, scale, dtype, config, role, reduce_dim)


# The linear ------------------------------------------------------------------------------------

def _autocast_dtype(x: torch.Tensor):
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T with the three matmuls in FP8 (module docstring); x [..., K] (or the sequence
    shard [b, s/tp, K] when groups.sequence is set), W [N, K] -> y [..., N].

    Computes in the autocast dtype (bf16 / fp16) or the input's; the high-precision input shard
    and weight are saved (with the tensorwise scales), so backward casts without communication
    except for the output gradient's amax.
    """

    @staticmethod
    def forward(ctx, x, weight, plan: Fp8Plan):
        dtype = _autocast_dtype(x) or x.dtype
        ctx.x_dtype, ctx.plan = x.dtype, plan
        x, w = x.to(dtype), weight.to(dtype)
        r, g = plan.recipe, plan.groups
        config = mm_config(r)
        with torch.autocast(x.device.type, enabled=False):
            x_full = mappings.gather_along_dim(x, 1, g.sequence) if g.sequence else x  # [b, s, K]
            x2 = x_full.reshape(-1, x_full.size(-1))                                    # [T, K]
            if r.rowwise:   # per token over K; per output row of W over K
                x8 = cast(x2, r.forward_dtype, r, config, "input", -1, (g.tokens, g.in_features))
                w8t = cast(w.t(), r.forward_dtype, r, config, "weight", 0,
                           (g.in_features, g.out_features))                          # W^T [K, N]
                ctx.scales = None
            else:
                sx = compute_scale(x2, r.forward_dtype, r, None, (g.tokens, g.in_features))
                sw = compute_scale(w, r.forward_dtype, r, None, (g.out_features, g.in_features))
                x8 = to_fp8(x2, sx, r.forward_dtype, config, "input")
                w8t = to_fp8(w, sw, r.forward_dtype, config, "weight").t()           # [K, N]
                ctx.scales = (sx, sw)
            y2 = torch.mm(x8, w8t)                                                    # [T, N]
        ctx.save_for_backward(x, weight)
        ctx.dtype, ctx.full_shape = dtype, x_full.shape
        return y2.reshape(*x_full.shape[:-1], y2.size(-1))                            # [..., N]

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        r, g, dtype = ctx.plan.recipe, ctx.plan.groups, ctx.dtype
        config = mm_config(r)
        with torch.autocast(grad_y.device.type, enabled=False):
            w = weight.to(dtype)
            x_full = mappings.gather_along_dim(x, 1, g.sequence) if g.sequence else x  # again
            x2 = x_full.reshape(-1, x_full.size(-1))                                    # [T, K]
            g2 = grad_y.to(dtype).reshape(-1, grad_y.size(-1))                          # [T, N]
            tokens_out, in_out = (g.tokens, g.out_features), (g.in_features, g.out_features)
            if r.rowwise:
                g8 = cast(g2, r.grad_dtype, r, config, "grad_output", -1, tokens_out)  # per token
                w8 = cast(w.t(), r.forward_dtype, r, config, "weight", -1, in_out).t()  # [N, K]
                grad_x2 = torch.mm(g8, w8)                                            # [T, K]
                if r.recipe == "rowwise_with_gw_hp":
                    grad_w = g2.t().mm(x2)                                            # [N, K]
                else:   # per output feature / input feature over the tokens
                    g8t = cast(g2, r.grad_dtype, r, config, "grad_output", 0, tokens_out).t()
                    x8 = cast(x2, r.forward_dtype, r, config, "input", 0,
                              (g.tokens, g.in_features))
                    grad_w = torch.mm(g8t, x8)                                        # [N, K]
            else:
                sx, sw = ctx.scales
                g8 = cast(g2, r.grad_dtype, r, config, "grad_output", None, tokens_out)
                grad_x2 = torch.mm(g8, to_fp8(w, sw, r.forward_dtype, config, "weight"))  # [T, K]
                grad_w = torch.mm(g8.t(), to_fp8(x2, sx, r.forward_dtype, config, "input"))
            grad_x = grad_x2.reshape(ctx.full_shape)                                  # [..., K]
            if g.sequence:
                grad_x = mappings.reduce_scatter_along_dim(grad_x, 1, g.sequence)     # [b, s/tp, K]
        return grad_x.to(ctx.x_dtype), grad_w.to(weight.dtype), None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias, plan: Fp8Plan) -> torch.Tensor:
    """x W^T (+ bias) with FP8 matmuls (see _Fp8Linear for the shapes)."""
    y = _Fp8Linear.apply(x, weight, plan)
    return y if bias is None else y + bias.to(y.dtype)


def torchao_available() -> bool:
    """Whether torchao's float8 training pieces import."""
    try:
        with _quiet_import():
            from torchao.float8 import float8_training_tensor  # noqa: F401
    except ImportError:
        return False
    return True
