"""Hugging Face weight files (model.safetensors, its sharded index, pytorch_model.bin read
weights-only): the tensors, or one CheckpointError sentence naming the file. Used by the model
families' conversion (models/families.py) and nothing of the models imported here."""
from __future__ import annotations

import json
import os

import torch

from megatron_sp.checkpointing.format import CheckpointError


def _first_line(err: BaseException) -> str:
    text = (str(err).strip().splitlines() or [""])[0]
    return text if len(text) <= 160 else text[:157] + "..."


def _blocked_global(err: BaseException) -> str:
    """The line of torch's weights-only refusal that names what the pickle asked for."""
    for line in str(err).splitlines():
        if "GLOBAL" in line or "Unsupported" in line or "unsupported" in line:
            return line.strip().rstrip(".")
    return _first_line(err).rstrip(".")


def read_weight_file(file: str) -> dict[str, torch.Tensor]:
    """The tensors of one weight file (.safetensors, or a .bin read with weights_only=True); a
    missing, truncated or refused file is one CheckpointError naming it."""
    if not os.path.isfile(file):
        raise CheckpointError(f"weight file {file} does not exist; download or copy it again.")
    try:
        if file.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(file)
        return torch.load(file, map_location="cpu", weights_only=True)
    except OSError as err:
        raise CheckpointError(f"weight file {file} cannot be read ({err.strerror or err}); check "
                              f"its permissions and disk.") from None
    except Exception as err:
        import pickle
        if isinstance(err, pickle.UnpicklingError) and "weights only" in str(err).lower():
            raise CheckpointError(
                f"weight file {file} is refused: its pickle asks for more than tensors "
                f"({_blocked_global(err)}), and .bin weights are read with "
                f"torch.load(weights_only=True) only; convert it to model.safetensors with a tool "
                f"you trust (save_pretrained(..., safe_serialization=True)).") from None
        size = os.path.getsize(file)
        raise CheckpointError(f"weight file {file} ({size} bytes) cannot be read "
                              f"({type(err).__name__}: {_first_line(err).rstrip('.')}): it is "
                              f"truncated or damaged; download or copy it again.") from None


def read_hf_weights(path: str) -> dict[str, torch.Tensor]:
    """The state dict of a Hugging Face model folder: model.safetensors, the shards named by
    model.safetensors.index.json (all checked to exist before any is read), or pytorch_model.bin
    (weights_only). CheckpointError (one sentence naming the file) for any failure; None-free."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        return read_weight_file(single)
    if os.path.isfile(index):
        try:
            with open(index, "rb") as f:
                names = sorted(set(json.loads(f.read().decode("utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{index} is not a safetensors index (no JSON weight_map: "
                                  f"{type(err).__name__}); download it again.") from None
        missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise CheckpointError(f"{index} names {len(missing)} shard(s) missing from {path} "
                                  f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
                                  f"download the missing shard(s) into that folder.")
        state: dict[str, torch.Tensor] = {}
        for name in names:
            state.update(read_weight_file(os.path.join(path, name)))
        return state
    return read_weight_file(os.path.join(path, "pytorch_model.bin"))
