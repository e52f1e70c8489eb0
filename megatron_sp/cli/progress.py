"""What pretrain_gpt.py says while a user waits: each start-up phase in one line with its time, the
model in one short line (the full config is in every checkpoint's megatron_sp.json), and on Ctrl-C
the last complete checkpoint with the command that resumes from it."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import sys
import time


@contextlib.contextmanager
def phase(mesh, done: str):
    """One line when the phase is over, `> {done} in {seconds} s` (rank 0); the body may set
    `note["text"]` to add to it."""
    from megatron_sp.training.metrics import print_rank0
    note = {"text": ""}
    start = time.time()
    yield note
    print_rank0(mesh, f"> {done} in {time.time() - start:.1f} s{note['text']}")


def model_summary(config, tp: int = 1) -> str:
    """One short line of the model's shape (what differs from a plain GPT is named)."""
    from megatron_sp.models import GPTConfig
    c = config
    heads = f"heads {c.num_attention_heads}"
    if c.num_query_groups != c.num_attention_heads:
        heads += f" (kv {c.num_query_groups})"
    if c.kv_channels * c.num_attention_heads != c.hidden_size:
        heads += f", head dim {c.kv_channels}"
    vocab = f"vocab {c.vocab_size}"
    if c.padded_vocab_size(tp) != c.vocab_size:
        vocab += f" (padded {c.padded_vocab_size(tp)})"
    positions = c.position_embedding_type.replace("learned_absolute", "learned positions")
    if c.uses_rope:
        positions += f" base {c.rotary_base:g}"
    parts = [f"{c.num_parameters() / 1e6:.2f}M parameters", f"layers {c.num_layers}",
             f"hidden {c.hidden_size}", heads, f"ffn {c.ffn_hidden_size} {c.activation}", vocab,
             positions, c.normalization, "tied" if c.tie_embeddings else "untied"]
    if not c.add_bias_linear:
        parts.append("no biases" + (" (but q/k/v)" if c.add_qkv_bias else ""))
    if c.attention_dropout or c.hidden_dropout:
        parts.append(f"dropout {c.attention_dropout:g}/{c.hidden_dropout:g}")
    defaults = GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=1, vocab_size=8)
    shown = {"num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
             "ffn_hidden_size", "vocab_size", "position_embedding_type", "rotary_base",
             "normalization", "activation", "tie_embeddings", "attention_dropout",
             "hidden_dropout", "max_position_embeddings", "add_qkv_bias", "add_bias_linear",
             "make_vocab_size_divisible_by", "norm_epsilon", "init_method_std"}
    for f in dataclasses.fields(c):      # the families' features, when on
        value = getattr(c, f.name)
        if f.name not in shown and value != getattr(defaults, f.name) and (
                c.uses_rope or not f.name.startswith(("rope_", "yarn_"))):
            parts.append(f"{f.name}={value}")
    return " | ".join(parts)


def _latest_checkpoint(save: str):
    """(folder, iteration) of the newest complete checkpoint under --save, or None."""
    from megatron_sp.checkpointing import CheckpointError, read_meta, resolve_checkpoint
    try:
        folder = resolve_checkpoint(save)
        return (folder, read_meta(folder).get("iteration")) if folder else None
    except (CheckpointError, OSError, ValueError):
        return None


def interrupted_message(job, iteration: int, argv=None) -> str:
    """Ctrl-C: where the run stopped, the last complete checkpoint and the command that resumes."""
    save, load = job.checkpoint.save, job.checkpoint.load
    from megatron_sp.cli.startup_checks import launcher_world_size
    if launcher_world_size() > 1:
        command = "the launcher's command (torchrun / srun) as it was"
    else:
        command = shlex.join(["python", sys.argv[0] or "pretrain_gpt.py"]
                             + list(sys.argv[1:] if argv is None else argv))
    head = f"after iteration {iteration}"
    if not save:
        return f"{head}; nothing was saved (no --save)."
    latest = _latest_checkpoint(save)
    if latest is None:
        return (f"{head}; no checkpoint was completed under --save {save} yet, so the same "
                f"command starts again from scratch.")
    folder, at = latest
    again = (f"the same command resumes from it: {command}" if load and os.path.abspath(load)
             == os.path.abspath(save) else f"resume from it with --load {save} added to the "
             f"command: {command} --load {shlex.quote(save)}")
    return f"{head}; the last complete checkpoint is {folder} (iteration {at}); {again}"


IDLE_SECONDS_PER_ITERATION = 0.5    # the embedded default's step on 2 idle cores (README's minute)
CORPUS_SECONDS = 20.0               # its corpus and tokenizer, built once, on 2 idle cores


def embedded_estimate(train_iters: int, corpus_cached: bool, cores: int | None = None,
                      load: float | None = None) -> str:
    """The line before the embedded default starts: what it will do and about how long it takes
    on this machine now (its idle figure scaled by the load average: a CPU-bound run gets about
    cores / (load + 1) of the cores when others run)."""
    cores = cores or os.cpu_count() or 1
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    idle = train_iters * IDLE_SECONDS_PER_ITERATION * max(1.0, 2 / cores) + \
        (0.0 if corpus_cached else CORPUS_SECONDS)
    factor = max(1.0, (load + 1) / cores)
    from megatron_sp.training.metrics import format_duration
    build = "" if corpus_cached else "builds its corpus and tokenizer from the stdlib's docs " \
                                     "(once), then "
    busy = (f"; this machine's load average is {load:.1f} on {cores} cores, so expect about "
            f"{format_duration(idle * factor)}") if factor > 1.05 else ""
    return (f"> the embedded default {build}trains {train_iters} iterations of a tiny GPT: about "
            f"{format_duration(idle)} on {cores} idle cores{busy} (the first step's line gives a "
            f"measured ETA) ...")
