"""MemoryConfig: the long-context memory techniques (recompute, tiled MLP, chunked loss, Ulysses
head chunks, activation offload) and the memory report; megatron_sp.memory carries them out."""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_sp.config.section import _flag, _resolve
from megatron_sp.errors import ConfigError


@dataclass(frozen=True)
class MemoryConfig:
    """Long-context memory techniques: recompute, tiled MLP, chunked loss, activation offload, and
    the memory report."""

    recompute_granularity: str | None = None
    """--recompute-granularity: activation recompute: full layers or the attention core
    (selective)."""
    recompute_method: str | None = None
    """--recompute-method: full recompute: uniform groups or the first N layers (block)."""
    recompute_num_layers: int | None = None
    """--recompute-num-layers: full+uniform: layers per checkpointed group; full+block: layers of
    each stage recomputed (default 1)."""
    mlp_tiles: int | str = "1"
    """--mlp-tiles: run the MLP over N sequence tiles recomputed in backward (or 'auto': ceil(ffn
    width / hidden), none under 2048 tokens), so the [s, ffn] intermediate never exists whole."""
    loss_chunks: int | str = "1"
    """--loss-chunks: output layer + cross entropy over N sequence chunks recomputed in backward
    (or 'auto': ceil(vocab / hidden), none under 2048 tokens), so the [s, vocab] logits never
    exist whole."""
    ulysses_head_chunks: int = 1
    """--ulysses-head-chunks: Ulysses attention over N head chunks in turn, each recomputed in
    backward (UPipe): one chunk's exchange buffers and q, k, v, out live at a time. N must fit
    the heads per sp rank (checked with the model at start-up)."""
    offload_activations: bool = False
    """--offload-activations: keep saved activations of the transformer layers (with full
    recompute: the checkpointed layer inputs) in pinned host memory until backward."""
    offload_pool_gb: float | None = None
    """--offload-pool-gb: GiB of the exact pinned host pool that holds the offloaded activations on
    CUDA (megatron_sp/memory/host_pool.py; default: the planner's count for this rank, with full
    recompute and no pipeline; 0: torch's pinned buffers, each rounded up to a power of two)."""
    report_memory: bool = False
    """--report-memory: print activation bytes saved for backward per rank and layer, peak device
    memory and the model-state bytes per rank (parameters, gradients, optimizer state on device
    and on host), with the log line."""

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
