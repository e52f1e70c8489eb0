"""What a checkpoint stores: keys, shard rectangles, model and optimizer state, RNG, metadata.

Storage format (one key per tensor, all fp32 unless trained otherwise):

    model/<param name>                 the parameter (names as in GPTModel: global layer indices)
    optim/<param name>/exp_avg         AdamW moments, sharded like their parameter
    optim/<param name>/exp_avg_sq
    optim/<param name>/step            scalar
    rng/<global rank>                  that rank's RNG streams (bytes, weights_only)

Geometry of a parameter's full shape (from its `tp_partition_dim`, `tp_chunks`, `real_rows`):
- replicated over tp: its own shape (written once: DCP de-duplicates identical rectangles);
- split over tp on dim d: the full shape, this rank's rectangle at offset tp_rank * local;
- fused projections (tp_chunks = c, SwiGLU's gate+up): stored as [c, n/c, ...] so that each rank's
  shard (one slice of every chunk) is one rectangle [c, n/(c*tp), ...];
- vocabulary rows (`real_rows` = V): the unpadded [V, H] rows only (the padding to a multiple of
  128*tp depends on tp); padding rows stay zero on load;
- expert stacks (`expert_stack`; `expert_parallel`, `ep_rank`, `ep_size`: one ep rank's E/ep
  experts): the full [E, ...] tensor, this rank's rows at offset ep_rank * E/ep on dim 0 (the edp
  replicas write the same rectangle once); w1 (`stored_parts` = 2, gate and up rows) is stored as
  [E, 2, F, H] at every expert tensor-parallel size, an etp rank's gate and up rows being one
  rectangle [E/ep, 2, F/etp, H]; so a checkpoint loads under any ep and etp.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

import torch

from megatron_sp.checkpointing.comm import global_rank
from megatron_sp.errors import UserError
from megatron_sp.sharding.fsdp import FSDPLayoutError, fsdp_rows, is_sharded

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
META_FILENAME = "megatron_sp.json"
FORMAT_VERSION = 1
RELEASE = "release"

# Model-config fields that change the parameters: they must match between checkpoint and model.
ARCHITECTURE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
    "kv_channels", "vocab_size", "normalization", "activation", "position_embedding_type",
    "add_bias_linear", "add_qkv_bias", "tie_embeddings", "qk_layernorm",
    "apply_layernorm_1p",   # 1p: the stored norm weights are gamma - 1
    "num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate")
# Fields that change the function but not the shapes (a finetune may change them on purpose,
# e.g. a longer context's RoPE base): a difference is warned about, not refused.
FUNCTION_FIELDS = ("rotary_base", "norm_epsilon", "use_rope_scaling", "rope_scaling_factor",
                   "rope_low_freq_factor", "rope_high_freq_factor",
                   "rope_original_max_position_embeddings", "yarn_rotary_scaling_factor",
                   "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
                   "yarn_mscale", "yarn_mscale_all_dim", "sliding_window", "rotary_percent",
                   "moe_router_topk", "moe_router_pre_softmax", "moe_router_score_function",
                   "moe_router_topk_scaling_factor", "moe_norm_topk_prob")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is missing, incomplete or does not fit the model: one clear sentence."""


class AgreedCheckpointError(CheckpointError):
    """A CheckpointError every rank raises with the same sentence right after a collective that
    agreed on it (comm.agree_on_error, a save's verdict): found together, so the first rank to
    report says it without waiting for the others (a loaded rank seconds behind must not turn it
    into "rank 0: ...")."""

    found_together = True


# Shard geometry ------------------------------------------------------------------------------------

@dataclass
class Shard:
    """This rank's rectangle `local` of a global tensor of shape `global_shape` at `offsets`.

    `local` is a view of the live tensor (parameter or optimizer state): loading writes into it.
    """
    local: torch.Tensor
    global_shape: torch.Size
    offsets: torch.Size


def param_shard(param: torch.Tensor, tensor: torch.Tensor, tp_rank: int, tp_size: int) -> Shard | None:
    """The stored rectangle of `tensor` (the parameter itself or a state of the same shape).

    None when this rank holds none of the stored rows (vocabulary padding only).
    """
    if is_sharded(tensor):   # FSDP2: its dp x sp rows narrow the (tp, pp) slice's rectangle
        return _fsdp_rectangle(param, tensor,
                               lambda slice_: param_shard(param, slice_, tp_rank, tp_size))
    if tuple(tensor.shape) != tuple(param.shape):
        raise CheckpointError(f"state of shape {tuple(tensor.shape)} does not match its parameter "
                              f"{tuple(param.shape)}.")
    if getattr(param, "expert_stack", False):
        return _expert_shard(param, tensor.detach(), tp_rank, tp_size)
    dim = getattr(param, "tp_partition_dim", None)
    local = tensor.detach()
    shape = list(local.shape)
    if dim is None or tp_size == 1 and getattr(param, "real_rows", None) is None \
            and getattr(param, "tp_chunks", 1) == 1:
        return Shard(local, torch.Size(shape), torch.Size([0] * len(shape)))
    chunks = getattr(param, "tp_chunks", 1)
    real_rows = getattr(param, "real_rows", None)
    if real_rows is not None:
        if dim != 0 or chunks != 1:
            raise CheckpointError("vocabulary rows must be split on dim 0 without chunks.")
        start = tp_rank * shape[0]
        rows = max(0, min(real_rows, start + shape[0]) - start)
        if rows == 0:
            return None
        offsets = [0] * len(shape)
        offsets[0] = start
        return Shard(local[:rows], torch.Size([real_rows] + shape[1:]), torch.Size(offsets))
    if chunks > 1:  # [.., n/tp, ..] = cat of c parts -> [.., c, n/(c tp), ..]
        part = shape[dim] // chunks
        view = local.unflatten(dim, (chunks, part))
        gshape = shape[:dim] + [chunks, part * tp_size] + shape[dim + 1:]
        offsets = [0] * len(gshape)
        offsets[dim + 1] = tp_rank * part
        return Shard(view, torch.Size(gshape), torch.Size(offsets))
    gshape = list(shape)
    gshape[dim] *= tp_size
    offsets = [0] * len(shape)
    offsets[dim] = tp_rank * shape[dim]
    return Shard(local, torch.Size(gshape), torch.Size(offsets))


def stored_parts(param: torch.Tensor) -> tuple[int | None, int]:
    """(dim, c): the stored tensor cuts dim `dim` of the parameter into c parts ([.., c, n/c, ..]);
    (None, 1) when stored in its own shape. Fused projections: their tp split; expert w1: dim 1."""
    if getattr(param, "stored_parts", 1) > 1:
        return 1, param.stored_parts
    chunks = getattr(param, "tp_chunks", 1)
    return (param.tp_partition_dim, chunks) if chunks > 1 else (None, 1)


def _fsdp_rectangle(param, tensor, slice_rectangle) -> Shard | None:
    """The stored rectangle of FSDP2's local shard of `tensor` (None if it holds no stored row).

    slice_rectangle(t): the checkpoint's rectangle of a whole (tp, pp) slice t (the unsharded
    geometry: tp offsets, fused parts [c, n/c, ...], unpadded vocabulary rows); FSDP2's dim-0 rows
    [row0, row0 + r) of the slice (sharding/fsdp.py fsdp_rows) then narrow it.
    """
    with torch.no_grad():
        local = tensor.detach().to_local()
        mesh = tensor.device_mesh
        num_rows = tensor.shape[0]
        row0, stop = fsdp_rows(num_rows, mesh.size(), mesh.get_local_rank())
        if stop - row0 != local.shape[0]:
            raise ValueError(f"FSDP2 shard of {tuple(tensor.shape)} holds {local.shape[0]} rows, "
                             f"expected [{row0}, {stop}).")
        base = slice_rectangle(torch.empty(tensor.shape, dtype=local.dtype, device="meta"))
        if base is None or local.shape[0] == 0:
            return None
        offsets = list(base.offsets)
        dim, parts = stored_parts(param)
        if base.local.dim() == local.dim():           # rows map to stored rows (+ tp offset)
            keep = min(local.shape[0], base.local.shape[0] - row0)   # unpadded vocabulary rows
            if keep <= 0:
                return None
            offsets[0] += row0
            return Shard(local[:keep], base.global_shape, torch.Size(offsets))
        part = tensor.shape[dim] // parts
        if dim != 0:                                  # [R, .., c, n/c, ..]: rows unaffected
            offsets[0] += row0
            return Shard(local.unflatten(dim, (parts, part)), base.global_shape,
                             torch.Size(offsets))
        first, last = row0 // part, (stop - 1) // part
        if first == last:                             # inside one part: [1, r, ...]
            offsets[0], offsets[1] = first, offsets[1] + row0 - first * part
            return Shard(local.unsqueeze(0), base.global_shape, torch.Size(offsets))
        if row0 % part or (stop - row0) % part:
            raise FSDPLayoutError(f"FSDP2 rows [{row0}, {stop}) straddle fused parts of {part}.")
        offsets[0] = first                            # whole parts: [k, n/(c tp), ...]
        return Shard(local.unflatten(0, ((stop - row0) // part, part)), base.global_shape,
                         torch.Size(offsets))


def _expert_shard(param: torch.Tensor, local: torch.Tensor, tp_rank: int, tp_size: int) -> Shard:
    """One rank's expert stack [E/ep, ...] (split over etp = tp on `tp_partition_dim` or whole) as
    its rectangle of the full [E, ...] stack: rows at ep_rank * E/ep; w1 as [E/ep, 2, F/etp, H]."""
    view = local
    parts = getattr(param, "stored_parts", 1)
    if parts > 1:
        view = local.unflatten(1, (parts, local.shape[1] // parts))   # [e, 2F', H] -> [e, 2, F', H]
    gshape, offsets = list(view.shape), [0] * view.dim()
    dim = getattr(param, "tp_partition_dim", None)
    if dim is not None and tp_size > 1:            # etp = tp: the tp split (one part's rows of each)
        dim += 1 if parts > 1 and dim >= 1 else 0
        gshape[dim] *= tp_size
        offsets[dim] = tp_rank * view.shape[dim]
    ep = getattr(param, "ep_size", 1) if getattr(param, "expert_parallel", False) else 1
    gshape[0] *= ep
    offsets[0] = getattr(param, "ep_rank", 0) * view.shape[0] if ep > 1 else 0
    return Shard(view, torch.Size(gshape), torch.Size(offsets))


def named_parameters(chunks) -> list[tuple[str, torch.nn.Parameter]]:
    """(global name, parameter) over all model chunks; names are layout-independent."""
    out, seen = [], set()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
    return out


def model_state(chunks, tp_rank: int, tp_size: int) -> dict[str, Shard]:
    state = {}
    for name, p in named_parameters(chunks):
        shard = param_shard(p, p.data, tp_rank, tp_size)
        if shard is not None:
            state[f"model/{name}"] = shard
    return state


def init_adam_state(optimizer, param):
    """Empty AdamW state of `param` (zeros, step 0) as torch's AdamW creates it on first step
    (the step on the parameter's device for fused/capturable AdamW, else on the CPU)."""
    st = optimizer.state[param]
    if "exp_avg" not in st:
        group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), {})
        on_device = group.get("fused") or group.get("capturable")
        st["step"] = torch.zeros((), dtype=torch.float32,
                                 device=param.device if on_device else "cpu")
        st["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return st


def _init_sgd_state(optimizer, param):
    """--optimizer sgd: a zero momentum buffer, which torch's SGD (dampening 0) updates exactly as
    the buffer it creates on the first step (buf = grad)."""
    st = optimizer.state[param]
    if "momentum_buffer" not in st or st["momentum_buffer"] is None:
        st["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return st


def optimizer_state(chunks, optimizer, tp_rank: int, tp_size: int, *, create: bool = False) -> dict:
    """AdamW moments (SGD: its momentum buffer) sharded like their parameters, and each
    parameter's step (scalar)."""
    if hasattr(optimizer, "checkpoint_state"):   # --use-distributed-optimizer: its rows, same keys
        return optimizer.checkpoint_state(chunks, tp_rank, tp_size, create=create)
    state = {}
    sgd = isinstance(optimizer, torch.optim.SGD)
    if sgd and not any(g.get("momentum") for g in optimizer.param_groups):
        return state                        # plain SGD keeps no state
    init, keys = ((_init_sgd_state, ("momentum_buffer",)) if sgd
                  else (init_adam_state, ("exp_avg", "exp_avg_sq")))
    for name, p in named_parameters(chunks):
        st = init(optimizer, p) if create else optimizer.state.get(p, {})
        for key in keys:
            if st.get(key) is not None:
                shard = param_shard(p, st[key], tp_rank, tp_size)
                if shard is not None:
                    state[f"optim/{name}/{key}"] = shard
        if "step" in st:
            step = st["step"]
            if not torch.is_tensor(step):
                step = st["step"] = torch.tensor(float(step))
            state[f"optim/{name}/step"] = step
    return state


# RNG (weights_only-friendly) ----------------------------------------------------------------------

def rng_to_storable(state: dict) -> dict:
    out = dict(state)
    np_state = state.get("numpy")
    if np_state is not None:
        name, keys, pos, has_gauss, cached = np_state
        out["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss),
                        float(cached))
    return out


def rng_from_storable(state: dict) -> dict:
    out = dict(state)
    if out.get("numpy") is not None:
        import numpy as np
        name, keys, pos, has_gauss, cached = out["numpy"]
        out["numpy"] = (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    if isinstance(out.get("python"), list):
        out["python"] = (out["python"][0], tuple(out["python"][1]), out["python"][2])
    return out


# Metadata --------------------------------------------------------------------------------------------

def iteration_dirname(iteration: int | str) -> str:
    return RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"


def read_meta(folder: str, advice: str = "save it again or load another checkpoint.") -> dict:
    """The folder's megatron_sp.json; a damaged one is refused naming the file, then `advice`."""
    path = os.path.join(folder, META_FILENAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder} is not a megatron_sp checkpoint: {META_FILENAME} is missing.")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = f"line {err.lineno} column {err.colno}" if hasattr(err, "lineno") else "its bytes"
        raise CheckpointError(f"checkpoint file {path} is damaged (not valid JSON at {where}): "
                              f"{advice}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint file {path} is damaged (not a JSON object): {advice}")
    return meta


def jsonable(value):
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def check_config(saved: dict | None, config, where: str) -> None:
    """Refuse a checkpoint whose model shapes differ from the model's, naming the fields."""
    if saved is None or config is None:
        return
    current = config.to_dict()
    fields = list(ARCHITECTURE_FIELDS)
    if current.get("position_embedding_type") == "learned_absolute":
        fields.append("max_position_embeddings")
    diffs = [f"{_flag_of(k)} {saved.get(k)!r} in the checkpoint but {current.get(k)!r} from the "
             f"command line" for k in fields if k in saved and not _same(k, saved, current)]
    if diffs:
        raise CheckpointError(f"checkpoint {where} does not fit the model: " + "; ".join(diffs)
                              + " (pass the checkpoint's values, or --use-checkpoint-args).")
    changed = [f"{_flag_of(k)} {saved[k]!r} in the checkpoint but {current.get(k)!r} now"
               for k in FUNCTION_FIELDS if k in saved and saved[k] != current.get(k)]
    if changed and global_rank() == 0:
        print(f"warning: checkpoint {where} was trained with other settings: " + "; ".join(changed)
              + " (pass the checkpoint's values, or --use-checkpoint-args, unless this is intended).",
              file=sys.stderr, flush=True)


def _same(key: str, saved: dict, current: dict) -> bool:
    """Whether field `key` agrees; --moe-layer-freq by the layers it makes MoE (1 and [1, 1] on
    two layers are the same model)."""
    if key == "moe_layer_freq" and saved.get("num_layers") == current.get("num_layers"):
        layers = current.get("num_layers")
        return _moe_pattern(saved.get(key), layers) == _moe_pattern(current.get(key), layers)
    return saved.get(key) == current.get(key)


def _moe_pattern(freq, layers) -> list | None:
    """[0/1 per layer] of a --moe-layer-freq (an integer k: every k-th layer from 0; a list)."""
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0 and isinstance(layers, int):
        return [int(i % freq == 0) for i in range(layers)]
    return [int(v) for v in freq] if isinstance(freq, (list, tuple)) else freq


# Config fields whose flag is not "--" + the field name with dashes.
_FIELD_FLAGS = {"vocab_size": "the vocabulary (tokenizer or --vocab-size)",
                "activation": "the activation (--swiglu / --openai-gelu)",
                "add_bias_linear": "--disable-bias-linear", "tie_embeddings":
                "--untie-embeddings-and-output-weights", "qk_layernorm": "--qk-layernorm",
                "sliding_window": "the sliding window (from the converted checkpoint)",
                "rope_low_freq_factor": "the llama3 low-frequency factor (no flag)",
                "rope_high_freq_factor": "the llama3 high-frequency factor (no flag)",
                "rope_original_max_position_embeddings": "the llama3 original context (no flag)"}


def _flag_of(field: str) -> str:
    """The command-line flag (or a description) that sets a model config field."""
    return _FIELD_FLAGS.get(field, "--" + field.replace("_", "-"))


# LRScheduler attributes that make the learning-rate schedule, with the flags that set them.
SCHEDULE_FLAGS = {
    "max_lr": "--lr", "min_lr": "--min-lr",
    "warmup_iters": "--lr-warmup-iters (or --lr-warmup-fraction)",
    "decay_iters": "--lr-decay-iters (or --train-iters, its default)",
    "style": "--lr-decay-style", "wsd_decay_iters": "--lr-wsd-decay-iters"}
OVERRIDE_FLAG = "--override-opt_param-scheduler"
USE_CHECKPOINT_FLAG = "--use-checkpoint-opt_param-scheduler"


def schedule_to_load(saved: dict, scheduler, policy: str | None, where: str) -> dict:
    """The scheduler state to load from the checkpoint's `saved` one, as Megatron-LM decides:
    with `policy` "override" (--override-opt_param-scheduler) the command line's schedule stays
    and only the step count is loaded; with "checkpoint" (--use-checkpoint-opt_param-scheduler)
    the checkpoint's schedule replaces the command line's; without a policy a schedule that
    differs is refused, naming the flags (the learning rate would jump mid-run)."""
    diffs = [(k, flag, getattr(scheduler, k, None), saved[k]) for k, flag in SCHEDULE_FLAGS.items()
             if k in saved and saved[k] != getattr(scheduler, k, None)]
    listed = "; ".join(f"{flag} {now!r} now but {then!r} in the checkpoint"
                       for _, flag, now, then in diffs)
    if diffs and policy in ("override", "checkpoint") and global_rank() == 0:
        flag, which = ((OVERRIDE_FLAG, "the command line's") if policy == "override" else
                       (USE_CHECKPOINT_FLAG, "the checkpoint's"))
        print(f"> {flag}: the learning-rate schedule differs ({listed}); {which} is used",
              flush=True)
    if not diffs or policy == "checkpoint":
        return saved
    if policy == "override":
        return {"num_steps": saved["num_steps"]}
    raise CheckpointError(f"the learning-rate schedule differs from the one of checkpoint {where} "
                          f"({listed}): pass {OVERRIDE_FLAG} to follow the command line or "
                          f"{USE_CHECKPOINT_FLAG} to keep the checkpoint's schedule.")
