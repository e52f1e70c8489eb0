"""The checks pretrain_gpt.py makes before any expensive work (no process group, no model, no data
read yet), each one sentence: the model preset (with the nearest name), the data files, the
tokenizer files and the layout against the number of processes (with the torchrun command that
runs it). They read the parsed namespace, so they stay at the command-line edge.
"""
from __future__ import annotations

import difflib
import os
import shlex
import sys

from megatron_sp.errors import ConfigError, DataError


def check_preset(model: str | None) -> None:
    """--model names a preset; a typo gets the nearest one ("did you mean 'llama-tiny'?")."""
    from megatron_sp.models.config import PRESETS
    if model is None or model in PRESETS:
        return
    near = difflib.get_close_matches(model, sorted(PRESETS), n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}?" if near else f"choose one of {', '.join(sorted(PRESETS))}."
    raise ConfigError(f"unknown model preset {model!r}; {hint}")


def check_data_files(data_path) -> None:
    """Every --data-path prefix has its .bin and .idx (named before the model is built)."""
    from megatron_sp.data.builder import parse_data_path
    prefixes, _ = parse_data_path(list(data_path))
    for prefix in prefixes:
        missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if not missing:
            continue
        if os.path.isfile(prefix + "_text_document.bin"):
            raise DataError(f"--data-path {prefix}: no {prefix}{missing[0]}, but "
                            f"{prefix}_text_document.bin exists: pass --data-path "
                            f"{prefix}_text_document (tools/preprocess_data.py adds _text_document "
                            f"to its --output-prefix).")
        raise DataError(f"--data-path {prefix}: {' and '.join(prefix + e for e in missing)} "
                        f"{'do' if len(missing) > 1 else 'does'} not exist; make them with "
                        f"tools/preprocess_data.py --output-prefix PREFIX (it writes "
                        f"PREFIX_text_document.bin/.idx) and pass that prefix.")


def check_tokenizer_files(tokenizer_type: str | None, tokenizer_model: str | None,
                          vocab_file: str | None, merge_file: str | None) -> None:
    """The tokenizer's files exist (the tokenizer itself is built later, on every rank)."""
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        if not tokenizer_model or not os.path.isfile(tokenizer_model):
            raise DataError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model with a "
                            f"sentencepiece .model file, got {tokenizer_model!r}, which "
                            f"{'is not given' if not tokenizer_model else 'does not exist'}; "
                            f"tools/train_tokenizer.py writes one (PREFIX.model).")
    elif tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model or not os.path.exists(tokenizer_model):
            raise DataError(f"--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model with a "
                            f"Hugging Face tokenizer folder or tokenizer.json, got "
                            f"{tokenizer_model!r}, which does not exist.")
    elif tokenizer_type == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise DataError(f"--tokenizer-type GPT2BPETokenizer needs {flag} with an existing "
                                f"file, got {path!r}.")


def launcher_world_size() -> int:
    """The number of processes the launcher started (torchrun's WORLD_SIZE, srun's SLURM_NTASKS;
    1 without a launcher)."""
    env = os.environ
    return int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")) or 1)


def check_world_size(parallel, argv=None) -> None:
    """The layout fits the number of processes; one process started without a launcher is told
    the torchrun command that runs the layout. `parallel`: the JobConfig's ParallelConfig."""
    from megatron_sp.mesh import LayoutError, ParallelDims
    world = launcher_world_size()
    sizes = dict(tp=parallel.tensor_model_parallel_size, sp=parallel.sequence_parallel_size,
                 pp=parallel.pipeline_model_parallel_size, cp=parallel.ring_size)
    try:
        ParallelDims(world_size=world, **sizes)
    except LayoutError as err:
        needed = sizes["tp"] * sizes["sp"] * sizes["pp"] * sizes["cp"]
        # The torchrun hint only where more processes fix it: valid sizes whose product does not
        # divide this one process (a size of 0 or -2 is a flag to fix, not a launch to change).
        if world != 1 or min(sizes.values()) < 1 or world % needed == 0:
            raise
        args = shlex.join(sys.argv[1:] if argv is None else argv)
        command = f"torchrun --nproc-per-node {needed} pretrain_gpt.py {args}".strip()
        if len(command) > 160:
            command = f"torchrun --nproc-per-node {needed} pretrain_gpt.py ..."
        raise ConfigError(f"{str(err).rstrip('.')}; this is one process: run it with "
                          f"`{command}`.") from None


def check_sliding_window(load: str | None, seq_length: int | None) -> None:
    """Refuse a --seq-length beyond the sliding window recorded in the --load checkpoint (a
    converted Mistral v0.1): attention here is full, so only shorter sequences are the same model."""
    if not load or not os.path.exists(load) or not seq_length:
        return
    from megatron_sp.checkpointing import CheckpointError, read_meta, resolve_checkpoint
    try:
        folder = resolve_checkpoint(load)
        window = ((read_meta(folder) if folder else {}).get("config") or {}).get("sliding_window")
    except (CheckpointError, OSError, ValueError):   # said in one sentence by the load itself
        return
    if window and seq_length > window:
        raise ConfigError(f"--seq-length {seq_length} exceeds the sliding window {window} "
                          f"of the checkpoint in --load {load}; sliding-window attention is not "
                          f"implemented, so use --seq-length <= {window}.")
