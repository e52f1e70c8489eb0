"""Transformer Engine glue and FP8 (--fp8-*): --transformer-impl transformer_engine, as Megatron-LM,

Written against Transformer Engine's documented API (imported lazily; never needed otherwise):

    transformer_engine.common.recipe.Format.E4M3 | Format.HYBRID
    transformer_engine.common.recipe.DelayedScaling(margin=, fp8_format=, amax_history_len=,
                                                    amax_compute_algo=[, interval= before TE 1.8])
    transformer_engine.pytorch.fp8_autocast(enabled=, fp8_recipe=, fp8_group=)
    transformer_engine.pytorch.fp8_model_init(enabled=)

Megatron-LM's flags map one to one: --fp8-format e4m3|hybrid -> Format, --fp8-margin, --fp8-amax-
history-len, --fp8-amax-compute-algo -> the DelayedScaling recipe (--fp8-interval only reaches TE
before 1.8, which dropped it, as in Megatron); every forward runs inside fp8_autocast with the amax
reduced over the ranks of one pipeline stage (tp x sp x dp, Megatron's amax group with context
parallelism); --fp8-param-gather builds the model inside fp8_model_init.

With Transformer Engine (installed, --transformer-impl transformer_engine) FP8 reaches its modules
only: our linear layers are torch modules, so the matmuls of the projections and the MLP stay in
bf16 there. Without it (or with --transformer-impl local) FP8 runs through torchao in our own
tensor-parallel linears (megatron_sp.tensor_parallel.fp8): qkv, out-proj, fc1 and fc2 with current
scaling (--fp8-recipe tensorwise, the default there, or torchao's rowwise / rowwise_with_gw_hp), the
amaxes reduced over the ranks that share a tensor so every layout computes one rank's FP8. Neither
library: --fp8-format is refused in one sentence naming both.
"""
from __future__ import annotations

import contextlib

from megatron_sp.errors import ConfigError


def transformer_engine_installed() -> bool:
    """Whether Transformer Engine's torch module imports (--transformer-impl transformer_engine
    runs as local without it; --fp8-format is refused)."""
    try:
        import transformer_engine.pytorch   # noqa: F401
    except ImportError:
        return False
    return True


def require_transformer_engine(flag: str):
    """Transformer Engine's torch module, or a ConfigError with one sentence naming `flag`."""
    try:
        import transformer_engine.pytorch as te   # noqa: F401
    except ImportError:
        raise ConfigError(f"{flag} needs NVIDIA Transformer Engine, which is not installed "
                          f"(pip install transformer_engine[pytorch] on a CUDA machine); leave "
                          f"the flag out to train with these layers in bf16.") from None
    return te


def _te_version() -> tuple[int, ...]:
    import transformer_engine
    text = getattr(transformer_engine, "__version__", "0")
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


def delayed_scaling_recipe(precision):
    """Megatron's DelayedScaling recipe from the --fp8-* flags (a PrecisionConfig)."""
    from transformer_engine.common import recipe
    p = precision
    fmt = {"e4m3": recipe.Format.E4M3, "hybrid": recipe.Format.HYBRID}[p.fp8_format]
    kwargs = dict(margin=p.fp8_margin, fp8_format=fmt, amax_history_len=p.fp8_amax_history_len,
                  amax_compute_algo=p.fp8_amax_compute_algo)
    if _te_version() < (1, 8):
        kwargs["interval"] = p.fp8_interval
    return recipe.DelayedScaling(**kwargs)


def amax_group(mesh):
    """The ranks of one pipeline stage (tp x sp x dp), over which FP8 amaxes are reduced.

    None (TE's default: the world) without pipelining, where that is the same set of ranks.
    Collective when pp > 1: every rank calls it at the same point.
    """
    if mesh.pp_size == 1 or getattr(mesh, "device_mesh", None) is None:
        return None
    return mesh.device_mesh["dp", "sp", "tp"]._flatten("fp8_amax").get_group()


def fp8_autocast_factory(precision, mesh):
    """A callable giving each forward's FP8 context (None without --fp8-format, and through
    torchao, whose FP8 lives in the layers: enable_from_config)."""
    if precision.fp8_format is None or backend_of(precision) == "torchao":
        return None
    te = require_transformer_engine("--fp8-format")
    recipe, group = delayed_scaling_recipe(precision), amax_group(mesh)
    return lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group)


def model_init_context(precision):
    """--fp8-param-gather: the model is built inside fp8_model_init (TE modules' weights in FP8)."""
    if not precision.fp8_param_gather or backend_of(precision) == "torchao":
        return contextlib.nullcontext()
    te = require_transformer_engine("--fp8-param-gather")
    return te.fp8_model_init(enabled=True)


def attention_backend(model) -> str:
    """--transformer-impl transformer_engine selects Transformer Engine's fused attention where
    --attention-backend is left at auto (an explicit backend is kept, as Megatron's TE layers
    honour --attention-backend). `model`: the run's ModelFlags."""
    if model.transformer_impl == "transformer_engine":
        require_transformer_engine("--transformer-impl transformer_engine")
        if model.attention_backend == "auto":
            return "te"
    return model.attention_backend


# FP8 through torchao, in our own tensor-parallel linears (megatron_sp.tensor_parallel.fp8) --------

FP8_LINEARS = ("qkv", "proj", "fc1", "fc2")
"""The layers that run in FP8: attention's fused QKV and output projections, the dense MLP's two
matmuls. Never the embedding, the output layer, the norms, the MoE router or experts."""


def fp8_groups(module, mesh):
    """The Fp8Groups of a ColumnParallelLinear / RowParallelLinear on `mesh`."""
    from megatron_sp.tensor_parallel import ColumnParallelLinear
    from megatron_sp.tensor_parallel.fp8 import Fp8Groups
    tokens = mesh.dp_sp_group      # dp x cp x sp: the ranks sharing one micro-batch's tokens
    if isinstance(module, ColumnParallelLinear):
        return Fp8Groups(tokens=tokens, out_features=module.group,
                         sequence=module.group if module.sequence_parallel else None)
    return Fp8Groups(tokens=tokens, in_features=module.group)


def enable_fp8(chunks, recipe, mesh) -> int:
    """Switch the FP8_LINEARS of the model chunks to FP8 with `recipe` (an Fp8Recipe); returns how
    many layers run in FP8. Refuses --ulysses-head-chunks > 1, whose chunks bypass the layers."""
    from megatron_sp.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron_sp.tensor_parallel.fp8 import Fp8Plan
    count = 0
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if getattr(module, "head_chunks", 1) > 1:
                raise ConfigError("--fp8-format with --ulysses-head-chunks > 1: the head chunks "
                                  "multiply by slices of the QKV weight outside the FP8 linear; "
                                  "leave one of the two flags out.")
            if (isinstance(module, (ColumnParallelLinear, RowParallelLinear))
                    and name.rsplit(".", 1)[-1] in FP8_LINEARS):
                module.fp8 = Fp8Plan(recipe, fp8_groups(module, mesh))
                count += 1
    return count


TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def torchao_installed() -> bool:
    from megatron_sp.tensor_parallel.fp8 import torchao_available
    return torchao_available()


def backend_of(precision) -> str:
    """The library that runs --fp8-format: the resolved fp8_backend, else Transformer Engine
    where it is installed, else torchao."""
    if precision.fp8_backend is not None:
        return precision.fp8_backend
    return "transformer_engine" if transformer_engine_installed() else "torchao"


def resolve_backend(fp8_format, fp8_recipe, transformer_impl, fp8_param_gather=False,
                    history_len=1, compute_algo="most_recent"):
    """(backend, start-up notes) for --fp8-format; (None, []) without it. ConfigError (one
    sentence) for a recipe the backend does not run or for neither library installed.

    Transformer Engine when transformer_impl is "transformer_engine" (megatron_compat has already
    turned it into "local" where Transformer Engine is not installed), torchao otherwise.
    """
    from megatron_sp.config import check_fp8_recipe
    check_fp8_recipe(fp8_recipe)
    if fp8_format is None:
        return None, []
    if transformer_impl == "transformer_engine" and transformer_engine_installed():
        if fp8_recipe not in (None, "delayed"):
            raise ConfigError(f"--fp8-recipe {fp8_recipe} with Transformer Engine: only delayed "
                              f"runs there; pass --transformer-impl local for torchao's "
                              f"{', '.join(TORCHAO_RECIPES)} in these layers.")
        return "transformer_engine", []
    if not torchao_installed():
        raise ConfigError("--fp8-format needs NVIDIA Transformer Engine (with --transformer-impl "
                          "transformer_engine) or torchao (pip install torchao, or megatron_sp"
                          "[fp8]), and neither is installed; leave the flag out to train in bf16.")
    recipe = fp8_recipe or "tensorwise"
    if recipe not in TORCHAO_RECIPES:
        raise ConfigError(f"--fp8-recipe {recipe} needs Transformer Engine (installed, with "
                          f"--transformer-impl transformer_engine); through torchao the recipes "
                          f"that run are {', '.join(TORCHAO_RECIPES)}.")
    notes = [f"> --fp8-format {fp8_format}: through torchao, --fp8-recipe {recipe} (current "
             f"scaling) in the qkv, out-proj, fc1 and fc2 linears; embedding, output layer, norms "
             f"and MoE layers stay in high precision"]
    if history_len != 1 or compute_algo != "most_recent":
        notes.append("> --fp8-amax-history-len and --fp8-amax-compute-algo belong to the delayed "
                     "recipe (Transformer Engine): no effect with current scaling")
    if fp8_param_gather:
        notes.append("> --fp8-param-gather through torchao: weights are kept and gathered in high "
                     "precision (FP8 all-gather is not implemented here)")
    return "torchao", notes


def torchao_recipe(precision, device):
    """The Fp8Recipe of --fp8-format / --fp8-recipe / --fp8-margin; the matmuls emulated in fp32
    off CUDA (CPU: tests and checks, not speed)."""
    from megatron_sp.tensor_parallel.fp8 import Fp8Recipe
    return Fp8Recipe(format=precision.fp8_format, recipe=precision.fp8_recipe or "tensorwise",
                     margin=precision.fp8_margin, emulate=getattr(device, "type", device) != "cuda")


def check_layers_enabled(precision, chunks) -> None:
    """--fp8-format through torchao on a model none of whose linears runs in FP8 (built without
    enable_from_config): a ConfigError rather than a silent run in high precision."""
    if precision.fp8_format is None or backend_of(precision) != "torchao":
        return
    if not any(getattr(m, "fp8", None) is not None for c in chunks for m in c.modules()):
        raise ConfigError("--fp8-format through torchao: no linear layer of this model runs in "
                          "FP8; build it with megatron_sp.training.fp8.enable_from_config (as "
                          "pretrain_gpt.py does) or leave the flag out.")


def enable_from_config(chunks, precision, mesh, device) -> int:
    """--fp8-format through torchao: the FP8_LINEARS of the chunks in FP8 (enable_fp8); 0 (nothing
    done) without --fp8-format or under Transformer Engine."""
    if precision.fp8_format is None or backend_of(precision) != "torchao":
        return 0
    return enable_fp8(chunks, torchao_recipe(precision, device), mesh)
