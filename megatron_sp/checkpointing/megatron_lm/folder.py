"""Where a Megatron-LM checkpoint lies, and in which format (docs/checkpoints.md).

    <save>/latest_checkpointed_iteration.txt      "1000" or "release"
    <save>/iter_0001000/                          (or release/)
        torch_dist: metadata.json {"sharded_backend": "torch_dist", ...}, .metadata,
                    __<rank>_<n>.distcp, common.pt
        torch:      mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt

`locate` accepts the save folder or an iteration folder and refuses, in one sentence, what is no
Megatron-LM checkpoint or a half-written one.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from megatron_sp.checkpointing.format import (META_FILENAME, RELEASE, TRACKER_FILENAME,
                                              CheckpointError, iteration_dirname)

TORCH_DIST, TORCH = "torch_dist", "torch"
MP_RANK = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


@dataclass
class Located:
    """An iteration folder of a Megatron-LM checkpoint."""
    folder: str
    iteration: int | str          # an int, or "release"
    ckpt_format: str              # torch_dist | torch


def _format_of(folder: str) -> str | None:
    """torch_dist, torch, or None (not a Megatron-LM iteration folder)."""
    if not os.path.isdir(folder) or os.path.isfile(os.path.join(folder, META_FILENAME)):
        return None
    if os.path.isfile(os.path.join(folder, "metadata.json")):
        return TORCH_DIST
    if any(MP_RANK.match(n) for n in os.listdir(folder)):
        return TORCH
    return None


def _iteration_of(folder: str) -> int | str:
    name = os.path.basename(os.path.normpath(folder))
    m = re.fullmatch(r"iter_(\d+)", name)
    return int(m.group(1)) if m else RELEASE


def is_megatron_lm_checkpoint(path: str | None) -> bool:
    """Whether `path` is a Megatron-LM save folder (its tracker names a Megatron-LM iteration
    folder) or such an iteration folder. Never raises."""
    try:
        if not path or not os.path.isdir(path):
            return False
        if _format_of(path):
            return True
        tracker = os.path.join(path, TRACKER_FILENAME)
        if not os.path.isfile(tracker):
            return False
        with open(tracker, encoding="utf-8") as f:
            text = f.read().strip()
        name = RELEASE if text == RELEASE else iteration_dirname(int(text))
        return _format_of(os.path.join(path, name)) is not None
    except (OSError, ValueError, UnicodeDecodeError):
        return False


def _read_tracker(path: str) -> int | str:
    tracker = os.path.join(path, TRACKER_FILENAME)
    try:
        with open(tracker, encoding="utf-8") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{tracker} cannot be read ({err}); it should hold an iteration "
                              f"number or 'release'.") from None
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{tracker} should hold an iteration number or 'release', found "
                              f"{text[:40]!r} (a half-written save?); pass an iteration folder "
                              f"instead.") from None


def locate(path: str) -> Located:
    """The iteration folder `path` names (a save folder through its tracker, or the iteration
    folder itself), checked complete enough to read; CheckpointError otherwise."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist; pass a Megatron-LM save folder or one of "
                              f"its iteration folders.")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file; a Megatron-LM checkpoint is a save folder (with "
                              f"{TRACKER_FILENAME}) or one of its iteration folders.")
    fmt = _format_of(path)
    ours = [p for p in (path, os.path.join(path, RELEASE)) if os.path.isfile(
        os.path.join(p, META_FILENAME))]
    if fmt is None and (ours or _ours_by_tracker(path)):
        raise CheckpointError(f"{path} is a megatron_sp checkpoint, not a Megatron-LM one: read it "
                              f"with --loader megatron_sp (or load it with --load as it is).")
    if fmt is not None:
        folder = path
    else:
        if path.rstrip(os.sep).endswith(".tmp"):
            raise CheckpointError(f"{path} is a temporary folder of a save that did not finish; "
                                  f"load the save folder or a complete iteration folder.")
        if not os.path.isfile(os.path.join(path, TRACKER_FILENAME)):
            iters = sorted(n for n in os.listdir(path) if re.fullmatch(r"iter_\d+", n))
            if iters:
                raise CheckpointError(
                    f"{path} has iteration folders ({', '.join(iters[-3:])}) but no "
                    f"{TRACKER_FILENAME}: its last save did not finish; pass a complete iteration "
                    f"folder (e.g. {os.path.join(path, iters[-1])}) if you know it is whole.")
            raise CheckpointError(f"{path} is not a Megatron-LM checkpoint: it has neither "
                                  f"{TRACKER_FILENAME} nor metadata.json nor mp_rank_* folders.")
        iteration = _read_tracker(path)
        folder = os.path.join(path, iteration_dirname(iteration))
        if not os.path.isdir(folder):
            raise CheckpointError(f"{os.path.join(path, TRACKER_FILENAME)} names iteration "
                                  f"{iteration}, but {folder} is missing.")
        fmt = _format_of(folder)
        if fmt is None:
            raise CheckpointError(f"{folder} holds neither metadata.json (torch_dist) nor "
                                  f"mp_rank_* folders (torch): a half-written save or not a "
                                  f"Megatron-LM checkpoint.")
    if fmt == TORCH_DIST:
        _check_torch_dist(folder)
    return Located(folder, _iteration_of(folder), fmt)


def _ours_by_tracker(path: str) -> bool:
    """Whether the tracker in `path` names one of our iteration folders (megatron_sp.json)."""
    try:
        iteration = _read_tracker(path) if os.path.isfile(os.path.join(path, TRACKER_FILENAME)) \
            else None
    except CheckpointError:
        return False
    return iteration is not None and os.path.isfile(
        os.path.join(path, iteration_dirname(iteration), META_FILENAME))


def _check_torch_dist(folder: str) -> None:
    path = os.path.join(folder, "metadata.json")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} cannot be read as JSON ({type(err).__name__}): a "
                              f"half-written save? load an earlier iteration.") from None
    backend = meta.get("sharded_backend") if isinstance(meta, dict) else None
    if backend != TORCH_DIST:
        raise CheckpointError(f"{path} names sharded_backend {backend!r}; only torch_dist (and "
                              f"the torch format's mp_rank_* folders) can be read.")
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise CheckpointError(f"{folder} has no .metadata: the save did not finish (torch_dist "
                              f"writes it last); load an earlier iteration.")
