"""Megatron-LM checkpoints at the command-line edge: the conversions of tools/checkpoint/convert.py
(--loader megatron, --saver megatron) and the model config of `pretrain_gpt.py --load <Megatron-LM
folder> --use-checkpoint-args`. The formats themselves are megatron_sp.checkpointing.megatron_lm
(docs/checkpoints.md); this module ties them to the models."""
from __future__ import annotations

import json
import os

from megatron_sp.checkpointing.format import RELEASE, CheckpointError
from megatron_sp.checkpointing.megatron_lm import read_checkpoint
from megatron_sp.checkpointing.megatron_lm.write import megatron_scheduler, write_checkpoint

LOADERS = ("megatron", "core", "legacy")       # Megatron-LM's own loader names, one reader


def checkpoint_config(path: str):
    """(GPTConfig, the read MegatronCheckpoint) of a Megatron-LM checkpoint."""
    from megatron_sp.models import GPTConfig
    ckpt = read_checkpoint(path)
    try:
        return GPTConfig(**ckpt.fields), ckpt
    except ValueError as err:
        raise CheckpointError(f"checkpoint {ckpt.folder}: its arguments make no model megatron_sp "
                              f"can build ({err})") from None


def read_model(path: str):
    """(one-rank GPTModel holding the checkpoint's weights, the MegatronCheckpoint)."""
    from megatron_sp.models.families import ConversionError, model_from_full
    config, ckpt = checkpoint_config(path)
    try:
        model = model_from_full(config, ckpt.tensors)
    except ConversionError as err:
        raise CheckpointError(f"checkpoint {ckpt.folder}: {err}") from None
    return model.eval(), ckpt


def say_read(ckpt) -> None:
    ep = ckpt.stored.get("expert_model_parallel_size") or 1
    print(f"> read Megatron-LM checkpoint {ckpt.folder} ({ckpt.ckpt_format}, saved at tp "
          f"{ckpt.stored.get('tensor_model_parallel_size', 1)} x pp "
          f"{ckpt.stored.get('pipeline_model_parallel_size', 1)}" + (f" x ep {ep}" if ep > 1 else "")
          + f", iteration {ckpt.iteration}"
          + (", its optimizer state not converted" if ckpt.has_optimizer else "") + ")",
          flush=True)


def megatron_to_megatron_sp(load_dir: str, save_dir: str):
    """A converted megatron_sp checkpoint (release: weights only) of a Megatron-LM checkpoint."""
    from megatron_sp import checkpointing
    from megatron_sp.mesh import ParallelMesh
    model, ckpt = read_model(load_dir)
    say_read(ckpt)
    checkpointing.save_checkpoint(save_dir, RELEASE, [model], ParallelMesh.single(),
                                  config=model.config)
    return model.config


def megatron_to_safetensors(load_dir: str, out_file: str) -> str:
    """One model.safetensors in our names with the config in its metadata (as
    export_safetensors writes; load_pretrained reads it)."""
    from safetensors.torch import save_file
    from megatron_sp.fileutil import publish, temporary_name
    from megatron_sp.models.families import full_tensors
    model, ckpt = read_model(load_dir)
    say_read(ckpt)
    os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
    tmp = temporary_name(out_file)
    save_file(full_tensors(model), tmp, metadata={
        "format": "pt", "megatron_sp_config": json.dumps(model.config.to_dict())})
    return publish(tmp, out_file)


def megatron_to_hf(load_dir: str, save_dir: str, family: str = "auto", tokenizer=None) -> dict:
    """A Hugging Face folder of a Megatron-LM checkpoint (the one-step torch_dist -> HF path);
    `tokenizer`: a transformers tokenizer saved beside it (None: none)."""
    from megatron_sp.models.families import (full_tensors, megatron_sp_to_hf, token_ids_of,
                                             write_hf_folder)
    model, ckpt = read_model(load_dir)
    say_read(ckpt)
    full = full_tensors(model)
    hf_config, state = megatron_sp_to_hf(model.config, full, family,
                                         token_ids_of(tokenizer) if tokenizer else None)
    write_hf_folder(save_dir, hf_config, state)
    return hf_config


def recorded_tokenizer(load_dir: str) -> dict:
    """The tokenizer arguments a Megatron-LM checkpoint stores (for the export's message)."""
    try:
        args = read_checkpoint(load_dir).stored
    except CheckpointError:
        return {}
    return {k: args.get(k) for k in ("tokenizer_type", "tokenizer_model", "vocab_file")}


def to_megatron(load_dir: str, save_dir: str, *, loader: str, ckpt_format: str, tp: int,
                pp: int, transformer_impl: str) -> str:
    """Write a Megatron-LM checkpoint at tp x pp from a megatron_sp checkpoint, export or HF
    folder (`loader` megatron_sp) or from a Megatron-LM checkpoint (`loader` megatron: a change
    of layout or format). The source's iteration, consumed samples and schedule go with it."""
    from megatron_sp.models.families import full_tensors
    if loader in LOADERS:
        model, ckpt = read_model(load_dir)
        say_read(ckpt)
        iteration, scheduler = ckpt.iteration, ckpt.scheduler
        extra = {k: ckpt.stored[k] for k in ("consumed_train_samples", "consumed_valid_samples",
                                           "global_batch_size", "seq_length", "tokenizer_type",
                                           "tokenizer_model", "vocab_file", "merge_file")
                 if ckpt.stored.get(k) is not None}
    else:
        from megatron_sp import load_pretrained
        model = load_pretrained(load_dir)
        iteration, scheduler, extra = _our_progress(load_dir)
    return write_checkpoint(save_dir, model.config, full_tensors(model), ckpt_format=ckpt_format,
                            tp=tp, pp=pp, iteration=iteration, transformer_impl=transformer_impl,
                            scheduler=scheduler, extra_args=extra)


def _our_progress(load_dir: str):
    """(iteration, Megatron-LM scheduler state, stored arguments) of a megatron_sp checkpoint;
    ('release', None, {}) for a converted one, an export or a Hugging Face folder."""
    from megatron_sp.checkpointing import read_meta, resolve_checkpoint
    try:
        folder = resolve_checkpoint(load_dir) if os.path.isdir(load_dir) else None
        meta = read_meta(folder) if folder else {}
    except CheckpointError:
        meta = {}
    iteration = meta.get("iteration", RELEASE)
    if iteration in (None, RELEASE, 0):
        return RELEASE, None, {}
    args = meta.get("args") or {}
    state = meta.get("train_state") or {}
    gbs = args.get("global_batch_size") or 1
    extra = {"consumed_train_samples": state.get("consumed_train_samples", 0),
             "consumed_valid_samples": state.get("consumed_valid_samples", 0),
             "global_batch_size": gbs, "seq_length": args.get("seq_length")}
    extra.update({k: args[k] for k in ("tokenizer_type", "tokenizer_model", "vocab_file",
                                       "merge_file") if args.get(k)})
    return int(iteration), megatron_scheduler(meta.get("scheduler"), gbs), extra


def load_flags(folder: str, ckpt_format: str) -> str:
    """The Megatron-LM flags that load a checkpoint written by `to_megatron`."""
    release = os.path.basename(folder) == RELEASE
    return (f"--load {os.path.dirname(folder)} --ckpt-format {ckpt_format} --use-checkpoint-args "
            + ("--finetune" if release else "--no-load-optim --no-load-rng"))
