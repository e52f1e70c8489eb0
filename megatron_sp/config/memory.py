"""MemoryConfig: the long-context memory techniques (recompute, tiled MLP, chunked loss, Ulysses
head chunks, activation offload) and the memory report; megatron_sp.memory carries them out."""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_sp.config.section import field_flag as _flag
from megatron_sp.config.section import resolve_fields as _resolve
from megatron_sp.errors import ConfigError


@dataclass(frozen=True)
class MemoryConfig:
    """Long-context memory techniques: recompute, tiled MLP, chunked loss, activation offload, and
    the memory report."""

    recompute_granularity: str | None = None
    """--recompute-granularity"""
    recompute_method: str | None = None
    """--recompute-method"""
    recompute_num_layers: int | None = None
    """--recompute-num-layers"""
    mlp_tiles: int | str = "1"
    """--mlp-tiles; an int or 'auto' once checked."""
    loss_chunks: int | str = "1"
    """--loss-chunks; an int or 'auto' once checked."""
    ulysses_head_chunks: int = 1
    """--ulysses-head-chunks"""
    offload_activations: bool = False
    """--offload-activations"""
    offload_pool_gb: float | None = None
    """--offload-pool-gb"""
    report_memory: bool = False
    """--report-memory"""

    def __post_init__(self):
        if self.recompute_granularity != "full" and (self.recompute_method is not None
                                                     or self.recompute_num_layers is not None):
            raise ConfigError("--recompute-method and --recompute-num-layers need "
                              "--recompute-granularity full.")
        for name in ("mlp_tiles", "loss_chunks"):
            value = getattr(self, name)
            if value != "auto" and not (str(value).isdigit() and int(value) >= 1):
                raise ConfigError(f"{_flag(name)} must be a positive integer or 'auto', got "
                                  f"{value!r}.")
            _resolve(self, **{name: value if value == "auto" else int(value)})
        chunks = self.ulysses_head_chunks
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ConfigError(f"--ulysses-head-chunks must be an integer >= 1, got {chunks!r}.")
        pool = self.offload_pool_gb
        if pool is not None and not 0 <= pool < math.inf:
            raise ConfigError(f"--offload-pool-gb must be a finite number of GiB >= 0 (0: torch's "
                              f"pinned buffers; leave it out for the planner's count), got "
                              f"{pool:g}.")
