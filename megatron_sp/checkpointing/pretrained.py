"""One-process access to a checkpoint of any layout (conversion, inference): a ready one-rank
model, a consolidated safetensors export."""
from __future__ import annotations

import json
import os

import torch

from megatron_sp.checkpointing.format import (META_FILENAME, TRACKER_FILENAME, CheckpointError,
                                              model_state, read_meta)
from megatron_sp.checkpointing.integrity import require_digests, verify_files
from megatron_sp.checkpointing.io import dcp_load, fallback_advice, resolve_checkpoint
from megatron_sp.checkpointing.planners import dcp_errors


def _open_local(folder: str, verify: bool = True):
    """(megatron_sp.json or None, (checksums, advice) or None, advice) of `folder`, its .metadata
    verified against the checksums recorded at save unless not `verify` (shard files are verified
    as they are planned). The advice names an earlier iteration folder (not a training flag)."""
    advice = fallback_advice(folder, training=False)
    if not os.path.isfile(os.path.join(folder, META_FILENAME)):
        return None, None, advice
    meta = read_meta(folder, advice)
    checksums = (meta.get("checksums") or {}).get("files") if verify else None
    if checksums is None:
        return meta, None, advice
    require_digests(checksums, folder, "pass verify=False to load it unverified")
    verify_files(folder, [".metadata"], checksums, advice)
    return meta, (checksums, advice), advice


def _read_dcp_metadata(folder: str, advice: str):
    """DCP's .metadata of `folder`; any failure to read or unpickle it (a damaged file of a
    checkpoint without checksums, or unverified) is one CheckpointError naming the file."""
    from torch.distributed.checkpoint import FileSystemReader
    path = os.path.join(folder, ".metadata")
    try:
        with dcp_errors(folder, advice):
            return FileSystemReader(folder).read_metadata()
    except CheckpointError:
        raise
    except Exception as err:   # EOFError, UnpicklingError, AttributeError...: its first line
        text = (str(err).strip().splitlines() or [""])[0][:160]
        raise CheckpointError(f"checkpoint file {path} could not be read ({type(err).__name__}"
                              f"{': ' + text if text else ''}): {advice}") from None


def load_pretrained(path: str, *, device="cpu", dtype: torch.dtype | None = None,
                    attention_backend: str = "sdpa", verify: bool = True):
    """A one-rank GPTModel (eval mode) from a checkpoint of any layout or a consolidated export.

    `path`: a --save root (newest checkpoint), an iter_XXXXXXX / release folder, a
    model.safetensors written by `export_safetensors` / convert.py --saver safetensors, or a Hugging
    Face model folder of a supported family (megatron_sp.models.families). Reads only
    this process's files (no process group needed, none used even when one exists). `verify`:
    check a checkpoint's files against the checksums recorded at save before reading them.
    """
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import GPTConfig, GPTModel
    from megatron_sp.models import families
    try:
        hf_folder = os.path.isdir(path) and families.is_hf_folder(path)
        model = families.load_hf_folder(path, attention_backend) if hf_folder else None
    except families.ConversionError as err:      # a config.json that is not JSON, ...
        raise CheckpointError(str(err)) from None
    if hf_folder:
        return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
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
        meta, checks, advice = _open_local(folder, verify)
        if not (meta or {}).get("config"):
            raise CheckpointError(f"checkpoint {folder} records no model config.")
        if checks is None:   # unverified: a damaged .metadata is named as such, not by DCP
            _read_dcp_metadata(folder, advice)
        config = GPTConfig.from_dict(meta["config"])
        model = GPTModel(config, ParallelMesh.single(), attention_backend=attention_backend)
        dcp_load(model_state([model], 0, 1), folder, local=True, verify=checks, advice=advice)
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
    from megatron_sp.fileutil import publish, temporary_name
    os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
    tmp = temporary_name(out_file)       # the user's umask, renamed when complete
    save_file(tensors, tmp, metadata={"format": "pt", "megatron_sp_config":
                                      json.dumps(model.config.to_dict())})
    return publish(tmp, out_file)
