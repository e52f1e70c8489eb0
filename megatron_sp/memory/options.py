"""MemoryOptions: the long-context memory techniques, one dataclass passed to GPTModel(memory=...).

    recompute_granularity  None | "full" | "selective"   (Megatron's --recompute-granularity)
    recompute_method       "uniform" | "block"            (--recompute-method, full only)
    recompute_num_layers   int                            (--recompute-num-layers, full only)
    mlp_tiles              1 (off) | N | "auto"           (--mlp-tiles): MLP over N sequence tiles
    loss_chunks            1 (off) | N | "auto"           (--loss-chunks): output layer + loss in chunks
                           ("auto": see resolve_count; it is 1, the plain path, below 2 x
                           MIN_TILE_TOKENS tokens)
    ulysses_head_chunks    1 (off) | N                    (--ulysses-head-chunks): the attention block
                           (QKV, Ulysses, out-proj) over N head chunks, each recomputed in backward
    offload_activations    bool                           (--offload-activations): saved tensors of
                           the transformer layers (with full recompute: only the checkpointed layer
                           inputs) live in host memory until backward

Megatron's meanings: full + uniform checkpoints groups of `recompute_num_layers` consecutive layers
(only each group's input is kept); full + block checkpoints the first `recompute_num_layers` layers of
each pipeline stage one by one and keeps the rest; selective recomputes the attention core only.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class MemoryOptions:
    recompute_granularity: str | None = None
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    mlp_tiles: int | str = 1
    loss_chunks: int | str = 1
    ulysses_head_chunks: int = 1
    offload_activations: bool = False

    def __post_init__(self):
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity must be None, 'full' or 'selective', got "
                             f"{self.recompute_granularity!r}.")
        if self.recompute_method not in ("uniform", "block"):
            raise ValueError(f"recompute_method must be 'uniform' or 'block', got "
                             f"{self.recompute_method!r}.")
        if not isinstance(self.recompute_num_layers, int) or self.recompute_num_layers < 0 or (
                self.recompute_method == "uniform" and self.recompute_num_layers < 1):
            raise ValueError(f"recompute_num_layers must be >= 1 (uniform) or >= 0 (block), got "
                             f"{self.recompute_num_layers!r}.")
        for name in ("mlp_tiles", "loss_chunks"):
            value = getattr(self, name)
            if isinstance(value, str) and value.isdigit():
                value = int(value)
                setattr(self, name, value)
            if value != "auto" and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a positive integer or 'auto', got {value!r}.")
        chunks = self.ulysses_head_chunks
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"ulysses_head_chunks must be an integer >= 1, got {chunks!r}.")

    @property
    def full_recompute(self) -> bool:
        return self.recompute_granularity == "full"

    @property
    def selective_recompute(self) -> bool:
        return self.recompute_granularity == "selective"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_config(cls, memory) -> "MemoryOptions":
        """From a megatron_sp.config.MemoryConfig (Megatron's flag names plus ours)."""
        return cls(recompute_granularity=memory.recompute_granularity,
                   recompute_method=memory.recompute_method or "uniform",
                   recompute_num_layers=(memory.recompute_num_layers
                                         if memory.recompute_num_layers is not None else 1),
                   mlp_tiles=memory.mlp_tiles or 1, loss_chunks=memory.loss_chunks or 1,
                   ulysses_head_chunks=getattr(memory, "ulysses_head_chunks", 1),
                   offload_activations=bool(memory.offload_activations))


MIN_TILE_TOKENS = 2048     # `auto` never makes a tile or chunk of fewer tokens than this


def resolve_count(value: int | str, length: int, width: int, hidden: int,
                  tokens: int | None = None) -> int:
    """Tiles/chunks for a [.., length, width] intermediate of `tokens` tokens (default length):
    `auto` makes one tile's intermediate no wider than the [length, hidden] residual stream
    (ceil(width / hidden)), but keeps at least MIN_TILE_TOKENS tokens in a tile: every tile's
    weight-gradient GEMM writes the whole [width, hidden] gradient and every recompute casts the
    weight again, so small tiles are bandwidth-bound (llama-1b at 8K: 63 loss chunks of 130 tokens
    added 55% to an H200 step; on CPU 63 chunks of 65 tokens added 70%). Never above length."""
    if value == "auto":
        tokens = length if tokens is None else tokens
        n = min(math.ceil(width / hidden), max(1, tokens // MIN_TILE_TOKENS))
    else:
        n = int(value)
    return max(1, min(n, length))


# Named settings of the techniques, for benchmarks and examples (MemoryOptions keyword arguments).
TECHNIQUES: dict[str, dict] = {
    "plain": {},
    "full recompute": dict(recompute_granularity="full"),
    "selective": dict(recompute_granularity="selective"),
    "tiled mlp": dict(mlp_tiles="auto"),
    "chunked loss": dict(loss_chunks="auto"),
    "offload+full": dict(recompute_granularity="full", offload_activations=True),
    "all": dict(recompute_granularity="full", mlp_tiles="auto", loss_chunks="auto"),
    "all+offload": dict(recompute_granularity="full", mlp_tiles="auto", loss_chunks="auto",
                        offload_activations=True),
}
