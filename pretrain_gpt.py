#!/usr/bin/env python
"""Pretrain a GPT model (GPT-2 or Llama family) with tp / Ulysses sp / pp / dp on one mesh.

    python pretrain_gpt.py                       # embedded default: tiny GPT on stdlib docs, CPU
    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --sequence-parallel-size 2 --model llama-tiny --data-path my_text_document ...

Flags follow Megatron-LM (see `--help` and README). This file is the command-line edge: it ties the
core (megatron_sp), the models (megatron_sp.models) and the data pipeline (megatron_sp.data)
together. The command line becomes one frozen megatron_sp.config.JobConfig (`load_job`); everything
after that takes the config, never the argparse namespace.
"""
from __future__ import annotations

import dataclasses
import math
import os

import torch

from megatron_sp import pipeline
from megatron_sp.checkpointing import CheckpointError, CheckpointManager, finalize_async_save
from megatron_sp.checkpointing.lock import release_save_locks
from megatron_sp.cli import build as cli
from megatron_sp.cli import progress, startup_checks
from megatron_sp.cli.arguments import parse_args
from megatron_sp.config import JobConfig
from megatron_sp.errors import ConfigError, DataError, NonFiniteLossError, Terminated, reraise_as
from megatron_sp.memory import MemoryOptions
from megatron_sp.memory.cpu_allocator import keep_freed_memory
from megatron_sp.mesh import ParallelMesh, barrier, init_distributed, shutdown
from megatron_sp.reporting import run_main
from megatron_sp.models import GPTConfig, GPTModel, preset
from megatron_sp.models.init import init_parameters
from megatron_sp.tensor_parallel import RNGTracker
from megatron_sp.training import MetricsWriter, Trainer, print_rank0, rampup
from megatron_sp.training.flops import flops_for_config
from megatron_sp.training.loop import fit
from megatron_sp.training.optimizer import LRScheduler, build_optimizer

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "megatron_sp")


@release_save_locks   # the --save lock is released however main() ends (checkpointing/lock.py)
def main(argv=None):
    job, embedded = load_job(argv)
    if embedded and cli.embedded_run_done(job):
        return
    if embedded and int(os.environ.get("RANK", "0")) == 0:    # before the corpus and the model
        print(progress.embedded_estimate(job.training.train_iters,
                                         os.path.exists(job.data.data_path[-1] + ".bin")),
              flush=True)
    mesh, device = start(job)
    tokenizer = build_tokenizer(job, mesh)
    with reraise_as(ConfigError, ValueError, prefix="the model flags (--model and the flags that "
                                                    "override it) do not fit: "):
        config = model_config(job, job.model.checkpoint_vocab_size or tokenizer.vocab_size)
        config.check_parallel(mesh.tp_size, mesh.sp_size, mesh.pp_size,
                              sequence_parallel=job.parallel.sequence_parallel)
    startup_checks.check_model_fits(job, config, tokenizer, mesh)
    with progress.phase(mesh, "model built"):
        chunks = build_model(config, mesh, job, device)
        sharding = build_sharding(chunks, mesh, job, device)
        pool = build_host_pool(chunks, config, mesh, job, device)
        if pool is not None:
            print_rank0(mesh, f"offloaded activations: exact pinned host pool of "
                              f"{pool.capacity / 2**30:.2f} GiB per rank")
    say_startup(job, mesh, config, chunks)
    trainer = build_trainer(job, mesh, config, chunks, sharding)
    checkpoints = CheckpointManager(job, trainer, config)   # --load, --save, exit conditions
    checkpoints.start()       # the --save lock and the start-up checks of what the run writes
    load_checkpoint(job, checkpoints)
    with reraise_as(DataError, ValueError, TimeoutError), \
            progress.phase(mesh, "dataset indices ready") as note:
        train_ds, valid_ds = build_datasets(job, tokenizer, mesh, trainer.state,
                                            checkpoints.end_iteration)
        note["text"] = f" (train {len(train_ds) if train_ds is not None else 0} samples" + (
            f", validation {len(valid_ds)})" if valid_ds is not None else ")")
    train_iter, valid_iter = loaders(job, train_ds, valid_ds, trainer.state, mesh,
                                     tokenizer.vocab_size)
    metrics = MetricsWriter(mesh, job.logging.metrics_jsonl, job.logging.tensorboard_dir,
                            resume_iteration=trainer.state.iteration,
                            wandb=wandb_options(job) if mesh.rank == 0 else None)
    try:
        fit(job, trainer, train_iter, valid_iter, metrics, checkpoints)
    except NonFiniteLossError:   # publish a save begun before the divergence; none after it
        finalize_async_save()
        metrics.close()
        raise
    except KeyboardInterrupt as err:   # Ctrl-C, SIGTERM: what survived, how to go on (errors.py)
        metrics.close()
        said = progress.interrupted_message(job, trainer.state.iteration, argv)
        if isinstance(err, Terminated):
            raise Terminated(said, where=err.where) from None
        raise KeyboardInterrupt(said) from None
    checkpoints.finish()
    metrics.close()
    if embedded:
        say_embedded_done(job, mesh, tokenizer)
    shutdown()


# The command line -> one frozen JobConfig ----------------------------------------------------

def load_job(argv=None) -> tuple[JobConfig, bool]:
    """(the run's JobConfig, whether it is the embedded default): parse (Megatron-LM's flags
    mapped), the embedded default, its corpus's files, --use-checkpoint-args, then frozen."""
    args = parse_args(argv)
    startup_checks.check_preset(args.model)        # before any other complaint: a typo'd preset
    embedded = cli.apply_embedded_default(args, argv)
    given_data = bool(args.data_path) and not args.mock_data
    if not args.data_path and not args.mock_data:      # the embedded default corpus (built later)
        from megatron_sp import data as msdata
        cache = args.cache_dir or DEFAULT_CACHE
        prefix, model_path = msdata.default_corpus_files(cache)
        args.data_path = [prefix]
        args.tokenizer_type, args.tokenizer_model = "GPTSentencePieceTokenizer", model_path
        args.data_cache_path = args.data_cache_path or os.path.join(cache, "index-cache")
    if args.tokenizer_type is None and not args.mock_data:
        raise ConfigError("--data-path needs --tokenizer-type (and --tokenizer-model).")
    if args.seq_length is None:
        raise ConfigError("--seq-length is required.")
    if given_data:     # files named before the model is built (startup_checks)
        startup_checks.check_data_files(args.data_path)
        startup_checks.check_tokenizer_files(args.tokenizer_type, args.tokenizer_model,
                                             args.vocab_file, args.merge_file)
    checkpoint_vocab = apply_checkpoint_args(args, argv)
    job = cli.job_config(args)
    check_model_named(job)
    startup_checks.check_world_size(job.parallel, argv)
    if checkpoint_vocab is not None:     # a resolved value, not a flag: kept out of command_line
        job = dataclasses.replace(job, model=dataclasses.replace(
            job.model, checkpoint_vocab_size=checkpoint_vocab))
    return job, embedded


def check_model_named(job: JobConfig) -> None:
    """Without --model (a preset) the model's shape comes from its three Megatron flags."""
    m = job.model
    missing = [flag for flag, value in (("--num-layers", m.num_layers),
                                        ("--hidden-size", m.hidden_size),
                                        ("--num-attention-heads", m.num_attention_heads))
               if value is None]
    if not m.model and missing:
        raise ConfigError(
            f"the model has no {', '.join(missing)}: without --model (a preset such as "
            f"llama-tiny or llama-8b) --num-layers, --hidden-size and --num-attention-heads "
            f"are all needed; give them, or name a preset with --model.")


def apply_checkpoint_args(args, argv=None) -> int | None:
    """--use-checkpoint-args (Megatron's flag): the model flags come from the --load checkpoint's
    stored config, so a converted or earlier checkpoint needs only data and training flags.

    Returns the checkpoint's vocabulary size (None without the flag). An explicit model flag that
    disagrees with the checkpoint is named in a warning and replaced by the checkpoint's value.
    """
    if not args.use_checkpoint_args:
        return None
    from megatron_sp.checkpointing import read_meta, resolve_checkpoint
    from megatron_sp.cli.arguments import build_parser
    from megatron_sp.cli.model_flags import config_to_flags
    if not args.load:
        raise ConfigError("--use-checkpoint-args reads the model from a checkpoint: pass it "
                          "with --load DIR.")
    from megatron_sp.checkpointing.megatron_lm import megatron_lm_folder
    from megatron_sp.checkpointing.megatron_lm.read import read_fields
    try:
        megatron_folder = megatron_lm_folder(args.load, args.ckpt_step)
        if megatron_folder is not None:           # a Megatron-LM save: its stored arguments
            saved = read_fields(megatron_folder)
        else:
            folder = resolve_checkpoint(args.load)
            saved = read_meta(folder).get("config") if folder else None
    except CheckpointError as err:
        raise ConfigError(str(err)) from None
    if not saved:
        raise ConfigError(f"--use-checkpoint-args found no checkpoint with a stored model "
                          f"config under --load {args.load}; give the model flags instead.")
    config = GPTConfig.from_dict(saved)
    parser = build_parser()
    stored = parser.parse_args(config_to_flags(config))
    from megatron_sp.cli.arguments import MOE_GROUP
    model_actions = [a for g in parser._action_groups if g.title in ("model", MOE_GROUP)
                     for a in g._group_actions]
    explicit = cli.explicit_flags(argv)
    for action in model_actions:
        if action.dest in ("model", "vocab_size", "seq_length"):   # not part of the stored model
            continue
        value = getattr(stored, action.dest)
        if action.dest in explicit and getattr(args, action.dest) != value:
            cli.print_warning(f"warning: {action.option_strings[0]} {getattr(args, action.dest)} "
                              f"is replaced by the checkpoint's {value} (--use-checkpoint-args).")
        setattr(args, action.dest, value)
    args.model = None
    return config.vocab_size


def model_config(job: JobConfig, vocab_size: int) -> GPTConfig:
    """Preset (--model) overridden by explicit Megatron flags."""
    from megatron_sp.cli.model_flags import family_fields, model_vocab_size
    m = job.model
    fields = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.ffn_hidden_size,
        kv_channels=m.kv_channels, max_position_embeddings=m.max_position_embeddings,
        position_embedding_type=m.position_embedding_type, rotary_base=m.rotary_base,
        normalization=m.normalization, norm_epsilon=m.norm_epsilon,
        attention_dropout=m.attention_dropout, hidden_dropout=m.hidden_dropout,
        init_method_std=m.init_method_std, num_query_groups=m.num_query_groups,
        activation="swiglu" if m.swiglu else "gelu_tanh" if m.openai_gelu else None,
        add_bias_linear=False if m.disable_bias_linear else None,
        add_qkv_bias=True if m.add_qkv_bias else None,
        tie_embeddings=False if m.untie_embeddings_and_output_weights else None,
        apply_layernorm_1p=True if m.apply_layernorm_1p else None,
        rotary_percent=m.rotary_percent if m.rotary_percent != 1.0 else None)
    fields.update(family_fields(m))               # --qk-layernorm, RoPE scaling, --yarn-*
    fields.update(cli.moe_fields(m))              # --num-experts, --moe-*
    startup_checks.check_sliding_window(job.checkpoint.load, job.training.seq_length)
    fields = {k: v for k, v in fields.items() if v is not None}
    fields["vocab_size"] = model_vocab_size(job.data, vocab_size)
    fields["make_vocab_size_divisible_by"] = m.make_vocab_size_divisible_by
    if "moe_layer_freq" in fields:    # a 0/1 list per layer: one sentence when the count differs
        from megatron_sp.config import check_moe_layer_freq
        from megatron_sp.models.config import PRESETS
        layers = fields.get("num_layers") or PRESETS.get(m.model, {}).get("num_layers")
        if layers:
            check_moe_layer_freq(fields["moe_layer_freq"], layers)
    if m.model:
        config = preset(m.model, **fields)
    else:
        fields.setdefault("max_position_embeddings", job.training.seq_length)
        fields.setdefault("attention_dropout", 0.1)   # Megatron-LM's defaults without a preset
        fields.setdefault("hidden_dropout", 0.1)
        config = GPTConfig(**fields)
    cli.check_moe_model(m, config)
    return config


# Processes, model, optimizer, trainer -----------------------------------------------------------

def start(job: JobConfig):
    """(mesh, device): the process group (torchrun's or SLURM's environment), this node's cores
    shared among its processes, the mesh of the parallel layout."""
    p = job.parallel
    env = init_distributed(p.distributed_backend, p.distributed_timeout_minutes)
    # Share this node's cores among its processes (LOCAL_WORLD_SIZE from torchrun, else SLURM's).
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", "1")
                               .split("(")[0] or 1)) if env else 1
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, local)))
    mesh = ParallelMesh.from_sizes(tp=p.tensor_model_parallel_size, sp=p.sequence_parallel_size,
                                   pp=p.pipeline_model_parallel_size, cp=p.ring_size)
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available()
                          else "cpu")
    if device.type == "cpu":
        keep_freed_memory()      # no page faults for the tensors every step re-allocates
    torch.manual_seed(job.training.seed)
    return mesh, device


def build_model(config, mesh, job: JobConfig, device):
    """This stage's model chunks: contiguous global layer ids per stage (one chunk per virtual stage
    with --num-layers-per-virtual-pipeline-stage); embedding on the first, loss on the last."""
    from megatron_sp.training import fp8   # --transformer-impl, --fp8-* (Transformer Engine, torchao)
    seed, p = job.training.seed, job.parallel
    tracker = RNGTracker(seed, tp_rank=mesh.tp_rank, pp_rank=mesh.pp_rank,
                         sp_rank=mesh.sequence_chunk)   # one dropout stream per sequence chunk
    specs = pipeline.chunk_specs(config.num_layers, mesh,   # PipelineLayoutError: a UserError
                                 layers_per_virtual_stage=p.num_layers_per_virtual_pipeline_stage,
                                 first=p.decoder_first_pipeline_num_layers,
                                 last=p.decoder_last_pipeline_num_layers)
    chunks = []
    for spec in specs:
        with fp8.model_init_context(job.precision):
            model = GPTModel(config, mesh, attention_backend=fp8.attention_backend(job.model),
                             sequence_parallel=p.sequence_parallel, rng_tracker=tracker,
                             memory=MemoryOptions.from_config(job.memory),
                             expert_parallel_size=p.expert_model_parallel_size,
                             expert_tensor_parallel_size=p.expert_tensor_parallel_size,
                             context_parallel_layout=p.context_parallel_layout, **spec)
        init_parameters(model, seed=seed)
        chunks.append(model.to(device))
    fp8.enable_from_config(chunks, job.precision, mesh, device)   # --fp8-format through torchao
    from megatron_sp.compile import CompileLayoutError, compile_from_config
    with reraise_as(ConfigError, CompileLayoutError):   # --torch-compile: per layer, before FSDP2
        line = compile_from_config(chunks, mesh, job)
    if line:
        print_rank0(mesh, line)
    return chunks


def offload_pool_bytes(config, mesh, job: JobConfig) -> float:
    """The planner's count of this rank's offloaded activation bytes in an exact host pool
    (step_peak_bytes(host_pool=True): every checkpointed layer input, aligned, + RoPE's tables)."""
    from megatron_sp.memory.planner import step_peak_bytes
    t, prec = job.training, job.precision
    e = 2 if (prec.bf16 or getattr(prec, "fp16", False)) else 4
    r = 2 if (job.parallel.use_torch_fsdp2 and e == 2) else 4   # FSDP2 bf16: a bf16 residual
    return step_peak_bytes(config, t.seq_length, t.micro_batch_size, tp=mesh.tp_size,
                           sp=mesh.sp_size, pp=1, cp=mesh.cp_size,
                           sequence_parallel=job.parallel.sequence_parallel,
                           memory=MemoryOptions.from_config(job.memory), dtype_bytes=e,
                           residual_bytes=r, device="cuda", host_pool=True)["host"]


def build_host_pool(chunks, config, mesh, job: JobConfig, device):
    """--offload-activations on CUDA: one exact pinned host pool per rank for the offloaded
    activations (megatron_sp/memory/host_pool.py), sized by --offload-pool-gb or else by the
    planner's count (offload_pool_bytes; with full recompute and no pipeline only: 1F1B frees
    micro-batches oldest first, which a stack does not reclaim, and without full recompute the
    planner's count is not exact); None keeps torch's pinned buffers."""
    m = job.memory
    gb = getattr(m, "offload_pool_gb", None)
    if not m.offload_activations or device.type != "cuda" or gb == 0:
        return None
    if gb is None:
        if m.recompute_granularity != "full" or mesh.pp_size > 1:
            return None
        nbytes = offload_pool_bytes(config, mesh, job)
        remedy = ("lower --seq-length or --micro-batch-size, use more --sequence-parallel-size "
                  "ranks, or give --offload-pool-gb a larger size (0: torch's pinned buffers)")
    else:
        nbytes = gb * 2**30
        remedy = "raise --offload-pool-gb (0: torch's pinned buffers)"
    from megatron_sp.memory.host_pool import HostPool
    pool = HostPool(nbytes, pin=True, what="offloaded activations", remedy=remedy)
    for chunk in chunks:
        chunk.host_pool = pool
    return pool


def build_sharding(chunks, mesh, job: JobConfig, device):
    """The Trainer's state sharding (docs/design.md §11): --use-distributed-optimizer (the optimizer
    that shards itself), --use-torch-fsdp2 (shards the chunks); None: replicated state."""
    p = job.parallel
    if p.use_distributed_optimizer:
        from megatron_sp.sharding.distributed_optimizer import DistributedOptimizer
        return DistributedOptimizer.from_config(chunks, mesh, job)
    if not p.use_torch_fsdp2:
        return None
    from megatron_sp.sharding.fsdp import FSDPLayoutError, apply_fsdp2
    with reraise_as(ConfigError, FSDPLayoutError):
        return apply_fsdp2(chunks, mesh, bf16=job.precision.bf16, cpu_offload=p.optimizer_cpu_offload,
                           device=device)


def build_trainer(job: JobConfig, mesh, config, chunks, sharding) -> Trainer:
    """Optimizer (the distributed optimizer is the sharding itself), learning-rate schedule,
    pipeline schedule and the Trainer; the micro-batch count checked for every ramp-up step."""
    t = job.training
    if job.parallel.use_distributed_optimizer:   # also the optimizer: Adam state sharded over dp x sp
        optimizer = sharding
    else:
        optimizer = build_optimizer(chunks, t.lr, t.weight_decay, (t.adam_beta1, t.adam_beta2),
                                    t.adam_eps, optimizer=t.optimizer, sgd_momentum=t.sgd_momentum,
                                    decoupled_lr=t.decoupled_lr, decoupled_min_lr=t.decoupled_min_lr)
    warmup, decay, wsd = rampup.schedule_steps(t)    # iterations, or Megatron's samples
    scheduler = LRScheduler(optimizer, t.lr, t.min_lr, warmup, decay, t.lr_decay_style, wsd)
    trainer = Trainer(job, mesh, chunks, optimizer, scheduler, sharding=sharding,
                      schedule=build_schedule(chunks, mesh, t.global_batch_size, t.micro_batch_size),
                      flops_per_step=flops_for_config(config, t.global_batch_size, t.seq_length,
                                                      mesh.tp_size))
    check_rampup(job, mesh, len(chunks))
    return trainer


def build_schedule(chunks, mesh, global_batch_size: int, micro_batch_size: int):
    """No pipelining, 1F1B or interleaved 1F1B; refuses a micro-batch count it cannot run."""
    num_micro_batches = global_batch_size // (micro_batch_size * mesh.dp_size)
    if mesh.pp_size > 1:   # PipelineLayoutError: a UserError
        pipeline.check_num_microbatches(num_micro_batches, mesh.pp_size, len(chunks))
    return pipeline.get_forward_backward_func(mesh.pp_size, len(chunks))


def check_rampup(job: JobConfig, mesh, num_chunks: int) -> None:
    """--rampup-batch-size: every ramp step's batch is whole micro-batches the schedule can run."""
    ramp, mbs = job.training.rampup(), job.training.micro_batch_size
    if ramp is None:
        return
    ramp.check_divisible(mbs * mesh.dp_size)
    for batch in range(ramp.start, ramp.global_batch_size, ramp.increment):   # every ramp step
        try:
            pipeline.check_num_microbatches(batch // (mbs * mesh.dp_size), mesh.pp_size, num_chunks)
        except pipeline.PipelineLayoutError as err:
            raise ConfigError(f"--rampup-batch-size: {err}") from None


def load_checkpoint(job: JobConfig, checkpoints: CheckpointManager) -> None:
    """--load and --exit-on-missing-checkpoint. A CheckpointError is raised on every rank (they
    agreed on it in load_checkpoint) and said once (reporting.report)."""
    loaded = checkpoints.load()
    if job.checkpoint.exit_on_missing_checkpoint and job.checkpoint.load and loaded is None:
        raise ConfigError(f"--exit-on-missing-checkpoint: no checkpoint under --load "
                          f"{job.checkpoint.load}; check the path or drop the flag to start from "
                          f"scratch.")


# Data -----------------------------------------------------------------------------------------

def build_tokenizer(job: JobConfig, mesh):
    """The tokenizer of --tokenizer-type (NullTokenizer with --mock-data); the embedded default's
    corpus is built first when it is the data (by rank 0, once)."""
    from megatron_sp import data as msdata
    d = job.data
    if d.mock_data:
        return msdata.build_tokenizer("NullTokenizer", vocab_size=d.vocab_size or 1024)
    cache = d.cache_dir or DEFAULT_CACHE
    if d.data_path == (msdata.default_corpus_files(cache)[0],):
        if mesh.rank == 0 and not msdata.default_corpus_ready(cache):   # tokenizer, .bin/.idx
            print_rank0(mesh, f"> building the embedded default corpus under {cache} (once) ...")
            with progress.phase(mesh, "embedded default corpus built"):
                msdata.build_default_corpus(cache)
        barrier(mesh)
    with reraise_as(DataError, ValueError):
        return msdata.build_tokenizer(d.tokenizer_type, d.tokenizer_model, vocab_size=d.vocab_size,
                                      vocab_file=d.vocab_file, merge_file=d.merge_file,
                                      trust_remote_code=d.trust_remote_code)


def build_datasets(job: JobConfig, tokenizer, mesh, state, train_iters: int):
    """(train, valid) datasets; sample counts as Megatron-LM computes them, raised when a resumed
    run (with another global batch size) needs more than that."""
    from megatron_sp import data as msdata
    from megatron_sp.data.builder import os_errors_named, parse_data_path
    t, d = job.training, job.data
    gbs = t.global_batch_size
    needed = state.consumed_train_samples + (train_iters - state.iteration) * gbs
    train_samples = max(train_iters * gbs, needed)
    eval_runs = train_iters // t.eval_interval + 1
    runs_left = train_iters // t.eval_interval - state.iteration // t.eval_interval + 1
    eval_samples = max(eval_runs * t.eval_iters * gbs,
                       state.consumed_valid_samples + runs_left * t.eval_iters * gbs)
    if d.mock_data:
        from megatron_sp.data.mock_dataset import MockDataset
        return (MockDataset(tokenizer.vocab_size, t.seq_length, t.seed, train_samples),
                MockDataset(tokenizer.vocab_size, t.seq_length, t.seed + 1, eval_samples))
    data_path = list(d.data_path)
    # Megatron-core's default index cache: next to the (first) data file.
    first_prefix = parse_data_path(data_path)[0][0]
    cache = d.data_cache_path or os.path.join(os.path.dirname(os.path.abspath(first_prefix)),
                                              "cache", "GPTDataset_indices")
    with os_errors_named(cache):    # unreadable data files or cache: one sentence naming them
        train, valid, _ = msdata.build_gpt_datasets(
            data_path, d.split, t.seq_length, t.seed,
            (train_samples, eval_samples if t.eval_iters > 0 else 0, 0),
            tokenizer.eod, tokenizer.pad, cache,
            reset_position_ids=d.reset_position_ids,
            reset_attention_mask=d.reset_attention_mask, eod_mask_loss=d.eod_mask_loss,
            return_document_ids=d.reset_attention_mask,
            rank=mesh.rank, world_size=mesh.world_size, barrier=lambda: barrier(mesh))
    return train, valid


def loaders(job: JobConfig, train_ds, valid_ds, state, mesh, vocab_size: int):
    """(train, valid) iterators of this dp rank's micro-batches from the resumed positions; token ids
    outside the vocabulary stop the run with one line."""
    from megatron_sp.data import PretrainingDataLoader
    d, t = job.data, job.training

    def loader(dataset, consumed):
        return iter(PretrainingDataLoader(dataset, consumed, t.micro_batch_size, mesh.dp_rank,
                                          mesh.dp_size, vocab_size=vocab_size,
                                          num_workers=d.num_workers,
                                          cyclic=d.dataloader_type == "cyclic", seed=t.seed))
    valid = loader(valid_ds, state.consumed_valid_samples) if valid_ds is not None else None
    if train_ds is None:        # --train-iters 0: no training split is read
        return iter(()), valid
    return loader(train_ds, state.consumed_train_samples), valid


# Start-up and closing lines ---------------------------------------------------------------------

def ring_layout_line(job: JobConfig) -> str:
    """The start-up line naming the ring's token layout (docs/design.md §14)."""
    kind = job.parallel.context_parallel_layout
    if not job.data.reset_attention_mask:
        return "> ring layout: zigzag (chunks r and 2cp-1-r of the row; no packed documents)"
    if kind == "zigzag":
        return ("> ring layout: zigzag (--context-parallel-layout zigzag: chunks r and 2cp-1-r "
                "of the row, whatever the documents)")
    return ("> ring layout: balanced (packed documents: long ones in zigzag per document, short "
            "ones whole on the least-loaded rank; cp_work_balance in the log)")


def say_startup(job: JobConfig, mesh, config, chunks) -> None:
    """The start-up lines, each said once (a line that would repeat another is left out)."""
    from megatron_sp.attention import describe_attention   # the kernel and the document path
    lines = list(job.notes)      # mapped and no-op Megatron flags (docs/design.md §10)
    context = job.parallel.describe_context()   # how Ulysses and the ring split the context (§14)
    if context:
        lines.append(context)
    if mesh.cp_size > 1:        # which tokens each ring rank holds (context_parallel/balance.py)
        lines.append(ring_layout_line(job))
    backend = chunks[0].attention_backend_name
    described = describe_attention(
        backend, requested=job.model.attention_backend, device=next(chunks[0].parameters()).device,
        dtype=job.precision.autocast_dtype or torch.float32, seq_len=job.training.seq_length,
        packed=job.data.reset_attention_mask, dropout=config.attention_dropout)
    lines += [f"> {mesh}", f"> model: {progress.model_summary(config, mesh.tp_size)}",
              f"> attention backend: {backend}"]
    if described != backend:     # a backend with nothing more to say is named once
        lines.append(f"> attention: {described}")
    ep = job.parallel.expert_model_parallel_size
    if ep > 1:
        etp = chunks[0].expert_tensor_parallel_size
        groups = mesh.expert_groups(ep, etp)   # cached at model construction: no collective here
        split = f", each split over etp={etp}" if etp > 1 else ""
        lines.append(f"> expert parallelism: ep={ep} (each rank holds {config.num_experts // ep} "
                     f"of {config.num_experts} experts per MoE layer{split}, tokens dispatched by "
                     f"all-to-all), expert gradients reduced over edp={groups.edp}")
    n = job.memory.ulysses_head_chunks
    if n > 1:
        per = config.num_attention_heads // (mesh.tp_size * mesh.sp_size * n)
        lines.append(f"> Ulysses head chunks: {n} ({per} query heads per rank and chunk in turn, "
                     f"each chunk's all-to-alls and attention recomputed in backward)")
    print_rank0(mesh, "\n".join(dict.fromkeys(lines)))


def say_embedded_done(job: JobConfig, mesh, tokenizer) -> None:
    save, metrics = job.checkpoint.save, job.logging.metrics_jsonl
    print_rank0(mesh, f"> embedded default finished: the lm loss above fell from about "
                      f"ln({tokenizer.vocab_size}) = {math.log(tokenizer.vocab_size):.2f}.\n"
                      f"> checkpoint: {os.path.abspath(save) if save else 'none'}\n"
                      f"> metrics:    {os.path.abspath(metrics) if metrics else 'stdout only'}")


def wandb_options(job: JobConfig) -> dict | None:
    """--wandb-project / --wandb-exp-name / --wandb-save-dir (Megatron's), or None."""
    log = job.logging
    if not log.wandb_project:
        return None
    return {"project": log.wandb_project, "name": log.wandb_exp_name, "dir": log.wandb_save_dir,
            "config": {k: v for k, v in job.flags().items()
                       if isinstance(v, (int, float, str, bool))}}


if __name__ == "__main__":
    run_main(main)   # user errors in one sentence, said once; exit 0 when main returned (reporting.py)
