"""Checkpoint I/O: DCP save and load (synchronous or in a background thread), the atomic publish
of an iteration folder, and the tracker file.

Folder layout (Megatron's): <save>/iter_0000100/ with DCP's files (.metadata, __<rank>_0.distcp)
plus megatron_sp.json (iteration, consumed samples, scheduler, layout, model config, arguments);
<save>/latest_checkpointed_iteration.txt names the newest complete one ("release" for converted
weights, loaded as iteration 0 without optimizer or RNG). Saving is atomic: everything is written
to iter_XXXXXXX.tmp, renamed when complete, and the tracker is replaced last, so a crash during a
save leaves the previous checkpoint loadable.

Security: DCP's .metadata file is a pickle. Load checkpoints only from sources you would trust
with code. Tensors and RNG bytes are read with torch.load(weights_only=True).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import re
import shutil
import threading
import time
from typing import Any

import torch

from megatron_sp.checkpointing.comm import (agree_on_error, all_gather_object, global_rank,
                                            global_world_size, is_distributed)
from megatron_sp.checkpointing.format import (FORMAT_VERSION, META_FILENAME, RELEASE,
                                              AgreedCheckpointError,
                                              TRACKER_FILENAME, CheckpointError, Shard,
                                              jsonable, rng_from_storable, rng_to_storable,
                                              check_config, iteration_dirname, model_state,
                                              optimizer_state, read_meta, schedule_to_load)
from megatron_sp.checkpointing.integrity import (algorithms_of, checksum_files, dcp_item_offsets,
                                                 files_of_rank, require_digests, verify_files)
from megatron_sp.checkpointing.planners import dcp_errors, shard_planners
from megatron_sp.fileutil import fsync_dir, write_text_atomic
from megatron_sp.mesh import barrier


_writer_class = None


def _storage_writer(path: str):
    """DCP's FileSystemWriter for `path` whose write failures keep their errno across ranks.

    DCP gathers every rank's write failure to the coordinator and back by pickling it, and a
    pickled exception loses its causes: a full disk on a rank other than 0 arrived as torch's bare
    RuntimeError '[enforce fail at inline_container.cc] unexpected pos ...' (said as a bug, with a
    traceback per rank). This writer raises the OSError underneath instead (errno, strerror and
    file name survive the pickle), so every rank names the full disk."""
    global _writer_class
    if _writer_class is None:
        import torch.distributed.checkpoint as dcp

        class _Writer(dcp.FileSystemWriter):
            def write_data(self, plan, planner):
                try:
                    return super().write_data(plan, planner)
                except Exception as err:   # (a Ctrl-C goes through as it is)
                    cause = next((e for e in _causes(err)
                                  if isinstance(e, OSError) and e.errno is not None), None)
                    if cause is None or cause is err:
                        raise
                    raise OSError(cause.errno, cause.strerror, cause.filename) from err
        _writer_class = _Writer
    return _writer_class(path, single_file_per_rank=True)


def _dcp_save(state: dict, path: str):
    import torch.distributed.checkpoint as dcp
    save_planner, _ = shard_planners()
    with dcp_errors():
        dcp.save(state, storage_writer=_storage_writer(path), planner=save_planner(),
                 no_dist=not is_distributed())


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
    save_planner, _ = shard_planners()
    staged = _CloneStager().stage(state)
    return dcp.async_save(staged, storage_writer=_storage_writer(path),
                          planner=save_planner(), process_group=group,
                          async_stager=_CloneStager())


def dcp_load(state: dict, path: str, local: bool = False, verify: tuple[dict, str] | None = None,
              advice: str | None = None):
    """Read `state` from `path`; collective over the world unless `local` (one process reads).

    `verify` = (recorded checksums, advice): each rank checks the files its plan opens first.
    `advice` (what to do when a file cannot be read) turns DCP's failures into one CheckpointError.
    """
    import torch.distributed.checkpoint as dcp
    _, load_planner = shard_planners()
    root_logger = logging.getLogger()     # DCP logs a traceback there per failed read: ours is
    if advice is not None:                # one sentence (raised below)
        root_logger.addFilter(_quiet_dcp)
    try:
        with dcp_errors(path, advice):
            dcp.load(state, storage_reader=dcp.FileSystemReader(path),
                     planner=load_planner(path, verify), no_dist=local or not is_distributed())
    finally:
        root_logger.removeFilter(_quiet_dcp)
    return state


def _quiet_dcp(record: logging.LogRecord) -> bool:
    """Logging filter: drop the records DCP's loader logs on the root logger."""
    return "distributed/checkpoint" not in record.pathname.replace(os.sep, "/")


# Folder layout ----------------------------------------------------------------------------------------

def read_tracker(root: str) -> int | str | None:
    """The iteration named by <root>/latest_checkpointed_iteration.txt (None when absent)."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not a text file (its {len(raw)} bytes are not UTF-8); it "
                              f"should hold an iteration number or 'release': write the iteration "
                              f"to resume from into it, or pass --ckpt-step N.") from None
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} should hold an iteration number or 'release', "
                              f"found {text!r}.") from None


def _complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, ".metadata")) and \
        os.path.isfile(os.path.join(folder, META_FILENAME))


def complete_iterations(root: str) -> list[int]:
    """The iterations under `root` whose folder is complete (published), oldest first."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        m = re.fullmatch(r"iter_(\d{7,})", name)
        if m and _complete(os.path.join(root, name)):
            found.append(int(m.group(1)))
    return sorted(found)


def fallback_advice(folder: str, training: bool = True) -> str:
    """What to do when the checkpoint in `folder` is damaged: the newest earlier complete
    iteration of the same save folder, loaded with --ckpt-step (Megatron's flag) when `training`
    (pretrain_gpt.py), or named as a folder otherwise (load_pretrained, conversion)."""
    root, name = os.path.split(os.path.normpath(folder))
    m = re.fullmatch(r"iter_(\d+)", name)
    if m is None:
        return f"{name} is damaged; save or convert it again."
    iteration = int(m.group(1))
    earlier = [it for it in complete_iterations(root) if it < iteration]
    if earlier and training:
        return (f"iteration {iteration} is damaged; resume from iteration {earlier[-1]}, the newest "
                f"earlier complete checkpoint, with --ckpt-step {earlier[-1]}.")
    if earlier:
        return (f"iteration {iteration} is damaged; load an earlier iteration folder instead, e.g. "
                f"{os.path.join(root, iteration_dirname(earlier[-1]))}, the newest complete one.")
    return (f"iteration {iteration} is damaged and {root} holds no earlier complete checkpoint; "
            f"restore the file from a copy" + (" or start again without --load." if training
                                               else "."))


def resolve_checkpoint(path: str, step: int | None = None) -> str | None:
    """The checkpoint folder for `path`: a root with a tracker, or an iteration folder itself;
    with `step` (--ckpt-step), the root's iteration `step` whatever the tracker says.

    None when `path` holds no checkpoint at all; CheckpointError when the tracker names a folder
    that is missing or incomplete, or `step` names no complete iteration (the sentence lists the
    complete ones).
    """
    if step is not None:
        folder = os.path.join(path, iteration_dirname(step))
        if not _complete(folder):
            raise CheckpointError(_missing_step(path, step, folder))
        return folder
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


def _missing_step(path: str, step: int, folder: str) -> str:
    """The sentence refusing --ckpt-step `step` (its `folder` under --load `path` is missing or
    incomplete): what exists there and what to do."""
    if not os.path.exists(path):
        return (f"--ckpt-step {step}: --load {path} does not exist, so it holds no iteration "
                f"{step}; check the --load path, or leave out --ckpt-step to start from scratch.")
    have = complete_iterations(path)
    if not have:
        return (f"--ckpt-step {step}: {folder} is missing or incomplete, and {path} holds no "
                f"complete iteration; check the --load path, or leave out --ckpt-step.")
    if len(have) == 1:
        return (f"--ckpt-step {step}: {folder} is missing or incomplete; the only complete "
                f"iteration under {path} is {have[0]}: pass --ckpt-step {have[0]}, or leave "
                f"--ckpt-step out to load the latest.")
    return (f"--ckpt-step {step}: {folder} is missing or incomplete; the complete iterations "
            f"under {path} are {', '.join(map(str, have))}: pass one of them to --ckpt-step, or "
            f"leave --ckpt-step out to load the latest.")


# Save ----------------------------------------------------------------------------------------------

class _PendingSave:
    """An asynchronous save whose files are still being written; `finalize()` publishes it.

    A helper thread waits for the write and checksums this rank's files in the background too, so
    that publishing (at the next save or at exit) does not stop training for the checksums."""

    def __init__(self, future, root, iteration, tmp, final, meta, sizes):
        self.future, self.root, self.iteration = future, root, iteration
        self.tmp, self.final, self.meta, self.sizes = tmp, final, meta, sizes
        self.checksums, self.error = None, None
        self.thread = threading.Thread(target=self._checksum, name="checkpoint-crc", daemon=True)
        self.thread.start()

    def _checksum(self):
        try:
            self.future.result()              # this rank's files and (DCP's finish) .metadata
            self.checksums = _own_checksums(self.tmp)
        except BaseException as err:          # said by finalize() on the main thread
            self.error = err

    def failed(self) -> bool:
        """True once the background write has ended in an error on this rank (no wait)."""
        return not self.thread.is_alive() and self.error is not None

    def finalize(self):
        self.thread.join()
        _agree_on_save(self.error, self.root, self.iteration, self.tmp, self.final, self.sizes,
                       background=True)
        _publish(self.root, self.iteration, self.tmp, self.final, self.meta, self.checksums,
                 self.sizes)


_pending: _PendingSave | None = None


def _own_checksums(tmp: str) -> dict:
    """The checksums of the files this rank wrote (integrity.files_of_rank)."""
    return checksum_files(tmp, files_of_rank(tmp, global_rank(), global_world_size(), skip={META_FILENAME}),
                          cuts=dcp_item_offsets(tmp))


def _record_checksums(tmp: str, meta: dict, mine: dict | None = None) -> None:
    """Every rank checksums the files it wrote (unless given: `mine`), the ranks gather them
    (collective) and `meta` records them all."""
    files = {}
    for part in all_gather_object(_own_checksums(tmp) if mine is None else mine):
        files.update(part)
    meta["checksums"] = {"algorithm": "+".join(algorithms_of(files)),   # one name unless the
                         "files": dict(sorted(files.items()))}           # ranks' installs differ


def _publish(root, iteration, tmp, final, meta, checksums=None, sizes=None):
    """Every rank has written its files: they are checksummed (`checksums`: this rank's, already
    computed), rank 0 writes the metadata (with every rank's checksums) under a temporary name,
    renames the folder, then replaces the tracker. The ranks agree on rank 0's outcome (a full
    disk, a vanished folder): all raise the same CheckpointError, the half save removed. Called
    right after _agree_on_save, whose gather already held every rank at this point."""
    _record_checksums(tmp, meta, checksums)
    error = None
    if global_rank() == 0:
        try:
            write_text_atomic(os.path.join(tmp, META_FILENAME), json.dumps(meta, indent=1))
            if os.path.exists(final):           # saving an iteration again: move the old one away
                old = final + ".old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            fsync_dir(root)
            write_text_atomic(os.path.join(root, TRACKER_FILENAME), str(iteration))
        except (OSError, KeyboardInterrupt) as err:
            error = err
    _agree_on_save(error, root, iteration, tmp, final, sizes or {})


# Save failures: one sentence, the half save removed -----------------------------------------------

def _state_sizes(state: dict) -> dict[str, int]:
    """{key: bytes of the full stored tensor} of a state dict (Shards at their global shape)."""
    sizes = {}
    for key, value in state.items():
        if isinstance(value, Shard):
            sizes[key] = math.prod(value.global_shape) * value.local.element_size()
        elif torch.is_tensor(value):
            sizes[key] = value.numel() * value.element_size()
    return sizes


def _causes(err: BaseException):
    """`err`, DCP's per-rank failures inside it, and their causes and contexts (each once)."""
    todo, seen = [err], set()
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        for f in (getattr(e, "failures", None) or {}).values():   # DCP's CheckpointException
            todo.append(f[0] if isinstance(f, tuple) else f)
        todo += [e.__cause__, e.__context__]


_TORCH_WRITE_FAILED = re.compile(r"unexpected pos \d+ vs \d+|"
                                 r"PytorchStreamWriter failed writing[^\n]*")


def _save_error_kind(err: BaseException) -> dict:
    """What went wrong while saving, as plain data the ranks can exchange."""
    causes = list(_causes(err))
    if any(isinstance(e, KeyboardInterrupt) for e in causes):
        return {"kind": "interrupted"}
    for e in causes:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return {"kind": "no space"}
    for e in causes:
        if isinstance(e, CheckpointError):
            return {"kind": "ours", "text": str(e)}
    for e in causes:
        if isinstance(e, OSError):
            where = f": {e.filename}" if e.filename else ""
            return {"kind": "os", "text": f"{e.strerror or e}{where}"}
    for e in causes:   # torch's zip writer without the OSError (lost on the way): a failed write
        found = isinstance(e, RuntimeError) and _TORCH_WRITE_FAILED.search(str(e))
        if found:
            return {"kind": "os", "text": f"a file write failed: {found.group(0)}"}
    first = (str(err).strip().splitlines() or [""])[0][:160]
    return {"kind": "other", "text": f"{type(err).__name__}{': ' + first if first else ''}"}


def _remove_half_save(root: str, tmp: str, final: str, published: bool) -> None:
    """Rank 0: the temporary folder and files of a failed save (and its folder when it was renamed
    but the tracker could not name it)."""
    shutil.rmtree(tmp, ignore_errors=True)
    if published:
        shutil.rmtree(final, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(root, TRACKER_FILENAME + ".tmp"))


def _previous(root: str) -> str:
    """'the previous checkpoint X is intact (still the latest)' or that there is none."""
    try:
        it = read_tracker(root)
    except CheckpointError:
        it = None
    if it is None:
        return f"{root} holds no earlier checkpoint"
    return f"the previous checkpoint {os.path.join(root, iteration_dirname(it))} is intact (still " \
           f"the latest)"


def _save_failure(kind: dict, root: str, final: str, tmp: str, needed: int, free: int,
                  background: bool = False) -> str:
    from megatron_sp.comm_stats import format_bytes
    removed = f"{tmp} was removed and {_previous(root)}"
    if kind["kind"] == "interrupted":
        return f"interrupted (Ctrl-C) while saving checkpoint {final}: {removed}."
    saving = f"saving checkpoint {final}{' in the background' if background else ''}"
    if kind["kind"] == "no space" or (kind["kind"] == "os" and free < needed):
        return (f"{saving} failed: no space left on the file system of {root} "
                f"(the checkpoint needs about {format_bytes(needed)}, {format_bytes(free)} are "
                f"free); {removed}; free space or choose another --save, then resume with --load {root}.")
    if kind["kind"] == "ours":
        return f"{kind['text'].rstrip('.')}; {removed}."
    return (f"{saving} failed ({kind['text']}); {removed}; check the folder and its file "
            f"system, then resume with --load {root}.")


def _agree_on_save(error, root, iteration, tmp, final, sizes: dict,
                   background: bool = False) -> None:
    """After a save step every rank calls this (collective): when any rank failed, rank 0 removes
    the half save and every rank raises the same CheckpointError (the first failing rank's cause,
    the bytes the checkpoint needs and the bytes free). A Ctrl-C is said without a collective:
    the other ranks are being interrupted too."""
    def published() -> bool:   # renamed, but the tracker could not name it
        return os.path.isdir(final) and not os.path.isdir(tmp) and read_tracker(root) != iteration

    if isinstance(error, KeyboardInterrupt) or (error is not None and
                                                _save_error_kind(error)["kind"] == "interrupted"):
        if global_rank() == 0:
            _remove_half_save(root, tmp, final, published())
        raise CheckpointError(_save_failure({"kind": "interrupted"}, root, final, tmp, 0, 0)) \
            from None
    kinds = all_gather_object(_save_error_kind(error) if error is not None else None)
    kind = next((k for k in kinds if k), None)
    if kind is None:                           # (the gather was the barrier)
        return
    if global_rank() == 0:
        _remove_half_save(root, tmp, final, published())
    parts = all_gather_object((sizes, shutil.disk_usage(root).free if os.path.isdir(root) else 0))
    needed = sum({k: v for part, _ in parts for k, v in part.items()}.values())
    message = _save_failure(kind, root, final, tmp, needed, parts[0][1], background)
    if error is not None and kind["kind"] == "other" and not isinstance(error, CheckpointError):
        raise error                            # a bug: its traceback (the files are cleaned up)
    raise AgreedCheckpointError(message) from None


def finalize_async_save():
    """Wait for an asynchronous save in flight and publish it (every rank calls this). A failed
    one raises CheckpointError (one sentence, the same on every rank; its .tmp folder removed)."""
    global _pending
    if _pending is not None:
        pending, _pending = _pending, None
        pending.finalize()


def async_save_in_flight() -> bool:
    """True while an asynchronous save is being written or waits to be published."""
    return _pending is not None


def async_save_failed() -> bool:
    """True when this rank's asynchronous save in flight has ended in an error (no wait, no
    collective: the caller agrees with the other ranks, e.g. manager's per-step flags)."""
    return _pending is not None and _pending.failed()


def save_checkpoint(root: str, iteration: int | str, chunks, mesh, *, optimizer=None, scheduler=None,
                    train_state=None, config=None, args=None, rng_tracker=None,
                    async_save: bool = False, save_rng: bool = True) -> str:
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
    if global_rank() == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.islink(tmp):                  # never write through a planted link
            os.unlink(tmp)
        shutil.rmtree(tmp, ignore_errors=True)   # leftovers of a save that crashed
        os.makedirs(tmp)
    barrier()
    state: dict[str, Any] = model_state(chunks, mesh.tp_rank, mesh.tp_size)
    if optimizer is not None:
        state.update(optimizer_state(chunks, optimizer, mesh.tp_rank, mesh.tp_size))
    if save_rng and (rng_tracker is not None or optimizer is not None):   # --no-save-rng
        from megatron_sp.tensor_parallel.random import get_rng_state
        state[f"rng/{mesh.rank}"] = rng_to_storable(get_rng_state(rng_tracker))
    d = mesh.dims
    meta = {
        "format": "megatron_sp", "format_version": FORMAT_VERSION,
        "iteration": iteration if iteration == RELEASE else int(iteration),
        "layout": {"tp": d.tp, "sp": d.sp, "dp": d.dp, "pp": d.pp, "world_size": d.world_size,
                   **({"cp": d.cp} if d.cp > 1 else {})},
        "has_optimizer": optimizer is not None,
        "has_rng": f"rng/{mesh.rank}" in state,
        "train_state": dataclasses.asdict(train_state) if train_state is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "config": config.to_dict() if config is not None else None,
        "args": jsonable(dict(args)) if args is not None else None,
        "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    sizes = _state_sizes(state)
    if async_save and is_distributed():
        future = _dcp_async_save(state, tmp, mesh.background_group())
        _pending = _PendingSave(future, root, iteration, tmp, final, meta, sizes)
        if global_rank() == 0:
            print(f"> saving checkpoint {final} in the background (staged in "
                  f"{time.time() - t0:.2f} s)", flush=True)
        return final
    from torch.distributed.checkpoint.api import CheckpointException   # a BaseException
    error = None
    try:
        _dcp_save(state, tmp)
    except (Exception, KeyboardInterrupt, CheckpointException) as err:   # a full disk, Ctrl-C:
        error = err                                                      # one sentence below
    _agree_on_save(error, root, iteration, tmp, final, sizes)
    _publish(root, iteration, tmp, final, meta, sizes=sizes)
    if global_rank() == 0:
        print(f"> saved checkpoint {final} in {time.time() - t0:.2f} s", flush=True)
    return final


# Load ----------------------------------------------------------------------------------------------

def _open_checkpoint(path, step, missing_ok, verify, config, scheduler, schedule, weights_only):
    """Find, read and check the checkpoint before any tensor is read: (folder, meta, checksums,
    advice), or None when there is none and `missing_ok`. Raises CheckpointError (one sentence)."""
    if not os.path.exists(path):
        if step is not None:                # an explicit iteration that is not there: refused
            raise CheckpointError(_missing_step(path, step, os.path.join(
                path, iteration_dirname(step))))
        if missing_ok:
            return None
        raise CheckpointError(f"checkpoint path {path} does not exist.")
    folder = resolve_checkpoint(path, step)
    if folder is None:
        if missing_ok:
            return None
        raise CheckpointError(f"{path} holds no checkpoint ({TRACKER_FILENAME} is missing).")
    advice = fallback_advice(folder)
    meta = read_meta(folder, advice)
    check_config(meta.get("config"), config, folder)
    checksums = (meta.get("checksums") or {}).get("files") if verify else None
    if checksums is not None:
        require_digests(checksums, folder, "pass --no-verify-checkpoint to load it unverified")
        verify_files(folder, [".metadata"], checksums, advice)   # before DCP unpickles it
    elif verify and global_rank() == 0:
        print(f"> checkpoint {folder} records no checksums (saved before integrity checks): "
              f"its files are not verified", flush=True)
    weights_only = weights_only or meta.get("iteration") == RELEASE
    if scheduler is not None and not weights_only and meta.get("scheduler") is not None:
        meta["scheduler"] = schedule_to_load(meta["scheduler"], scheduler, schedule, folder)
    return folder, meta, checksums, advice


def load_checkpoint(path: str, chunks, mesh, *, optimizer=None, scheduler=None, train_state=None,
                    config=None, rng_tracker=None, load_optim: bool = True, load_rng: bool = True,
                    finetune: bool = False, missing_ok: bool = True, step: int | None = None,
                    verify: bool = True, schedule: str | None = None) -> dict | None:
    """Load a checkpoint saved in any layout into this one (collective). Returns its metadata.

    `path`: the --load root (tracker) or an iteration folder; `step` (--ckpt-step) loads that
    iteration of the root instead of the newest. With no checkpoint there at all, returns None
    (Megatron starts from scratch) unless `missing_ok` is False or `step` asks for an iteration
    (refused, naming what exists). `finetune` (and a 'release' checkpoint) loads the weights only
    and keeps iteration 0. `verify` checks every file against the checksums recorded at save
    before it is read (integrity.py). `schedule`: None refuses a learning-rate schedule that
    differs from the checkpoint's, "override" keeps the scheduler's, "checkpoint" takes the
    checkpoint's (Megatron's --override-opt_param-scheduler /
    --use-checkpoint-opt_param-scheduler). The ranks agree on every refusal: all raise the same.
    """
    opened, error = None, None
    try:
        opened = _open_checkpoint(path, step, missing_ok, verify, config, scheduler, schedule,
                                  finetune)
    except CheckpointError as err:
        error = str(err)
    except OSError as err:                 # unreadable (permissions, I/O error): still one line
        error = f"cannot read checkpoint {path}: {err}; check the files' permissions and disk."
    error = agree_on_error(error)
    if error is not None:
        raise AgreedCheckpointError(error)
    if opened is None:
        return None
    folder, meta, checksums, advice = opened
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
    same_layout = all(saved_layout.get(k, 1 if k == "cp" else None) == v for k, v in
                      (("tp", mesh.tp_size), ("sp", mesh.sp_size), ("dp", mesh.dp_size),
                       ("pp", mesh.pp_size), ("cp", mesh.cp_size)))
    rng_key = f"rng/{mesh.rank}"
    with_rng = load_rng and not weights_only and meta.get("has_rng") and same_layout
    if with_rng:
        state[rng_key] = None
    dcp_load(state, folder, verify=(checksums, advice) if checksums is not None else None,
              advice=advice)
    if hasattr(optimizer, "sync_master_from_params"):   # sharded master copies follow the weights
        optimizer.sync_master_from_params()
    if not weights_only:
        if scheduler is not None and meta.get("scheduler") is not None:
            scheduler.load_state_dict(meta["scheduler"])
        if train_state is not None and meta.get("train_state") is not None:
            for k, v in meta["train_state"].items():
                if hasattr(train_state, k):
                    setattr(train_state, k, v)
    if with_rng:
        from megatron_sp.tensor_parallel.random import set_rng_state
        set_rng_state(rng_from_storable(state[rng_key]), rng_tracker)
    elif load_rng and not weights_only and meta.get("has_rng") and global_rank() == 0:
        print(f"> layout changed ({saved_layout} -> tp={mesh.tp_size} sp={mesh.sp_size} "
              f"dp={mesh.dp_size} pp={mesh.pp_size}): RNG states not restored (they are per rank).",
              flush=True)
    if global_rank() == 0:
        what = "weights only" if weights_only else ("weights, optimizer" if with_optim else "weights")
        at = ("a converted checkpoint, training starts at iteration 0"
              if meta.get("iteration") == RELEASE else f"at iteration {meta.get('iteration')}")
        print(f"> loaded checkpoint {folder} ({what}): {at}", flush=True)
    return meta
