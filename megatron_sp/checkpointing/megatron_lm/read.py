"""Reading a Megatron-LM checkpoint (torch_dist or torch, any tp x pp) into full tensors in our
names, with its model fields, iteration, consumed samples and learning-rate schedule.

Everything is read in one process, without megatron-core: torch_dist through
torch.distributed.checkpoint (each stored tensor at its full shape, layers stacked on a leading
num_layers axis), torch by joining the mp_rank_* files' tensor-parallel shards and renumbering
each pipeline stage's layers. Pickles go through `safe_load` (weights_only with an allowlist).
"""
from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, field

import torch

from megatron_sp.checkpointing.format import CheckpointError
from megatron_sp.checkpointing.megatron_lm import names
from megatron_sp.checkpointing.megatron_lm.arguments import as_dict, model_fields
from megatron_sp.checkpointing.megatron_lm.folder import MP_RANK, TORCH_DIST, locate
from megatron_sp.checkpointing.megatron_lm.safe_load import read_dcp_metadata, safe_load


@dataclass
class MegatronCheckpoint:
    """One iteration of a Megatron-LM checkpoint, read."""
    folder: str
    ckpt_format: str                 # torch_dist | torch
    iteration: int | str             # "release" for a converted one
    stored: dict                     # the stored arguments (Megatron-LM's args)
    fields: dict                     # GPTConfig fields
    tensors: dict[str, torch.Tensor] = field(repr=False)   # our names, full shapes
    scheduler: dict | None = None    # Megatron-LM's opt_param_scheduler state (samples)
    has_optimizer: bool = False

    @property
    def consumed_train_samples(self) -> int:
        return int(self.stored.get("consumed_train_samples") or 0)

    @property
    def consumed_valid_samples(self) -> int:
        return int(self.stored.get("consumed_valid_samples") or 0)


def read_checkpoint(path: str) -> MegatronCheckpoint:
    """The checkpoint in `path` (a save folder or an iteration folder); CheckpointError (one
    sentence) for anything that is not a whole Megatron-LM GPT checkpoint we can represent."""
    where = locate(path)
    if where.ckpt_format == TORCH_DIST:
        common, tensors, has_optim = _read_torch_dist(where.folder)
    else:
        common, tensors, has_optim = _read_torch(where.folder)
    stored = as_dict(common.get("args"))
    if not stored:
        raise CheckpointError(f"checkpoint {where.folder} stores no arguments (args); the model's "
                              f"sizes cannot be known.")
    tensors = _by_our_names(tensors, stored, where.folder)
    rows = tensors["embedding.word_embeddings.weight"].shape[0]
    fields = model_fields(stored, rows, where.folder)
    _check_names(tensors, fields, where.folder)
    iteration = common.get("iteration", where.iteration)
    return MegatronCheckpoint(where.folder, where.ckpt_format,
                              "release" if where.iteration == "release" else int(iteration),
                              stored, fields, tensors, common.get("opt_param_scheduler"), has_optim)


# torch_dist -------------------------------------------------------------------------------------

def _dcp_reader(folder: str):
    """DCP's FileSystemReader whose .metadata is unpickled by the restricted reader."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            md = read_dcp_metadata(folder)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md
    return Reader(folder)


def _read_torch_dist(folder: str):
    """(common state, {Megatron key: full tensor} of the model, optimizer state stored)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    common_path = os.path.join(folder, "common.pt")
    if not os.path.isfile(common_path):
        raise CheckpointError(f"{folder} has no common.pt (the arguments and iteration of a "
                              f"torch_dist save): a half-written save, or a newer layout this "
                              f"reader does not know.")
    common = safe_load(common_path, f"checkpoint file {common_path}")
    md = read_dcp_metadata(folder)
    files = sorted({info.relative_path for info in md.storage_data.values()})
    missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        more = f" and {len(missing) - 1} more file(s)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint {folder} is missing {os.path.join(folder, missing[0])}"
                              f"{more} named by its .metadata; copy the whole folder again.")
    model, has_optim = {}, False
    for key, meta in md.state_dict_metadata.items():
        if key.startswith("optimizer."):
            has_optim = True
            continue
        if "_extra_state" in key or key.startswith("rng_state") or \
                not isinstance(meta, TensorStorageMetadata):
            continue
        model[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    import torch.distributed.checkpoint as dcp
    try:
        with warnings.catch_warnings():   # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(model, storage_reader=_dcp_reader(folder), no_dist=True)
    except CheckpointError:
        raise
    except Exception as err:
        text = (str(err).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"checkpoint {folder} cannot be read ({type(err).__name__}: "
                              f"{text}): a damaged or half-written save; load an earlier "
                              f"iteration.") from None
    return common, model, has_optim


# torch (legacy) -----------------------------------------------------------------------------------

def _rank_dir(tp: int, pp_rank: int | None, ep_rank: int | None = None) -> str:
    name = f"mp_rank_{tp:02d}"
    if pp_rank is not None:
        name += f"_{pp_rank:03d}"
    if ep_rank is not None:
        name += f"_{ep_rank:03d}"
    return name


def _read_torch(folder: str):
    """(common state of rank 0, {Megatron key with global layer numbers: full tensor}, optimizer
    stored) of the mp_rank_* files, tp shards joined."""
    dirs = sorted(n for n in os.listdir(folder) if MP_RANK.match(n))
    first = os.path.join(folder, dirs[0], "model_optim_rng.pt")
    if not os.path.isfile(first):
        raise CheckpointError(f"checkpoint {folder} is missing {first}; copy the whole folder "
                              f"again.")
    head = safe_load(first, f"checkpoint file {first}")
    stored = as_dict(head.get("args"))
    if not stored:
        raise CheckpointError(f"{first} stores no arguments (args); the model's sizes cannot be "
                              f"known.")
    tp = int(stored.get("tensor_model_parallel_size") or 1)
    pp = int(stored.get("pipeline_model_parallel_size") or 1)
    ep = int(stored.get("expert_model_parallel_size") or 1)
    # paths[stage][tp rank][ep rank]
    paths = [[[os.path.join(folder, _rank_dir(t, p if pp > 1 else None, e if ep > 1 else None),
                            "model_optim_rng.pt") for e in range(ep)] for t in range(tp)]
             for p in range(pp)]
    for stage in paths:
        for ranks in stage:
            for p in ranks:
                if not os.path.isfile(p):
                    layout = f"tp {tp} x pp {pp}" + (f" x ep {ep}" if ep > 1 else "")
                    raise CheckpointError(f"checkpoint {folder} ({layout}) is missing {p}; copy "
                                          f"the whole folder again.")
    swiglu = bool(stored.get("swiglu"))
    experts = int(stored.get("num_experts") or 0)
    out, offset, has_optim = {}, 0, False
    for stage in paths:
        loaded = [[head if p == first else safe_load(p, f"checkpoint file {p}") for p in ranks]
                  for ranks in stage]
        has_optim = has_optim or bool(loaded[0][0].get("optimizer"))
        models = [_join_expert_ranks([_model_of(s, p) for s, p in zip(states, ranks)], experts)
                  for states, ranks in zip(loaded, stage)]
        stage = [ranks[0] for ranks in stage]
        count = 0
        for key in models[0]:
            if key.endswith("_extra_state") or models[0][key] is None:
                continue
            m = names.LAYER_KEY.match(key)
            expert = names.EXPERT_KEY.match(m.group(2)) if m else None
            if m:
                i, suffix = int(m.group(1)), m.group(2)
                count = max(count, i + 1)
                ours = "layers.0." + (f"mlp.fc{expert.group(2)}.weight" if expert else  # its cut
                                      names.our_layer_suffix(suffix, folder))
                glob = f"decoder.layers.{offset + i}.{suffix}"
            else:
                ours, glob = names.our_global(key, folder), key
            shards = []
            for model, p in zip(models, stage):
                if key not in model:
                    raise CheckpointError(f"{p} has no {key} (the other tensor-parallel ranks "
                                          f"do): a damaged save.")
                shards.append(model[key])
            out[glob] = names.merge_tp(ours, shards, swiglu)
        offset += count
    return head, names.join_experts(out, folder), has_optim


def _join_expert_ranks(models: list[dict], experts: int) -> dict:
    """One tp rank's model from its expert-parallel files: the first file's tensors, with the
    local experts of file e renumbered to global ones (local j -> e * E/ep + j)."""
    if len(models) == 1:
        return models[0]
    per_rank = experts // len(models)
    out = {k: v for k, v in models[0].items() if ".local_experts." not in k}
    for e, model in enumerate(models):
        for key, t in model.items():
            m = re.search(r"\.local_experts\.(\d+)\.", key)
            if m:
                j = e * per_rank + int(m.group(1))
                out[key[:m.start()] + f".local_experts.{j}." + key[m.end():]] = t
    return out


def _model_of(state: dict, path: str) -> dict:
    if "model" in state:
        return state["model"]
    if "model0" in state:
        raise CheckpointError(f"{path} holds virtual pipeline chunks (model0, model1, ...), which "
                              f"this reader does not join; save it with --ckpt-format torch_dist.")
    raise CheckpointError(f"{path} holds no model state ('model'); it is not a Megatron-LM "
                          f"training checkpoint.")


# Names -------------------------------------------------------------------------------------------

def _by_our_names(tensors: dict, stored: dict, where: str) -> dict:
    """{our name: tensor} from Megatron-LM keys: per-layer (decoder.layers.{i}.x), stacked
    (decoder.layers.x with a leading num_layers axis, torch_dist) and global ones."""
    layers = int(stored["num_layers"])
    tied = not stored.get("untie_embeddings_and_output_weights", False)
    out = {}
    for key, t in tensors.items():
        m = names.LAYER_KEY.match(key)
        if m:
            out[f"layers.{m.group(1)}.{names.our_layer_suffix(m.group(2), where)}"] = t
        elif key.startswith("decoder.layers."):
            suffix = key[len("decoder.layers."):]
            ours = names.our_layer_suffix(suffix, where)
            if t.shape[0] != layers:
                raise CheckpointError(f"checkpoint {where}: {key} stacks {t.shape[0]} layers but "
                                      f"the arguments say num_layers={layers}.")
            for i in range(layers):
                out[f"layers.{i}.{ours}"] = t[i]
        elif key == "output_layer.weight" and tied:
            continue          # the last stage's copy of the tied embedding
        else:
            out[names.our_global(key, where)] = t
    return {k: v.float() if v.is_floating_point() else v for k, v in out.items()}


def _check_names(tensors: dict, fields: dict, where: str) -> None:
    expected = set(names.expected_names(fields))
    missing = sorted(expected - set(tensors), key=_natural)
    extra = sorted(set(tensors) - expected, key=_natural)
    if missing:
        more = f" (and {len(missing) - 1} more tensors)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint {where} has no {names.megatron_name(missing[0])}{more}"
                              f", which its arguments call for; a damaged save?")
    if extra:
        raise CheckpointError(f"checkpoint {where} holds {names.megatron_name(extra[0])}, which "
                              f"its arguments do not call for; it cannot be converted faithfully.")


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def read_fields(path: str) -> dict:
    """The GPTConfig fields of the checkpoint in `path` from its stored arguments alone (no
    tensor read: --use-checkpoint-args); the vocabulary is the stored padded_vocab_size."""
    where = locate(path)
    if where.ckpt_format == TORCH_DIST:
        common_path = os.path.join(where.folder, "common.pt")
        if not os.path.isfile(common_path):
            raise CheckpointError(f"{where.folder} has no common.pt (the arguments of a "
                                  f"torch_dist save): a half-written save?")
        common = safe_load(common_path, f"checkpoint file {common_path}")
    else:
        first = os.path.join(where.folder, sorted(n for n in os.listdir(where.folder)
                                                  if MP_RANK.match(n))[0], "model_optim_rng.pt")
        common = safe_load(first, f"checkpoint file {first}")
    stored = as_dict(common.get("args"))
    if not stored.get("padded_vocab_size"):
        raise CheckpointError(f"checkpoint {where.folder} stores no padded_vocab_size in its "
                              f"arguments; give the model flags instead of --use-checkpoint-args.")
    return model_fields(stored, int(stored["padded_vocab_size"]), where.folder)
