"""The ring's slowest rank in the planner's step time (docs/design.md §9, §14).

A ring of context parallelism waits, at every step, for the rank with the most causal attention
work. With packed documents (--reset-attention-mask) that work depends on the layout that places
the tokens on the ring's ranks (megatron_sp.context_parallel.balance: the whole-row zigzag, or
the document-aware balanced layout) and on the documents' lengths. Its measure is
cp_work_balance: the max over the ring's ranks of the causal (query, key) pairs over their mean.

The planner's compute time counts the attention part of the model FLOPs, the s/H term of
Megatron-LM's formula (A = 12 B s^2 L a d, forward and backward: QK^T and the scores times V), at
that figure, the rest as before:

    compute_s = (F - A) / rate + A x balance / rate
              = compute_s(balanced) + A / rate x (balance - 1)

(then x technique cost x (1 + pipeline bubble), search._step_parts). balance is 1 without a
ring (cp 1: Ulysses splits heads, not the sequence), without documents (the whole-row zigzag
balances one causal row), and with documents whose lengths the workload does not state
(Workload.document_lengths and cp_work_balance both None: assumed balanced, as the balanced layout
is within 2% of it on the mixes of docs/performance.md). Workload.cp_work_balance states the figure
(e.g. a run's logged `cp work balance`), for every ring; Workload.document_lengths gives a
distribution that estimate_balance packs into PLANNED_ROWS rows of the plan's length, laid out by
Workload.context_parallel_layout over the plan's cp, the rows' mean figure taken: each micro-batch
waits for its own slowest rank, so the step's attention time is the sum of the rows' maxima.
"""
from __future__ import annotations

import math
from functools import lru_cache
from itertools import cycle

PLANNED_ROWS = 4   # rows of the plan's length that a document-length distribution is packed into


def attention_flops(cfg, batch: int, seq: int) -> float:
    """The attention part of Megatron-LM's model FLOPs (megatron_sp.training.flops), its s/H
    term: 12 B s^2 L a d (a heads of d = kv_channels; forward and backward)."""
    return 12.0 * batch * seq ** 2 * cfg.num_layers * cfg.num_attention_heads * cfg.kv_channels


def lognormal_lengths(median: float, sigma: float, count: int = 4096, seed: int = 0) -> tuple:
    """`count` document lengths (tokens, >= 1) drawn from a lognormal of that median and sigma
    (of the log), seeded: a corpus' mix for Workload.document_lengths."""
    import numpy as np
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(math.log(median), sigma, count)
    return tuple(max(1, int(round(x))) for x in draws)


def cp_work_balance(work, cp: int) -> float:
    """The slowest ring rank's attention work over the mean (>= 1) that the plan's step time
    assumes for `work` on a ring of cp ranks (module docstring)."""
    if cp == 1 or not work.documents:
        return 1.0
    if work.cp_work_balance is not None:
        return float(work.cp_work_balance)
    if work.document_lengths is None:
        return 1.0
    return _estimated(work.document_lengths, work.seq, cp, work.context_parallel_layout)


@lru_cache(maxsize=256)
def _estimated(lengths: tuple, seq: int, cp: int, layout: str) -> float:
    """estimate_balance's mean over PLANNED_ROWS rows of seq tokens of `lengths`, repeated in
    order as many times as the rows need (a corpus read again, epoch after epoch)."""
    from megatron_sp.context_parallel.balance import estimate_balance
    need, taken = PLANNED_ROWS * seq, []
    for m in cycle(lengths):
        taken.append(m)
        need -= m
        if need <= 0:
            break
    return estimate_balance(taken, seq, cp, layout)["mean"]
