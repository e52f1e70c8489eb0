"""The checks pretrain_gpt.py makes before any expensive work (no process group, no model, no data
read yet), each one sentence: the model preset (with the nearest name), the data files, the
tokenizer files and the layout against the number of processes (with the torchrun command that
runs it); then, once the model config and the mesh exist, the model against the run (vocabulary,
positions, heads, the ring and the fused kernels: check_model_fits). They read the parsed
namespace or the JobConfig, so they stay at the command-line edge, where pretrain_gpt.py, tools/
and megatron_sp.hf can all call them.
"""
from __future__ import annotations

import difflib
import math
import os
import shlex
import sys
from typing import TYPE_CHECKING

from megatron_sp.errors import ConfigError, DataError

if TYPE_CHECKING:   # annotations only: the checks import what they use when called
    from megatron_sp.config import JobConfig
    from megatron_sp.models.config import GPTConfig


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


# The model against the run (after the model config and the mesh exist) ------------------------

def installed(module: str) -> bool:
    """Whether an optional package (transformer_engine, flash_attn) can be imported here, asked
    without importing it."""
    import importlib.util
    return importlib.util.find_spec(module) is not None


def check_model_fits(job: JobConfig, config: GPTConfig, tokenizer, mesh) -> None:
    """The rules between the model, the tokenizer, the sequence and the mesh (one sentence each).
    `tokenizer`: anything with a vocab_size."""
    import torch
    from megatron_sp.ulysses import head_chunk_problem
    seq = job.training.seq_length
    if not job.model.add_position_embedding and not config.uses_rope:   # Megatron refuses it too
        raise ConfigError(f"--no-position-embedding with --position-embedding-type "
                          f"{config.position_embedding_type}: the flag is deprecated in Megatron-LM; "
                          f"use --position-embedding-type rope (which has no learned embedding).")
    if tokenizer.vocab_size > config.padded_vocab_size(mesh.tp_size):
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the checkpoint's "
                          f"model only {config.padded_vocab_size(mesh.tp_size)} embeddings; use the "
                          f"tokenizer the checkpoint was trained with.")
    if seq > config.max_position_embeddings and config.position_embedding_type == "learned_absolute":
        raise ConfigError(f"--seq-length {seq} exceeds --max-position-embeddings "
                          f"{config.max_position_embeddings} of learned position embeddings.")
    mesh.dims.check_sequence(seq, job.parallel.sequence_parallel)
    problem = head_chunk_problem(config.num_attention_heads // mesh.tp_size,
                                 config.num_query_groups // mesh.tp_size, mesh.sp_size,
                                 job.memory.ulysses_head_chunks)
    if problem:
        raise ConfigError(problem)
    if mesh.cp_size > 1 and config.attention_dropout:
        raise ConfigError(f"--attention-dropout {config.attention_dropout} with ring attention "
                          f"(--context-parallel-size {job.parallel.context_parallel_size}, "
                          f"--cp-comm-type {job.parallel.cp_comm_type}): dropout on the attention "
                          f"probabilities is not implemented in the ring; pass --attention-dropout 0 "
                          f"or --cp-comm-type a2a.")
    if mesh.cp_size > 1 and ring_is_transformer_engine(job):
        check_te_context_parallel(job, config, mesh)
    elif torch.cuda.is_available() and (mesh.cp_size > 1 or documents_run_blockwise(job)):
        problem = block_kernel_problem(config, mesh)
        if problem:
            raise ConfigError(problem)


def documents_run_blockwise(job: JobConfig) -> bool:
    """Packed documents through SDPA's blockwise attention (the block kernels): SDPA asked for,
    or auto where neither Transformer Engine nor flash-attn is installed (they take cu_seqlens)."""
    from megatron_sp.training import fp8
    backend = fp8.attention_backend(job.model)
    fused = installed("transformer_engine") or installed("flash_attn")
    return job.data.reset_attention_mask and (backend == "sdpa" or (backend == "auto"
                                                                     and not fused))


def block_kernel_problem(config, mesh) -> str | None:
    """Why the fused block kernels (the ring's, and blockwise attention's for packed documents;
    megatron_sp/attention/block_kernels.py) cannot take this run on CUDA, in one sentence: a head
    size FlashAttention-2 and the memory-efficient kernel refuse (not a multiple of 8); None when
    they can."""
    d = config.kv_channels
    where = (f"ring attention (--context-parallel-size {mesh.cp_size})" if mesh.cp_size > 1
             else "packed documents (--reset-attention-mask)")
    if d % 8:
        return (f"{where} runs the fused block kernels (FlashAttention-2 varlen, the "
                f"memory-efficient kernel), which need a head size that is a multiple of 8, got "
                f"{d}: use --kv-channels {8 * math.ceil(d / 8)}"
                + ("." if mesh.cp_size > 1 else ", or --attention-backend te / flash-attn."))
    return None


def ring_is_transformer_engine(job: JobConfig) -> bool:
    """Whether the model's ring will be TE's context parallelism (models.gpt.ring_attention_for):
    Transformer Engine asked for, or picked by auto on a GPU where it is installed."""
    import torch
    from megatron_sp.training import fp8
    backend = fp8.attention_backend(job.model)
    return backend == "te" or (backend == "auto" and torch.cuda.is_available()
                               and installed("transformer_engine"))


def check_te_context_parallel(job: JobConfig, config, mesh) -> None:
    """A ring layout Transformer Engine's context parallelism refuses, in one sentence at
    start-up (heads per rank after our Ulysses exchange, the head size; packed documents run in
    TE's thd layout, context_parallel/te_thd.py)."""
    import torch
    from megatron_sp.context_parallel.te import te_cp_problem
    tp, sp = mesh.tp_size, mesh.sp_size
    dtype = (torch.bfloat16 if job.precision.bf16 else torch.float16 if job.precision.fp16
             else torch.float32)
    problem = te_cp_problem("p2p", mesh.cp_size, config.num_attention_heads // (tp * sp),
                            max(config.num_query_groups // tp, sp) // sp, None,
                            job.data.reset_attention_mask, dtype, head_dim=config.kv_channels)
    if problem:
        raise ConfigError(problem)
