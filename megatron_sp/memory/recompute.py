"""Activation recompute (Megatron's --recompute-granularity full|selective) with torch checkpoint.

Non-reentrant `torch.utils.checkpoint` replays the default CPU/CUDA RNG streams on recompute. Dropout
inside tensor-parallel regions draws from the RNGTracker's forked stream instead, whose state the
tracker advances on every fork: `checkpoint()` below snapshots it before the forward and restores that
snapshot for the recompute (and the advanced state afterwards), so every dropout mask is replayed
exactly.

    full, uniform, n   layers in groups of n consecutive layers, each group one checkpoint
    full, block, n     the first n layers of this stage each one checkpoint, the rest kept
    selective          the local attention core only (after the Ulysses all-to-alls, so the recompute
                       communicates nothing): see RecomputedAttention
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from megatron_sp.memory import accounting
from megatron_sp.memory.offload import offload_saved_tensors


def _tracker_state(tracker):
    return (tracker._cpu_state.clone(),
            None if tracker._cuda_state is None else tracker._cuda_state.clone())


def _set_tracker_state(tracker, state):
    tracker._cpu_state = state[0]
    if state[1] is not None:
        tracker._cuda_state = state[1]


def checkpoint(fn, *args, rng_tracker=None):
    """torch checkpoint (use_reentrant=False) of fn(*args) that also replays the RNGTracker stream.

    Pass tensors positionally: the checkpoint saves them through the saved-tensor hooks (so offload and
    accounting see them).
    """
    if rng_tracker is None or not torch.is_grad_enabled():
        return _torch_checkpoint(fn, *args, use_reentrant=False)
    before = _tracker_state(rng_tracker)
    calls = [0]

    def run(*a):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*a)
        after = _tracker_state(rng_tracker)             # recompute: replay the forward's stream
        _set_tracker_state(rng_tracker, before)
        try:
            return fn(*a)
        finally:
            _set_tracker_state(rng_tracker, after)

    return _torch_checkpoint(run, *args, use_reentrant=False)


def recompute_plan(num_layers: int, options) -> list[tuple[int, int, bool]]:
    """[(start, end, recompute)] segments of this stage's local layers, Megatron's meanings."""
    if not options.full_recompute:
        return [(0, num_layers, False)] if num_layers else []
    n = options.recompute_num_layers
    if options.recompute_method == "uniform":
        return [(i, min(i + n, num_layers), True) for i in range(0, num_layers, n)]
    plan = [(i, i + 1, True) for i in range(min(n, num_layers))]
    if n < num_layers:
        plan.append((n, num_layers, False))
    return plan


def forward_layers(layers, x, rope, document_ids, options, rng_tracker=None, host_pool=None):
    """Run the (name, layer) pairs on x with the recompute/offload of `options` (MemoryOptions);
    host_pool: the HostPool that holds offloaded activations (None: torch's pinned buffers)."""
    layers = list(layers)
    cos, sin = rope if rope is not None else (None, None)
    # One offload context for every segment: a tensor every checkpoint saves (RoPE's cos, sin) is
    # copied to the host once, not once per segment (the planner counts it once).
    offload = (offload_saved_tensors(host_pool) if options.offload_activations
               else contextlib.nullcontext())
    for start, end, recompute in recompute_plan(len(layers), options):
        segment = [layer for _, layer in layers[start:end]]

        def run(x, cos, sin, document_ids, segment=segment):
            r = None if cos is None else (cos, sin)
            for layer in segment:
                x = layer(x, r, document_ids)
            return x

        with accounting.scope(f"layer {layers[start][0]}"), offload:
            if recompute:
                x = checkpoint(run, x, cos, sin, document_ids, rng_tracker=rng_tracker)
            else:
                x = run(x, cos, sin, document_ids)
    return x


class RecomputedAttention(nn.Module):
    """Selective recompute: an attention backend whose forward is checkpointed.

    It runs inside SelfAttention's RNGTracker fork, so the checkpoint's own replay of the default RNG
    stream (which is the forked stream at that moment) replays attention dropout exactly.
    """

    def __init__(self, backend):
        super().__init__()
        self.backend = backend
        self.name = getattr(backend, "name", type(backend).__name__)

    def forward(self, q, k, v, *, causal=True, softmax_scale=None, document_ids=None, dropout_p=0.0):
        def run(q, k, v, document_ids):
            return self.backend(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                document_ids=document_ids, dropout_p=dropout_p)
        return checkpoint(run, q, k, v, document_ids)
