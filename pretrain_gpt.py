#!/usr/bin/env python
"""Pretrain a GPT model (GPT-2 or Llama family) with tp / Ulysses sp / pp / dp on one mesh.

    python pretrain_gpt.py                       # embedded default: tiny GPT on stdlib docs, CPU
    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --sequence-parallel-size 2 --model llama-tiny --data-path my_text_document ...

Flags follow Megatron-LM (see `--help` and README). This file ties the core (megatron_sp), the
models (megatron_sp.models) and the data pipeline (megatron_sp.data) together.
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch

from megatron_sp.arguments import parse_args
from megatron_sp.checkpointing import CheckpointError, CheckpointManager, finalize_async_save
from megatron_sp.cpu_allocator import keep_freed_memory
from megatron_sp.errors import ConfigError, DataError, reraise_as, run_main
from megatron_sp.flops import flops_for_config
from megatron_sp.mesh import ParallelMesh, barrier, init_distributed, shutdown
from megatron_sp.optimizer import LRScheduler, build_optimizer
from megatron_sp import pipeline, rampup
from megatron_sp.tensor_parallel import RNGTracker
from megatron_sp.training import (MetricsWriter, NonFiniteLossError, Trainer, format_log_line,
                                  print_rank0)
from megatron_sp.memory import MemoryOptions, SavedTensorAccountant, format_report, peak_device_memory
from megatron_sp.models import GPTConfig, GPTModel, preset
from megatron_sp.models.init import init_parameters
from megatron_sp.sharding.state_bytes import format_state_bytes

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "megatron_sp")

# The embedded default: a tiny GPT that trains on CPU in a few minutes.
EMBEDDED_DEFAULT = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256,
                        micro_batch_size=8, global_batch_size=8, train_iters=100, lr=2e-3,
                        log_interval=10, eval_interval=50, eval_iters=2,
                        attention_dropout=0.0, hidden_dropout=0.0)
EMBEDDED_RUN_DIR = os.path.join("runs", "default")   # checkpoints/ and metrics.jsonl


def model_config(args, vocab_size: int) -> GPTConfig:
    """Preset (--model) overridden by explicit Megatron flags."""
    fields = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels, max_position_embeddings=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        normalization=args.normalization, norm_epsilon=args.norm_epsilon,
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std)
    if args.num_query_groups is not None:
        fields["num_query_groups"] = args.num_query_groups
    if args.swiglu:
        fields["activation"] = "swiglu"
    elif args.openai_gelu:
        fields["activation"] = "gelu_tanh"
    if args.disable_bias_linear:
        fields["add_bias_linear"] = False
    if args.add_qkv_bias:
        fields["add_qkv_bias"] = True
    if args.untie_embeddings_and_output_weights:
        fields["tie_embeddings"] = False
    from megatron_sp.models import families   # --qk-layernorm, RoPE scaling, a checkpoint's window
    fields.update(families.family_fields(args))
    families.check_sliding_window(args)
    if args.apply_layernorm_1p:                   # Megatron-LM's model variants (issue 17)
        fields["apply_layernorm_1p"] = True
    if args.rotary_percent != 1.0:
        fields["rotary_percent"] = args.rotary_percent
    fields = {k: v for k, v in fields.items() if v is not None}
    fields["vocab_size"] = families.model_vocab_size(args, vocab_size)
    fields["make_vocab_size_divisible_by"] = args.make_vocab_size_divisible_by
    if args.model:
        return preset(args.model, **fields)
    fields.setdefault("max_position_embeddings", args.seq_length)
    fields.setdefault("attention_dropout", 0.1)   # Megatron-LM's defaults when no preset is named
    fields.setdefault("hidden_dropout", 0.1)
    return GPTConfig(**fields)


def explicit_flags(argv=None) -> set[str]:
    """Destinations of the flags given on the command line (e.g. {"train_iters"})."""
    argv = sys.argv[1:] if argv is None else argv
    return {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}


def apply_checkpoint_args(args, argv=None) -> int | None:
    """--use-checkpoint-args (Megatron's flag): the model flags come from the --load checkpoint's
    stored config, so a converted or earlier checkpoint needs only data and training flags.

    Returns the checkpoint's vocabulary size (None without the flag). An explicit model flag that
    disagrees with the checkpoint is named in a warning and replaced by the checkpoint's value.
    """
    if not args.use_checkpoint_args:
        return None
    from megatron_sp.arguments import build_parser
    from megatron_sp.checkpointing import read_meta, resolve_checkpoint
    from megatron_sp.models.config import config_to_flags
    if not args.load:
        raise SystemExit("error: --use-checkpoint-args reads the model from a checkpoint: pass it "
                         "with --load DIR.")
    try:
        folder = resolve_checkpoint(args.load)
        saved = read_meta(folder).get("config") if folder else None
    except CheckpointError as err:
        raise SystemExit(f"error: {err}") from None
    if not saved:
        raise SystemExit(f"error: --use-checkpoint-args found no checkpoint with a stored model "
                         f"config under --load {args.load}; give the model flags instead.")
    config = GPTConfig.from_dict(saved)
    parser = build_parser()
    stored = parser.parse_args(config_to_flags(config))
    model_group = next(g for g in parser._action_groups if g.title == "model")
    explicit = explicit_flags(argv)
    for action in model_group._group_actions:
        if action.dest in ("model", "vocab_size", "seq_length"):   # not part of the stored model
            continue
        value = getattr(stored, action.dest)
        if action.dest in explicit and getattr(args, action.dest) != value:
            print_warning(f"warning: {action.option_strings[0]} {getattr(args, action.dest)} is "
                          f"replaced by the checkpoint's {value} (--use-checkpoint-args).")
        setattr(args, action.dest, value)
    args.model = None
    return config.vocab_size


def print_warning(message: str) -> None:
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


def embedded_run_done(args) -> bool:
    """The embedded default's checkpoint under --save: True (after saying so) when that run has
    finished; None-safe resume otherwise. A checkpoint of a run with another --train-iters is
    refused rather than trained over."""
    from megatron_sp.checkpointing import read_meta, resolve_checkpoint
    if not args.save or args.load != args.save:
        return False
    try:
        folder = resolve_checkpoint(args.save)
        meta = read_meta(folder) if folder else None
    except CheckpointError:
        return False                      # the load reports a damaged checkpoint properly
    if meta is None:
        return False
    iteration = meta.get("iteration")
    planned = (meta.get("args") or {}).get("train_iters")
    if planned is not None and planned != args.train_iters:
        raise SystemExit(f"error: {args.save} holds an embedded-default run of {planned} iterations "
                         f"(at iteration {iteration}), not {args.train_iters}; pass another --save "
                         f"folder or delete that one to train again.")
    if isinstance(iteration, int) and iteration >= args.train_iters:
        print_warning(f"> the embedded default has already finished: {folder} (iteration "
                      f"{iteration} of {args.train_iters}); metrics in {args.metrics_jsonl}. "
                      f"Delete {os.path.dirname(os.path.abspath(args.save))} or pass "
                      f"--save DIR to train again.")
        return True
    return False


def build_tokenizer_and_data(args, mesh):
    """(tokenizer or None, data prefix list or None) following --data-path / --mock-data / default."""
    from megatron_sp import data as msdata
    if args.mock_data:
        vocab = args.vocab_size or 1024
        return msdata.build_tokenizer("NullTokenizer", vocab_size=vocab), None
    if not args.data_path:
        cache = args.cache_dir or DEFAULT_CACHE
        if mesh.rank == 0:
            if not msdata.default_corpus_ready(cache):
                print_rank0(mesh, f"> building the embedded default corpus under {cache} (once) ...")
            prefix, model_path = msdata.build_default_corpus(cache)
        barrier(mesh)
        prefix, model_path = msdata.build_default_corpus(cache)
        args.data_path = [prefix]
        args.tokenizer_type, args.tokenizer_model = "GPTSentencePieceTokenizer", model_path
        args.data_cache_path = args.data_cache_path or os.path.join(cache, "index-cache")
    if args.tokenizer_type is None:
        raise SystemExit("error: --data-path needs --tokenizer-type (and --tokenizer-model).")
    tok = msdata.build_tokenizer(args.tokenizer_type, args.tokenizer_model, vocab_size=args.vocab_size,
                                 vocab_file=args.vocab_file, merge_file=args.merge_file)
    return tok, args.data_path


class MockDataset:
    """Random tokens, the same sample i in every layout (seeded by the sample index)."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, num_samples: int):
        self.vocab, self.seq, self.seed, self.n = vocab_size, seq_length, seed, num_samples

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import numpy as np
        rng = np.random.default_rng([self.seed, i])
        text = rng.integers(0, self.vocab, self.seq + 1, dtype=np.int64)
        return {"tokens": text[:-1], "labels": text[1:],
                "loss_mask": np.ones(self.seq, dtype=np.float32),
                "position_ids": np.arange(self.seq, dtype=np.int64)}


def build_datasets(args, tokenizer, data_path, mesh, state):
    """(train, valid) datasets; sample counts as Megatron-LM computes them, raised when a resumed
    run (with another global batch size) needs more than that."""
    from megatron_sp import data as msdata
    from megatron_sp.data.builder import parse_data_path
    needed = state.consumed_train_samples + (args.train_iters - state.iteration) * args.global_batch_size
    train_samples = max(args.train_iters * args.global_batch_size, needed)
    eval_runs = args.train_iters // args.eval_interval + 1
    runs_left = args.train_iters // args.eval_interval - state.iteration // args.eval_interval + 1
    eval_samples = max(eval_runs * args.eval_iters * args.global_batch_size,
                       state.consumed_valid_samples + runs_left * args.eval_iters * args.global_batch_size)
    if data_path is None:
        return (MockDataset(tokenizer.vocab_size, args.seq_length, args.seed, train_samples),
                MockDataset(tokenizer.vocab_size, args.seq_length, args.seed + 1, eval_samples))
    # Megatron-core's default index cache: next to the (first) data file.
    first_prefix = parse_data_path(data_path)[0][0]
    cache = args.data_cache_path or os.path.join(os.path.dirname(os.path.abspath(first_prefix)),
                                                 "cache", "GPTDataset_indices")
    train, valid, _ = msdata.build_gpt_datasets(
        data_path, args.split, args.seq_length, args.seed,
        (train_samples, eval_samples if args.eval_iters > 0 else 0, 0),
        tokenizer.eod, tokenizer.pad, cache,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        return_document_ids=args.reset_attention_mask,
        rank=mesh.rank, world_size=mesh.world_size, barrier=lambda: barrier(mesh))
    return train, valid


def loader(dataset, consumed, args, mesh, vocab_size=None):
    """This dp rank's micro-batches; token ids outside the vocabulary stop the run with one line."""
    from megatron_sp.data import PretrainingDataLoader
    return iter(PretrainingDataLoader(dataset, consumed, args.micro_batch_size, mesh.dp_rank,
                                      mesh.dp_size, vocab_size=vocab_size,
                                      num_workers=getattr(args, "num_workers", 0),
                                      cyclic=getattr(args, "dataloader_type", "single") == "cyclic",
                                      seed=args.seed))


def wandb_options(args) -> dict | None:
    """--wandb-project / --wandb-exp-name / --wandb-save-dir (Megatron's), or None."""
    if not args.wandb_project:
        return None
    return {"project": args.wandb_project, "name": args.wandb_exp_name,
            "dir": args.wandb_save_dir, "config": {k: v for k, v in vars(args).items()
                                                   if isinstance(v, (int, float, str, bool))}}


def build_model(config, mesh, args, device):
    """This stage's model chunks: contiguous global layer ids per stage (one chunk per virtual stage
    with --num-layers-per-virtual-pipeline-stage); embedding on the first, loss on the last."""
    tracker = RNGTracker(args.seed, tp_rank=mesh.tp_rank, pp_rank=mesh.pp_rank, sp_rank=mesh.sp_rank)
    try:
        specs = pipeline.chunk_specs(config.num_layers, mesh,
                                     layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage,
                                     first=args.decoder_first_pipeline_num_layers,
                                     last=args.decoder_last_pipeline_num_layers)
    except pipeline.PipelineLayoutError as err:
        raise SystemExit(f"error: {err}") from None
    chunks = []
    for spec in specs:
        from megatron_sp import fp8   # --transformer-impl, --fp8-param-gather (Transformer Engine)
        with fp8.model_init_context(args):
            model = GPTModel(config, mesh, attention_backend=fp8.attention_backend(args),
                             sequence_parallel=args.sequence_parallel, rng_tracker=tracker,
                             memory=MemoryOptions.from_args(args), **spec)
        init_parameters(model, seed=args.seed)
        chunks.append(model.to(device))
    return chunks


def build_sharding(chunks, mesh, args, device):
    """The Trainer's state sharding (DESIGN 11): --use-distributed-optimizer (the optimizer that
    shards itself), --use-torch-fsdp2 (shards the chunks); None: replicated state."""
    if args.use_distributed_optimizer:
        from megatron_sp.sharding.distributed_optimizer import DistributedOptimizer
        return DistributedOptimizer.from_args(chunks, mesh, args)
    if not args.use_torch_fsdp2:
        return None
    from megatron_sp.sharding.fsdp import FSDPLayoutError, apply_fsdp2
    try:
        return apply_fsdp2(chunks, mesh, bf16=args.bf16, cpu_offload=args.optimizer_cpu_offload,
                           device=device)
    except FSDPLayoutError as err:
        raise SystemExit(f"error: {err}") from None


def build_schedule(chunks, mesh, args):
    """No pipelining, 1F1B or interleaved 1F1B; refuses a micro-batch count it cannot run."""
    num_micro_batches = args.global_batch_size // (args.micro_batch_size * mesh.dp_size)
    if mesh.pp_size > 1:
        try:
            pipeline.check_num_microbatches(num_micro_batches, mesh.pp_size, len(chunks))
        except pipeline.PipelineLayoutError as err:
            raise SystemExit(f"error: {err}") from None
    return pipeline.get_forward_backward_func(mesh.pp_size, len(chunks))


def main(argv=None):
    args = parse_args(argv)
    embedded = apply_embedded_default(args, argv)
    if embedded and embedded_run_done(args):
        return
    env = init_distributed(args.distributed_backend, args.distributed_timeout_minutes)
    # Share this node's cores among its processes (LOCAL_WORLD_SIZE from torchrun, else SLURM's).
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", "1")
                               .split("(")[0] or 1)) if env else 1
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, local)))
    mesh = ParallelMesh.from_sizes(tp=args.tensor_model_parallel_size, sp=args.sequence_parallel_size,
                                   pp=args.pipeline_model_parallel_size)
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available()
                          else "cpu")
    if device.type == "cpu":
        keep_freed_memory()      # no page faults for the tensors every step re-allocates
    torch.manual_seed(args.seed)
    with reraise_as(DataError, ValueError):
        tokenizer, data_path = build_tokenizer_and_data(args, mesh)
    if args.seq_length is None:
        raise SystemExit("error: --seq-length is required.")
    checkpoint_vocab = apply_checkpoint_args(args, argv)
    with reraise_as(ConfigError, ValueError, prefix="the model flags (--model and the flags that "
                                                    "override it) do not fit: "):
        config = model_config(args, checkpoint_vocab or tokenizer.vocab_size)
        config.check_parallel(mesh.tp_size, mesh.sp_size, mesh.pp_size)
    if not args.add_position_embedding and not config.uses_rope:   # Megatron refuses it too
        raise SystemExit(f"error: --no-position-embedding with --position-embedding-type "
                         f"{config.position_embedding_type}: the flag is deprecated in Megatron-LM; "
                         f"use --position-embedding-type rope (which has no learned embedding).")
    if tokenizer.vocab_size > config.padded_vocab_size(mesh.tp_size):
        raise SystemExit(f"error: the tokenizer has {tokenizer.vocab_size} tokens but the checkpoint's "
                         f"model only {config.padded_vocab_size(mesh.tp_size)} embeddings; use the "
                         f"tokenizer the checkpoint was trained with.")
    if args.seq_length > config.max_position_embeddings and config.position_embedding_type == "learned_absolute":
        raise SystemExit(f"error: --seq-length {args.seq_length} exceeds --max-position-embeddings "
                         f"{config.max_position_embeddings} of learned position embeddings.")
    if args.seq_length % (mesh.sp_size * (mesh.tp_size if args.sequence_parallel else 1)):
        raise SystemExit(f"error: --seq-length {args.seq_length} is not divisible by the sequence "
                         f"shards (sp={mesh.sp_size}" + (f" x tp={mesh.tp_size}" if args.sequence_parallel
                                                         else "") + ").")
    chunks = build_model(config, mesh, args, device)
    sharding = build_sharding(chunks, mesh, args, device)
    for note in getattr(args, "megatron_notes", []):    # mapped and no-op Megatron flags (issue 17)
        print_rank0(mesh, note)
    print_rank0(mesh, f"> {mesh}\n> model: {config.num_parameters() / 1e6:.2f}M parameters, "
                      f"{config}\n> attention backend: {chunks[0].attention_backend_name}")
    if args.use_distributed_optimizer:   # also the optimizer: Adam state sharded over dp x sp
        optimizer = sharding
    else:
        optimizer = build_optimizer(chunks, args.lr, args.weight_decay,
                                    (args.adam_beta1, args.adam_beta2), args.adam_eps,
                                    optimizer=args.optimizer, sgd_momentum=args.sgd_momentum,
                                    decoupled_lr=args.decoupled_lr,
                                    decoupled_min_lr=args.decoupled_min_lr)
    warmup, decay, wsd = rampup.schedule_steps(args)    # iterations, or Megatron's samples
    scheduler = LRScheduler(optimizer, args.lr, args.min_lr, warmup, decay, args.lr_decay_style, wsd)
    trainer = Trainer(chunks, optimizer, scheduler, mesh, global_batch_size=args.global_batch_size,
                      micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                      clip_grad=args.clip_grad, bf16=args.bf16,
                      flops_per_step=flops_for_config(config, args.global_batch_size, args.seq_length,
                                                      mesh.tp_size),
                      peak_tflops=args.peak_tflops, bucket_mb=args.grad_bucket_size_mb,
                      schedule=build_schedule(chunks, mesh, args), sharding=sharding)
    from megatron_sp import fp8
    from megatron_sp.loss_scaler import LossScaler
    trainer.set_precision(args.fp16, LossScaler.from_args(args), fp8.fp8_autocast_factory(args, mesh),
                          grad_reduce_in_bf16=args.grad_reduce_in_bf16)
    trainer.lr_in_samples = rampup.counts_samples(args)
    trainer.log_params_norm, trainer.log_num_zeros_in_grad = args.log_params_norm, args.log_num_zeros_in_grad
    ramp = rampup.BatchSizeRampup.from_args(args)
    if ramp is not None:
        ramp.check_divisible(args.micro_batch_size * mesh.dp_size)
        for batch in range(ramp.start, ramp.global_batch_size, ramp.increment):   # every ramp step
            try:
                pipeline.check_num_microbatches(batch // (args.micro_batch_size * mesh.dp_size),
                                                mesh.pp_size, len(chunks))
            except pipeline.PipelineLayoutError as err:
                raise SystemExit(f"error: --rampup-batch-size: {err}") from None
    checkpoints = CheckpointManager(args, trainer, config)   # --load, --save, exit conditions
    try:
        loaded = checkpoints.load()
    except CheckpointError as err:   # the ranks agreed on it (load_checkpoint): said once
        raise SystemExit(f"error: {err}" if mesh.rank == 0 else 1) from None
    if args.exit_on_missing_checkpoint and args.load and loaded is None:
        raise SystemExit(f"error: --exit-on-missing-checkpoint: no checkpoint under --load "
                         f"{args.load}; check the path or drop the flag to start from scratch.")
    if args.train_samples is not None and ramp is not None:   # resumed mid-ramp or after it
        args.train_iters = trainer.state.iteration + ramp.train_iters(
            args.train_samples, trainer.state.consumed_train_samples)
    elif args.train_samples is not None:   # resumed, maybe with another batch size: stop at the samples
        remaining = max(0, args.train_samples - trainer.state.consumed_train_samples)
        args.train_iters = trainer.state.iteration + remaining // args.global_batch_size
    with reraise_as(DataError, ValueError, TimeoutError):
        train_ds, valid_ds = build_datasets(args, tokenizer, data_path, mesh, trainer.state)
    vocab = tokenizer.vocab_size                              # each micro-batch is checked
    train_iter = loader(train_ds, trainer.state.consumed_train_samples, args, mesh, vocab)
    valid_iter = (loader(valid_ds, trainer.state.consumed_valid_samples, args, mesh, vocab)
                  if valid_ds is not None else None)
    trainer.set_failure_policy(args.nonfinite_loss, args.distributed_timeout_minutes,
                               args.max_skipped_steps)
    metrics = MetricsWriter(mesh, args.metrics_jsonl, args.tensorboard_dir,
                            resume_iteration=trainer.state.iteration,
                            wandb=wandb_options(args) if mesh.rank == 0 else None)
    try:
        train(args, trainer, train_iter, valid_iter, metrics, checkpoints, ramp)
    except NonFiniteLossError:   # publish a save begun before the divergence; none after it
        finalize_async_save()
        metrics.close()
        raise
    checkpoints.finish()
    metrics.close()
    if embedded:
        print_rank0(mesh, f"> embedded default finished: the lm loss above fell from about "
                          f"ln({tokenizer.vocab_size}) = {math.log(tokenizer.vocab_size):.2f}.\n"
                          f"> checkpoint: {os.path.abspath(args.save) if args.save else 'none'}\n"
                          f"> metrics:    {os.path.abspath(args.metrics_jsonl) if args.metrics_jsonl else 'stdout only'}")
    shutdown()


def train(args, trainer, train_iter, valid_iter, metrics, checkpoints=None, ramp=None):
    from megatron_sp import comm_stats
    from megatron_sp.profiling import StepProfiler
    mesh = trainer.mesh
    comm_stats.reset()
    profiler = StepProfiler.from_args(args, mesh)
    start, last_logged = time.time(), trainer.state.iteration
    while trainer.state.iteration < args.train_iters:
        if ramp is not None:          # --rampup-batch-size: this step's global batch
            trainer.set_global_batch_size(ramp.batch_size(trainer.state.consumed_train_samples))
        profiler.before_step(trainer.state.iteration + 1)
        try:
            mbs = [next(train_iter) for _ in range(trainer.num_micro_batches)]
        except StopIteration:
            raise SystemExit(
                f"error: the training data ran out at iteration {trainer.state.iteration} after "
                f"{trainer.state.consumed_train_samples} samples; raise the dataset's sample count "
                f"or lower --train-iters.") from None
        nxt = trainer.state.iteration + 1
        logging = nxt % args.log_interval == 0 or nxt == args.train_iters
        if args.report_memory and logging:   # --report-memory: account this step's saved tensors
            accountant = SavedTensorAccountant().attach(trainer.chunks)
            with accountant.recording():
                result = trainer.train_step(mbs)
            accountant.detach()
        else:
            result = trainer.train_step(mbs)
        it = trainer.state.iteration
        profiler.after_step(it)
        if it % args.log_interval == 0 or it == args.train_iters:
            elapsed = time.time() - start
            record = trainer.log_record(result, elapsed, it - last_logged)
            line = format_log_line(record, args.train_iters)
            if args.report_memory:
                report = accountant.report()
                record["saved_bytes_per_rank"] = report["device_bytes"]
                record["offloaded_bytes_per_rank"] = report["host_bytes"]
                line += " | " + format_report(report, peak_device_memory(trainer.device))
                state_bytes = trainer.sharding.model_state_bytes(trainer.optimizer)
                record.update({f"model_state_{k}": v for k, v in state_bytes.items()})
                line += " | " + format_state_bytes(state_bytes)
            print_rank0(mesh, line)
            metrics.write(record)
            comm_stats.reset()
            start, last_logged = time.time(), it
        if valid_iter is not None and args.eval_iters > 0 and (
                it % args.eval_interval == 0 or it == args.train_iters):
            val = trainer.evaluate(valid_iter, args.eval_iters)
            print_rank0(mesh, f"validation at iteration {it} | lm loss: {val:.6E}")
            metrics.write({"iteration": it, "valid_lm_loss": val})
            start = time.time()
        if checkpoints is not None and trainer.consecutive_skipped:
            checkpoints.last_saved = it   # no save inside a run of skipped steps (a divergence?)
        if checkpoints is not None and checkpoints.after_step():   # saves; signal/exit flags
            break
    profiler.close()


if __name__ == "__main__":
    run_main(main)   # user errors in one sentence, said once; exit 0 when main returned (errors.py)
