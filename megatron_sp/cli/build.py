"""The command line becomes one frozen JobConfig: the embedded default run, the namespace sorted
into the sections of megatron_sp.config, and the checks that only the command line can make.

    args = parse_args(argv)                   # megatron_sp.cli.arguments: Megatron-LM's flag names
    embedded = apply_embedded_default(args, argv)
    job = job_config(args)                    # frozen: the library takes this, never `args`

`parse_job(argv)` does the first and the last step in one call (no embedded default).
"""
from __future__ import annotations

import os
import sys

from megatron_sp.cli.arguments import parse_args
from megatron_sp.config import JobConfig
from megatron_sp.errors import ConfigError

# The embedded default: a tiny GPT that trains on CPU in a few minutes.
EMBEDDED_DEFAULT = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256,
                        micro_batch_size=8, global_batch_size=8, train_iters=100, lr=2e-3,
                        log_interval=10, eval_interval=50, eval_iters=2,
                        attention_dropout=0.0, hidden_dropout=0.0)
EMBEDDED_RUN_DIR = os.path.join("runs", "default")   # checkpoints/ and metrics.jsonl


def job_config(args) -> JobConfig:
    """The frozen JobConfig of a parsed (and edge-resolved) namespace; each section checks its
    rules here (ConfigError, one sentence)."""
    flags = {k: v for k, v in vars(args).items() if k != "megatron_notes"}
    return JobConfig.from_flags(flags, notes=getattr(args, "megatron_notes", ()), strict=False)


# The MoE flags of ModelFlags that become GPTConfig fields of the same name (None: the preset's
# or GPTConfig's default).
MOE_FIELDS = ("num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq",
              "moe_shared_expert_intermediate_size", "moe_router_score_function",
              "moe_router_topk_scaling_factor", "moe_aux_loss_coeff", "moe_z_loss_coeff",
              "moe_router_load_balancing_type", "moe_expert_capacity_factor")


def moe_fields(model) -> dict:
    """GPTConfig fields of Megatron-LM's MoE flags (`model`: the run's ModelFlags); a list
    --moe-layer-freq becomes a list, as GPTConfig keeps it."""
    fields = {n: getattr(model, n) for n in MOE_FIELDS if getattr(model, n) is not None}
    if isinstance(fields.get("moe_layer_freq"), tuple):
        fields["moe_layer_freq"] = list(fields["moe_layer_freq"])
    for name in ("moe_router_pre_softmax", "moe_pad_expert_input_to_capacity",
                 "moe_shared_expert_gate"):
        if getattr(model, name):
            fields[name] = True
    return fields


def check_moe_model(model, config) -> None:
    """--moe-* flags on a model without experts are refused (never silently ignored)."""
    given = model.moe_flags_given()
    if config.num_experts is None and given:
        raise ConfigError(f"{given[0]} is a mixture-of-experts flag but the model has no "
                          f"experts: add --num-experts N (or drop the --moe-* flags).")


def parse_job(argv=None) -> JobConfig:
    """parse_args + job_config: the JobConfig of a command line, without the embedded default."""
    return job_config(parse_args(argv))


def explicit_flags(argv=None) -> set[str]:
    """Destinations of the flags given on the command line (e.g. {"train_iters"})."""
    argv = sys.argv[1:] if argv is None else argv
    return {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}


def print_warning(message: str) -> None:
    """A start-up warning on stderr, from rank 0 only (the process group does not exist yet)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr, flush=True)


def apply_embedded_default(args, argv=None) -> bool:
    """No data and no model given: the embedded default run (returns True if applied).

    Flags given explicitly on the command line (`argv`) win over the defaults.
    """
    if args.data_path or args.mock_data or args.model or args.num_layers:
        return False
    explicit = explicit_flags(argv)
    for key, value in EMBEDDED_DEFAULT.items():
        if key not in explicit:
            setattr(args, key, value)
    if "train_samples" in explicit:      # --train-samples given: iterations follow from it
        args.train_iters = args.train_samples // args.global_batch_size
    _embedded_run_dir(args, explicit)
    if "lr_warmup_iters" not in explicit and "lr_warmup_fraction" not in explicit:
        args.lr_warmup_iters = args.train_iters // 10      # 10 of the default 100
    args.lr_decay_iters = args.lr_decay_iters if "lr_decay_iters" in explicit else args.train_iters
    args.lr_decay_style = "cosine" if "lr_decay_style" not in explicit else args.lr_decay_style
    args.min_lr = args.lr / 10 if "min_lr" not in explicit else args.min_lr
    args.position_embedding_type = args.position_embedding_type or "rope"
    args.normalization = args.normalization or "RMSNorm"
    args.swiglu = True
    args.disable_bias_linear = True
    return True


def _embedded_run_dir(args, explicit: set[str]) -> None:
    """One run folder holds the checkpoints and the metrics: --save DIR puts the metrics beside it,
    --metrics-jsonl FILE puts the checkpoints beside it; --load defaults to --save (resume)."""
    if "save" in explicit and args.save:
        run_dir = os.path.dirname(os.path.abspath(args.save))
    elif "metrics_jsonl" in explicit and args.metrics_jsonl:
        run_dir = os.path.dirname(os.path.abspath(args.metrics_jsonl))
    else:
        run_dir = EMBEDDED_RUN_DIR
    if "save" not in explicit:
        args.save = os.path.join(run_dir, "checkpoints")
    if "metrics_jsonl" not in explicit:
        args.metrics_jsonl = os.path.join(run_dir, "metrics.jsonl")
    if "load" not in explicit:
        args.load = args.save


def embedded_run_done(job: JobConfig) -> bool:
    """The embedded default's checkpoint under --save: True (after saying so) when that run has
    finished; None-safe resume otherwise. A checkpoint of a run with another --train-iters is
    refused rather than trained over."""
    from megatron_sp.checkpointing import CheckpointError, read_meta, resolve_checkpoint
    save, train_iters = job.checkpoint.save, job.training.train_iters
    if not save or job.checkpoint.load != save:
        return False
    try:
        folder = resolve_checkpoint(save)
        meta = read_meta(folder) if folder else None
    except CheckpointError:
        return False                      # the load reports a damaged checkpoint properly
    if meta is None:
        return False
    iteration = meta.get("iteration")
    planned = (meta.get("args") or {}).get("train_iters")
    if planned is not None and planned != train_iters:
        raise ConfigError(f"{save} holds an embedded-default run of {planned} iterations "
                          f"(at iteration {iteration}), not {train_iters}; pass another --save "
                          f"folder or delete that one to train again.")
    if isinstance(iteration, int) and iteration >= train_iters:
        print_warning(f"> the embedded default has already finished: {folder} (iteration "
                      f"{iteration} of {train_iters}); metrics in {job.logging.metrics_jsonl}. "
                      f"Delete {os.path.dirname(os.path.abspath(save))} or pass "
                      f"--save DIR to train again.")
        return True
    return False
