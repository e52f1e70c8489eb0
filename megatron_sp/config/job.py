"""JobConfig: one run, every section, the start-up notes and the command line it was built from;
SECTIONS names each section's field of it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from megatron_sp.config.memory import MemoryConfig
from megatron_sp.config.model import ModelFlags
from megatron_sp.config.parallel import ParallelConfig
from megatron_sp.config.precision import PrecisionConfig
from megatron_sp.config.run import CheckpointConfig, LoggingConfig
from megatron_sp.config.training import DataConfig, TrainingConfig
from megatron_sp.errors import ConfigError

SECTIONS = {"parallel": ParallelConfig, "model": ModelFlags, "data": DataConfig,
            "training": TrainingConfig, "precision": PrecisionConfig,
            "checkpoint": CheckpointConfig, "memory": MemoryConfig, "logging": LoggingConfig}


@dataclass(frozen=True)
class JobConfig:
    """One run: every section, the start-up notes, and the command line it was built from."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel layout and the sharding of model state."""
    model: ModelFlags = field(default_factory=ModelFlags)
    """The model flags (preset and overrides)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data, tokenizer and data loader."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Batch, length of training, optimizer, learning-rate schedule, evaluation."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """bf16 / fp16 / FP8."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Save, load and exit conditions."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Recompute, tiling, chunked loss, offload."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Log line, metrics, profiler."""
    notes: tuple[str, ...] = ()
    """Start-up notes on mapped and no-op Megatron-LM flags, said once by rank 0."""
    command_line: Mapping[str, Any] = field(default_factory=dict)
    """Every parsed flag as resolved at the edge, kept read-only for the record (a checkpoint's
    "args", wandb's config); the library reads the sections, never this."""

    def __post_init__(self):
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "command_line", MappingProxyType(dict(self.command_line)))
        self._check_training_split()

    def _check_training_split(self) -> None:
        """Training asked for (--train-iters > 0) needs documents: a --split whose first weight
        is 0 (e.g. 0,100,0) gives the training split none."""
        data, iters = self.data, self.training.train_iters
        if data.mock_data or not iters or data.split_weights()[0] > 0:
            return
        given = (f"--train-samples {self.training.train_samples}"
                 if self.training.train_samples is not None else f"--train-iters {iters}")
        raise ConfigError(f"--split {data.split} gives the training split a weight of 0 (no "
                          f"documents) but {given} asks for training; give the first weight a "
                          f"positive share (e.g. --split 969,30,1).")

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any], *, notes=(), strict: bool = True) -> "JobConfig":
        """Sort flat flag values ({"train_iters": 10, "bf16": True, ...}) into their sections.

        Each field name belongs to one section. strict: a name of no section is a TypeError (a
        typo in code); the command line passes strict=False, its Megatron-only flags being
        mapped or no-ops, and keeps them all in `command_line`.
        """
        known = {f.name: name for name, section in SECTIONS.items()
                 for f in dataclasses.fields(section)}
        unknown = sorted(set(flags) - set(known))
        if strict and unknown:
            raise TypeError(f"no config section has the field(s) {unknown}.")
        values = {name: {} for name in SECTIONS}
        for key, value in flags.items():
            if key in known:
                values[known[key]][key] = value
        sections = {name: SECTIONS[name](**values[name]) for name in SECTIONS}
        return cls(**sections, notes=notes, command_line=flags)

    def flags(self) -> dict[str, Any]:
        """The flat record of the run, as the command line's namespace held it (the checkpoint's
        "args"): every parsed flag, with the values the sections resolved."""
        record = dict(self.command_line)
        for name in SECTIONS:
            for key, value in dataclasses.asdict(getattr(self, name)).items():
                if key in record or not self.command_line:
                    record[key] = value
        record["megatron_notes"] = list(self.notes)
        return record
