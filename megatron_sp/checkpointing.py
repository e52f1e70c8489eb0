"""Distributed checkpoints: torch.distributed.checkpoint (DCP) with layout-independent keys.

Every tensor is stored under its global name with its *full* (unsharded, layout-independent)
shape; each rank writes the rectangle it holds, and DCP reads back whatever rectangles another
layout needs. A checkpoint saved with any (tp, sp, pp, dp) therefore loads into any other.

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
  128*tp depends on tp); padding rows stay zero on load.

Folder layout (Megatron's): <save>/iter_0000100/ with DCP's files (.metadata, __<rank>_0.distcp)
plus megatron_sp.json (iteration, consumed samples, scheduler, layout, model config, arguments);
<save>/latest_checkpointed_iteration.txt names the newest complete one ("release" for converted
weights, loaded as iteration 0 without optimizer or RNG). Saving is atomic: everything is written
to iter_XXXXXXX.tmp, renamed when complete, and the tracker is replaced last, so a crash during a
save leaves the previous checkpoint loadable.

Security: DCP's .metadata file is a pickle. Load checkpoints only from sources you would trust
with code. Tensors and RNG bytes are read with torch.load(weights_only=True).

This module is part of the core: it does not import the models; it works on any nn.Module chunks
whose parameters carry the tensor-parallel attributes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
META_FILENAME = "megatron_sp.json"
FORMAT_VERSION = 1
RELEASE = "release"

# Model-config fields that change the parameters: they must match between checkpoint and model.
ARCHITECTURE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
    "kv_channels", "vocab_size", "normalization", "activation", "position_embedding_type",
    "add_bias_linear", "add_qkv_bias", "tie_embeddings")
# Fields that change the function but not the shapes (a finetune may change them on purpose,
# e.g. a longer context's RoPE base): a difference is warned about, not refused.
FUNCTION_FIELDS = ("rotary_base", "norm_epsilon")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not fit the model: one clear sentence."""


# Distributed helpers -------------------------------------------------------------------------------

def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _barrier():
    if _dist():
        dist.barrier()


def _broadcast_object(obj, src: int = 0):
    if not _dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def any_rank_flag(flags, group=None) -> list[bool]:
    """All-reduce (MAX) a few boolean flags over `group` (default: the world); one collective.

    Used once per iteration so that every rank agrees to save and exit when any rank received a
    signal or ran out of time. Returns the agreed flags.
    """
    t = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float32)
    if _dist():
        if dist.get_backend(group) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.cpu().tolist()]


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
    if tuple(tensor.shape) != tuple(param.shape):
        raise CheckpointError(f"state of shape {tuple(tensor.shape)} does not match its parameter "
                              f"{tuple(param.shape)}.")
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


def _init_adam_state(optimizer, param):
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


def optimizer_state(chunks, optimizer, tp_rank: int, tp_size: int, *, create: bool = False) -> dict:
    """AdamW moments sharded like their parameters, and each parameter's step (scalar)."""
    state = {}
    for name, p in named_parameters(chunks):
        st = _init_adam_state(optimizer, p) if create else optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
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

def _rng_to_storable(state: dict) -> dict:
    out = dict(state)
    np_state = state.get("numpy")
    if np_state is not None:
        name, keys, pos, has_gauss, cached = np_state
        out["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss),
                        float(cached))
    return out


def _rng_from_storable(state: dict) -> dict:
    out = dict(state)
    if out.get("numpy") is not None:
        import numpy as np
        name, keys, pos, has_gauss, cached = out["numpy"]
        out["numpy"] = (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    if isinstance(out.get("python"), list):
        out["python"] = (out["python"][0], tuple(out["python"][1]), out["python"][2])
    return out


# DCP planners ---------------------------------------------------------------------------------------

def _planners():
    """Save/load planners that understand `Shard` (imported lazily: DCP is a heavy import)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                       MetadataIndex, TensorProperties)
    from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData,
                                                      WriteItem, WriteItemType)
    from torch.distributed.checkpoint.planner_helpers import (_create_read_items,
                                                              _create_write_items,
                                                              create_read_items_for_chunk_list)

    class ShardSavePlanner(DefaultSavePlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self):
            items = []
            for fqn, obj in self.state_dict.items():
                if isinstance(obj, Shard):
                    items.append(WriteItem(
                        index=MetadataIndex(fqn, obj.offsets), type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=obj.offsets, sizes=obj.local.shape),
                            properties=TensorProperties.create_from_tensor(obj.local),
                            size=obj.global_shape)))
                else:
                    items.extend(_create_write_items(fqn, obj))
            self.plan = SavePlan(items)
            return self.plan

        def lookup_object(self, index):
            obj = self.state_dict[index.fqn]
            if isinstance(obj, Shard):
                return obj.local.contiguous()
            return super().lookup_object(index)

    class ShardLoadPlanner(DefaultLoadPlanner):
        def __init__(self, where: str):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.where = where

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            # Not DefaultLoadPlanner's: its meta-tensor pass turns unknown leaves (Shard) into None.
            self.original_state_dict = self.state_dict = state_dict
            self.metadata, self.is_coordinator = metadata, is_coordinator

        def create_local_plan(self):
            requests = []
            stored = self.metadata.state_dict_metadata
            for fqn, obj in self.state_dict.items():
                if fqn not in stored:
                    raise CheckpointError(
                        f"checkpoint {self.where} has no tensor {fqn.split('/', 1)[-1]!r} "
                        f"({fqn.split('/')[0]} state): it is incomplete or of a different model.")
                md = stored[fqn]
                if isinstance(obj, Shard):
                    if isinstance(md, BytesStorageMetadata):
                        raise CheckpointError(f"checkpoint {self.where} stores {fqn!r} as bytes, "
                                              f"not as a tensor.")
                    if tuple(md.size) != tuple(obj.global_shape):
                        raise CheckpointError(
                            f"tensor {fqn.split('/', 1)[-1]!r} has shape {tuple(md.size)} in "
                            f"checkpoint {self.where} but shape {tuple(obj.global_shape)} in the "
                            f"model being loaded.")
                    chunk = ChunkStorageMetadata(offsets=obj.offsets, sizes=obj.local.shape)
                    requests += create_read_items_for_chunk_list(fqn, md, [chunk])
                else:
                    requests += _create_read_items(fqn, md, obj)
            return LoadPlan(requests)

        def lookup_tensor(self, index):
            obj = self.state_dict[index.fqn]
            return obj.local if isinstance(obj, Shard) else super().lookup_tensor(index)

        def load_bytes(self, read_item, value):
            self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    return ShardSavePlanner, ShardLoadPlanner


@contextlib.contextmanager
def _dcp_errors():
    """Quiet DCP's one-process warning; re-raise our own error out of DCP's per-rank wrapper."""
    from torch.distributed.checkpoint.api import CheckpointException
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as err:
            for failure in getattr(err, "failures", {}).values():
                exc = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(exc, CheckpointError):
                    raise CheckpointError(str(exc)) from None
            raise


def _dcp_save(state: dict, path: str):
    import torch.distributed.checkpoint as dcp
    save_planner, _ = _planners()
    with _dcp_errors():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, single_file_per_rank=True),
                 planner=save_planner(), no_dist=not _dist())


class _CloneStager:
    """DCP async stager: a private host copy of every Shard and tensor, so that training can go on
    changing the live ones while the background thread writes (DCP's own stager drops Shards)."""
    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict):
        import copy
        out = {}
        for k, v in state_dict.items():
            if isinstance(v, Shard):
                out[k] = Shard(v.local.detach().to("cpu", copy=True), v.global_shape, v.offsets)
            elif torch.is_tensor(v):
                out[k] = v.detach().to("cpu", copy=True)
            else:
                out[k] = copy.deepcopy(v)
        return out

    def synchronize_staging(self):
        pass

    def close(self):
        pass


def _dcp_async_save(state: dict, path: str, group):
    """Write in a background thread over `group`, a dedicated gloo group (the mesh's
    background_group), so that its collectives never interleave with the training's."""
    import torch.distributed.checkpoint as dcp
    save_planner, _ = _planners()
    staged = _CloneStager().stage(state)
    return dcp.async_save(staged, storage_writer=dcp.FileSystemWriter(path, single_file_per_rank=True),
                          planner=save_planner(), process_group=group,
                          async_stager=_CloneStager())


def _dcp_load(state: dict, path: str, local: bool = False):
    """Read `state` from `path`; collective over the world unless `local` (one process reads)."""
    import torch.distributed.checkpoint as dcp
    _, load_planner = _planners()
    with _dcp_errors():
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=load_planner(path),
                 no_dist=local or not _dist())
    return state


# Folder layout ----------------------------------------------------------------------------------------

def iteration_dirname(iteration: int | str) -> str:
    return RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"


def read_tracker(root: str) -> int | str | None:
    """The iteration named by <root>/latest_checkpointed_iteration.txt (None when absent)."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} should hold an iteration number or 'release', "
                              f"found {text!r}.") from None


def resolve_checkpoint(path: str) -> str | None:
    """The checkpoint folder for `path`: a root with a tracker, or an iteration folder itself.

    None when `path` holds no checkpoint at all; CheckpointError when the tracker names a folder
    that is missing or incomplete.
    """
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    iteration = read_tracker(path)
    if iteration is None:
        return None
    folder = os.path.join(path, iteration_dirname(iteration))
    if not os.path.isfile(os.path.join(folder, ".metadata")) or \
            not os.path.isfile(os.path.join(folder, META_FILENAME)):
        raise CheckpointError(f"{os.path.join(path, TRACKER_FILENAME)} names iteration {iteration}, "
                              f"but {folder} is missing or incomplete (no .metadata or "
                              f"{META_FILENAME}).")
    return folder


def read_meta(folder: str) -> dict:
    path = os.path.join(folder, META_FILENAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder} is not a megatron_sp checkpoint: {META_FILENAME} is missing.")
    with open(path) as f:
        return json.load(f)


def _write_text_atomic(path: str, text: str):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str):
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


# Save ----------------------------------------------------------------------------------------------

class _PendingSave:
    """An asynchronous save whose files are still being written; `finalize()` publishes it."""

    def __init__(self, future, root, iteration, tmp, final, meta):
        self.future, self.root, self.iteration = future, root, iteration
        self.tmp, self.final, self.meta = tmp, final, meta

    def finalize(self):
        if self.future is not None:
            self.future.result()
            self.future = None
        _publish(self.root, self.iteration, self.tmp, self.final, self.meta)


_pending: _PendingSave | None = None


def _publish(root, iteration, tmp, final, meta):
    """Every rank has written its files: rank 0 renames the folder, then replaces the tracker."""
    _barrier()
    if _rank() == 0:
        _write_text_atomic(os.path.join(tmp, META_FILENAME), json.dumps(meta, indent=1))
        if os.path.exists(final):           # saving an iteration again: move the old one away
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        _write_text_atomic(os.path.join(root, TRACKER_FILENAME), str(iteration))
    _barrier()


def finalize_async_save():
    """Wait for an asynchronous save in flight and publish it (every rank calls this)."""
    global _pending
    if _pending is not None:
        pending, _pending = _pending, None
        pending.finalize()


def save_checkpoint(root: str, iteration: int | str, chunks, mesh, *, optimizer=None, scheduler=None,
                    train_state=None, config=None, args=None, rng_tracker=None,
                    async_save: bool = False) -> str:
    """Save model (+ optimizer, scheduler, train state, RNG) under <root>/iter_XXXXXXX (collective).

    Every rank of the world calls this. Returns the final folder. With `async_save` the files are
    written in the background; the checkpoint appears (folder renamed, tracker updated) at the next
    save or at `finalize_async_save()`.
    """
    global _pending
    finalize_async_save()
    t0 = time.time()
    name = iteration_dirname(iteration)
    final = os.path.join(root, name)
    tmp = final + ".tmp"
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)   # leftovers of a save that crashed
        os.makedirs(tmp)
    _barrier()
    state: dict[str, Any] = model_state(chunks, mesh.tp_rank, mesh.tp_size)
    if optimizer is not None:
        state.update(optimizer_state(chunks, optimizer, mesh.tp_rank, mesh.tp_size))
    if rng_tracker is not None or optimizer is not None:
        from megatron_sp.tensor_parallel.random import get_rng_state
        state[f"rng/{mesh.rank}"] = _rng_to_storable(get_rng_state(rng_tracker))
    d = mesh.dims
    meta = {
        "format": "megatron_sp", "format_version": FORMAT_VERSION,
        "iteration": iteration if iteration == RELEASE else int(iteration),
        "layout": {"tp": d.tp, "sp": d.sp, "dp": d.dp, "pp": d.pp, "world_size": d.world_size},
        "has_optimizer": optimizer is not None,
        "has_rng": f"rng/{mesh.rank}" in state,
        "train_state": dataclasses.asdict(train_state) if train_state is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "config": config.to_dict() if config is not None else None,
        "args": _jsonable(vars(args)) if args is not None else None,
        "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if async_save and _dist():
        future = _dcp_async_save(state, tmp, mesh.background_group())
        _pending = _PendingSave(future, root, iteration, tmp, final, meta)
        if _rank() == 0:
            print(f"> saving checkpoint {final} in the background (staged in "
                  f"{time.time() - t0:.2f} s)", flush=True)
        return final
    _dcp_save(state, tmp)
    _publish(root, iteration, tmp, final, meta)
    if _rank() == 0:
        print(f"> saved checkpoint {final} in {time.time() - t0:.2f} s", flush=True)
    return final


# Load ----------------------------------------------------------------------------------------------

def check_config(saved: dict | None, config, where: str) -> None:
    """Refuse a checkpoint whose model shapes differ from the model's, naming the fields."""
    if saved is None or config is None:
        return
    current = config.to_dict()
    fields = list(ARCHITECTURE_FIELDS)
    if current.get("position_embedding_type") == "learned_absolute":
        fields.append("max_position_embeddings")
    diffs = [f"{k}={saved.get(k)!r} in the checkpoint but {current.get(k)!r} from the model flags"
             for k in fields if k in saved and saved.get(k) != current.get(k)]
    if diffs:
        raise CheckpointError(f"checkpoint {where} does not fit the model: " + "; ".join(diffs) + ".")
    changed = [f"{k}={saved[k]!r} in the checkpoint but {current.get(k)!r} now"
               for k in FUNCTION_FIELDS if k in saved and saved[k] != current.get(k)]
    if changed and _rank() == 0:
        print(f"warning: checkpoint {where} was trained with other settings: " + "; ".join(changed)
              + " (pass the checkpoint's values, e.g. --rotary-base, unless this is intended).",
              file=sys.stderr, flush=True)


def load_checkpoint(path: str, chunks, mesh, *, optimizer=None, scheduler=None, train_state=None,
                    config=None, rng_tracker=None, load_optim: bool = True, load_rng: bool = True,
                    finetune: bool = False, missing_ok: bool = True) -> dict | None:
    """Load a checkpoint saved in any layout into this one (collective). Returns its metadata.

    `path`: the --load root (tracker) or an iteration folder. With no checkpoint there at all,
    returns None (Megatron starts from scratch) unless `missing_ok` is False. `finetune` (and a
    'release' checkpoint) loads the weights only and keeps iteration 0.
    """
    if not os.path.exists(path):
        if missing_ok:
            return None
        raise CheckpointError(f"checkpoint path {path} does not exist.")
    folder = resolve_checkpoint(path)
    if folder is None:
        if missing_ok:
            return None
        raise CheckpointError(f"{path} holds no checkpoint ({TRACKER_FILENAME} is missing).")
    meta = read_meta(folder)
    check_config(meta.get("config"), config, folder)
    release = meta.get("iteration") == RELEASE
    weights_only = finetune or release
    state: dict[str, Any] = model_state(chunks, mesh.tp_rank, mesh.tp_size)
    with_optim = optimizer is not None and load_optim and not weights_only and meta.get("has_optimizer")
    if optimizer is not None and load_optim and not weights_only and not meta.get("has_optimizer"):
        raise CheckpointError(f"checkpoint {folder} holds no optimizer state: load it with "
                              f"--finetune or --no-load-optim.")
    if with_optim:
        state.update(optimizer_state(chunks, optimizer, mesh.tp_rank, mesh.tp_size, create=True))
    saved_layout = meta.get("layout", {})
    same_layout = all(saved_layout.get(k) == v for k, v in
                      (("tp", mesh.tp_size), ("sp", mesh.sp_size), ("dp", mesh.dp_size),
                       ("pp", mesh.pp_size)))
    rng_key = f"rng/{mesh.rank}"
    with_rng = load_rng and not weights_only and meta.get("has_rng") and same_layout
    if with_rng:
        state[rng_key] = None
    _dcp_load(state, folder)
    if not weights_only:
        if scheduler is not None and meta.get("scheduler") is not None:
            scheduler.load_state_dict(meta["scheduler"])
        if train_state is not None and meta.get("train_state") is not None:
            for k, v in meta["train_state"].items():
                if hasattr(train_state, k):
                    setattr(train_state, k, v)
    if with_rng:
        from megatron_sp.tensor_parallel.random import set_rng_state
        set_rng_state(_rng_from_storable(state[rng_key]), rng_tracker)
    elif load_rng and not weights_only and meta.get("has_rng") and _rank() == 0:
        print(f"> layout changed ({saved_layout} -> tp={mesh.tp_size} sp={mesh.sp_size} "
              f"dp={mesh.dp_size} pp={mesh.pp_size}): RNG states not restored (they are per rank).",
              flush=True)
    if _rank() == 0:
        what = "weights only" if weights_only else ("weights, optimizer" if with_optim else "weights")
        print(f"> loaded checkpoint {folder} ({what}) at iteration {meta.get('iteration')}",
              flush=True)
    return meta


# One-process access (conversion, inference) --------------------------------------------------------

def read_full_tensors(path: str, prefix: str = "model/") -> dict[str, torch.Tensor]:
    """Every stored tensor under `prefix` at its full stored shape (one process; no process group).

    Fused projections come back as [c, n/c, ...] and vocabulary rows unpadded; see the module
    docstring. For a ready model use `megatron_sp.load_pretrained`.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    folder = resolve_checkpoint(path)
    if folder is None:
        raise CheckpointError(f"{path} holds no checkpoint ({TRACKER_FILENAME} is missing).")
    with _dcp_errors():
        md = FileSystemReader(folder).read_metadata()
    state = {k: Shard(torch.empty(m.size, dtype=m.properties.dtype), m.size,
                      torch.Size([0] * len(m.size)))
             for k, m in md.state_dict_metadata.items()
             if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    _dcp_load(state, folder, local=True)
    return {k[len(prefix):]: v.local for k, v in state.items()}


def load_pretrained(path: str, *, device="cpu", dtype: torch.dtype | None = None,
                    attention_backend: str = "sdpa"):
    """A one-rank GPTModel (eval mode) from a checkpoint of any layout or a consolidated export.

    `path`: a --save root (newest checkpoint), an iter_XXXXXXX / release folder, or a
    model.safetensors written by `export_safetensors` / convert.py --saver safetensors. Reads only
    this process's files (no process group needed, none used even when one exists).
    """
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import GPTConfig, GPTModel
    if os.path.isfile(path) and path.endswith(".safetensors"):
        from safetensors import safe_open
        with safe_open(path, framework="pt") as f:
            md = f.metadata() or {}
            if "megatron_sp_config" not in md:
                raise CheckpointError(f"{path} is not a megatron_sp export (no megatron_sp_config "
                                      f"in its metadata).")
            config = GPTConfig.from_dict(json.loads(md["megatron_sp_config"]))
            model = GPTModel(config, ParallelMesh.single(), attention_backend=attention_backend)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name not in f.keys():
                        raise CheckpointError(f"{path} has no tensor {name!r}.")
                    t = f.get_tensor(name)
                    rows = getattr(p, "real_rows", None)
                    want = (rows,) + tuple(p.shape[1:]) if rows else tuple(p.shape)
                    if tuple(t.shape) != want:
                        raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)} in {path} "
                                              f"but shape {want} in the model.")
                    (p[:rows] if rows else p).copy_(t)
    else:
        folder = resolve_checkpoint(path) if os.path.exists(path) else None
        if folder is None:
            raise CheckpointError(f"{path} holds no checkpoint ({TRACKER_FILENAME} or .metadata "
                                  f"missing).")
        meta = read_meta(folder)
        if not meta.get("config"):
            raise CheckpointError(f"checkpoint {folder} records no model config.")
        config = GPTConfig.from_dict(meta["config"])
        model = GPTModel(config, ParallelMesh.single(), attention_backend=attention_backend)
        _dcp_load(model_state([model], 0, 1), folder, local=True)
    model.eval()
    return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)


def export_safetensors(path: str, out_file: str) -> str:
    """Write one consolidated model.safetensors (our names, full shapes, vocabulary unpadded, the
    model config in its metadata) from a checkpoint of any layout; `load_pretrained` reads it."""
    from safetensors.torch import save_file
    model = load_pretrained(path)
    tensors = {}
    for name, p in model.named_parameters():
        rows = getattr(p, "real_rows", None)
        tensors[name] = (p[:rows] if rows else p).detach().contiguous()
    os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
    save_file(tensors, out_file, metadata={"format": "pt", "megatron_sp_config":
                                           json.dumps(model.config.to_dict())})
    return out_file


# Pre-emption ---------------------------------------------------------------------------------------

class SignalHandler:
    """Record SIGTERM / SIGUSR1 instead of dying; the loop saves and exits at an iteration's end."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1)):
        self.received = None
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum
        print(f"> rank {_rank()}: received signal {signal.Signals(signum).name}; will save and exit "
              f"at the end of this iteration", file=sys.stderr, flush=True)

    def release(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


# The training loop's side: --save/--load/--save-interval and the exit conditions -------------------

class CheckpointManager:
    """Megatron's checkpoint and exit flags around a `Trainer` (one per run, every rank).

        manager = CheckpointManager(args, trainer, config)
        manager.load()                       # --load (--no-load-optim, --no-load-rng, --finetune)
        while ...: trainer.train_step(...); if manager.after_step(): break
        manager.finish()                     # final save, async saves published, handlers released

    After each iteration the ranks agree (one all-reduce of two flags, `any_rank_flag`) on whether a
    signal arrived (--exit-signal-handler) or --exit-duration-in-mins is spent; together with
    --exit-interval and --save-interval that decides to save (when --save is given) and to stop.
    """

    def __init__(self, args, trainer, config=None):
        self.args, self.trainer, self.config = args, trainer, config
        self.mesh = trainer.mesh
        self.start_time = time.time()
        self.last_saved = None
        self.exit_reason = None
        self.signals = SignalHandler() if getattr(args, "exit_signal_handler", False) else None

    def _rng_tracker(self):
        return getattr(self.trainer.chunks[0], "rng_tracker", None)

    def load(self) -> dict | None:
        a, t = self.args, self.trainer
        if not getattr(a, "load", None):
            return None
        meta = load_checkpoint(a.load, t.chunks, self.mesh, optimizer=t.optimizer,
                               scheduler=t.scheduler, train_state=t.state, config=self.config,
                               rng_tracker=self._rng_tracker(), load_optim=not a.no_load_optim,
                               load_rng=not a.no_load_rng, finetune=a.finetune)
        if meta is None and _rank() == 0:
            print(f"> no checkpoint found under --load {a.load}: starting from scratch", flush=True)
        self.last_saved = t.state.iteration if meta is not None and not a.finetune else None
        return meta

    def save(self):
        a, t = self.args, self.trainer
        if not getattr(a, "save", None) or self.last_saved == t.state.iteration:
            return
        save_checkpoint(a.save, t.state.iteration, t.chunks, self.mesh, optimizer=t.optimizer,
                        scheduler=t.scheduler, train_state=t.state, config=self.config, args=a,
                        rng_tracker=self._rng_tracker(), async_save=getattr(a, "async_save", False))
        self.last_saved = t.state.iteration

    def after_step(self) -> bool:
        """Save and/or decide to stop after an iteration; True means leave the training loop."""
        a, it = self.args, self.trainer.state.iteration
        duration = getattr(a, "exit_duration_in_mins", None)
        signal_flag, time_flag = False, False
        if self.signals is not None or duration:
            local_time = bool(duration) and (time.time() - self.start_time) / 60.0 > duration
            local_signal = self.signals is not None and self.signals.received is not None
            signal_flag, time_flag = any_rank_flag([local_signal, local_time])
        interval = getattr(a, "exit_interval", None)
        if signal_flag:
            self.exit_reason = "a signal (SIGTERM/SIGUSR1)"
        elif time_flag:
            self.exit_reason = f"--exit-duration-in-mins {duration}"
        elif interval and it % interval == 0:
            self.exit_reason = f"--exit-interval {interval}"
        save_interval = getattr(a, "save_interval", None)
        if self.exit_reason or (save_interval and it % save_interval == 0):
            self.save()
        if self.exit_reason and _rank() == 0:
            print(f"> exiting at iteration {it} after {self.exit_reason}", flush=True)
        return self.exit_reason is not None

    def finish(self):
        """End of training: save the last iteration, publish an async save, release handlers."""
        if self.trainer.state.iteration > 0 or self.exit_reason:
            self.save()
        finalize_async_save()
        if self.signals is not None:
            self.signals.release()
