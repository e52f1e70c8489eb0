"""The typed configuration of a run: frozen dataclasses, validated once, passed to the library.

Configuration travels as in torchtitan and Megatron core: the command line is parsed at the edge
(`megatron_sp.cli`: argparse with Megatron-LM's flag names, the mapping of Megatron-LM's other flags,
the embedded default run, --use-checkpoint-args), turned into one `JobConfig`, and never changed
afterwards. Everything past the edge (trainer, checkpointing, sharding, loss scaler, memory options,
profiler, ramp-up, FP8, model families) takes these sections instead of the argparse namespace.

Each field keeps its Megatron-LM flag's name (docs/design.md §10) and its docstring names that flag.
What the flag means is written once, in its help in megatron_sp/cli/arguments.py (shown by
`python pretrain_gpt.py --help-all`); a field's docstring adds only what the section does with the
value. A section checks its own rules in `__post_init__` with one sentence each (a ConfigError:
what, where, what to do); values that Megatron-LM derives from other flags (--global-batch-size from
--micro-batch-size, --train-iters from --train-samples, --lr-decay-iters from --train-iters, ...)
are filled in there too, so a section is complete once it exists. Rules that need the mesh or the
model (heads over tp x sp, layers over stages, the batch over dp) are checked where those exist
(megatron_sp.mesh.ParallelDims, the model config, the Trainer).

    job = JobConfig.from_flags({"micro_batch_size": 2, "global_batch_size": 8, "seq_length": 1024,
                                "tensor_model_parallel_size": 2, "bf16": True})
    job.training.global_batch_size, job.parallel.tensor_model_parallel_size, job.precision.bf16

The package, one module per part of a run (each section checks its own rules):

    section.py    what the sections share: field_flag, resolve_fields (while building)
    parallel.py   ParallelConfig: tp, pp, Ulysses sp, context parallelism, experts, sharded state
    model.py      ModelFlags and --moe-layer-freq (parse_moe_layer_freq, check_moe_layer_freq)
    training.py   DataConfig, TrainingConfig (batch, schedule, optimizer, evaluation)
    precision.py  PrecisionConfig (bf16, fp16 loss scaling, FP8; FP8_RECIPES, check_fp8_recipe)
    memory.py     MemoryConfig (recompute, tiles, chunks, offload, memory report)
    run.py        CheckpointConfig, LoggingConfig (what a run writes, when it exits)
    job.py        JobConfig and SECTIONS, the whole run

Every public name is importable from `megatron_sp.config` itself, as before the split.
"""
from megatron_sp.config.job import SECTIONS, JobConfig
from megatron_sp.config.memory import MemoryConfig
from megatron_sp.config.model import MOE_LAYER_FREQ_LIMIT, ModelFlags, check_moe_layer_freq, \
    parse_moe_layer_freq
from megatron_sp.config.parallel import ParallelConfig
from megatron_sp.config.precision import FP8_RECIPES, PrecisionConfig, check_fp8_recipe
from megatron_sp.config.run import CheckpointConfig, LoggingConfig
from megatron_sp.config.section import field_flag, resolve_fields
from megatron_sp.config.training import NONFINITE_POLICIES, DataConfig, TrainingConfig
from megatron_sp.errors import ConfigError


__all__ = ["SECTIONS", "JobConfig", "ParallelConfig", "ModelFlags", "DataConfig", "TrainingConfig",
           "PrecisionConfig", "CheckpointConfig", "MemoryConfig", "LoggingConfig",
           "NONFINITE_POLICIES", "MOE_LAYER_FREQ_LIMIT", "parse_moe_layer_freq",
           "check_moe_layer_freq", "FP8_RECIPES", "check_fp8_recipe", "ConfigError"]
