"""Which global layer ids each pipeline stage (and each virtual chunk of it) holds.

Megatron-LM's rules (docs/design.md §6):
- Stages own contiguous layers. By default the L layers split evenly over pp stages.
- --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers give the first / last
  stage that many layers; the remaining layers split evenly over the other stages.
- With --num-layers-per-virtual-pipeline-stage n (interleaved 1F1B), the model is cut into
  pp*v virtual stages of n layers, v = L/(pp*n); virtual stage j = chunk*pp + stage holds layers
  [j*n, (j+1)*n), so chunk c of stage r holds layers [(c*pp + r)*n, (c*pp + r + 1)*n).
- Both combine (Megatron-LM's uneven interleaving): every stage's layers split into v chunks, v
  from the evenly split stages (count/n); round c of the model hands each stage its share in order.
- Only chunk 0 of stage 0 embeds; only the last chunk of the last stage has the final norm, output
  layer and loss. Layer ids stay global, so parameter names never depend on the layout.
Bad numbers are refused with one sentence naming them.
"""
from __future__ import annotations

from megatron_sp.errors import UserError


class PipelineLayoutError(UserError, ValueError):
    """A layer split or micro-batch count the pipeline cannot run."""


def stage_layer_counts(num_layers: int, pp: int, first: int | None = None,
                       last: int | None = None) -> list[int]:
    """Number of layers of each of the pp stages."""
    if pp < 1:
        raise PipelineLayoutError(f"pipeline size must be >= 1, got {pp}.")
    if pp == 1:
        if first is not None or last is not None:
            raise PipelineLayoutError(
                "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1.")
        return [num_layers]
    fixed = {}
    if first is not None:
        fixed[0] = first
    if last is not None:
        fixed[pp - 1] = last
    for stage, n in fixed.items():
        if n < 1:
            raise PipelineLayoutError(f"stage {stage} would hold {n} layers: every pipeline stage "
                                      f"needs at least one layer.")
    rest = num_layers - sum(fixed.values())
    others = pp - len(fixed)
    if others == 0:
        if rest != 0:
            raise PipelineLayoutError(
                f"--decoder-first-pipeline-num-layers {first} + --decoder-last-pipeline-num-layers "
                f"{last} = {first + last} does not equal --num-layers {num_layers} with 2 stages.")
        return [fixed[0], fixed[pp - 1]]
    if rest < others:
        given = " + ".join(f"--decoder-{'first' if s == 0 else 'last'}-pipeline-num-layers "
                           f"{fixed[s]}" for s in sorted(fixed))
        raise PipelineLayoutError(
            f"{given} leave{'s' if len(fixed) == 1 else ''} "
            f"{'no layer' if rest <= 0 else f'only {rest} layer' + ('s' if rest > 1 else '')} of "
            f"--num-layers {num_layers} for the other {others} pipeline stage"
            f"{'s' if others > 1 else ''}: every stage needs at least one layer; give the "
            f"first/last stage fewer layers.")
    if rest % others:
        what = ("" if not fixed else
                f" after {sum(fixed.values())} on the " +
                " and ".join(("first" if s == 0 else "last") for s in sorted(fixed)) + " stage")
        raise PipelineLayoutError(
            f"{rest} layers{what} do not split evenly over {others} pipeline stages "
            f"(--num-layers {num_layers}, --pipeline-model-parallel-size {pp}): choose layer counts "
            f"so that every stage gets the same whole number of layers.")
    per = rest // others
    return [fixed.get(stage, per) for stage in range(pp)]


def stage_layer_ids(num_layers: int, pp: int, first: int | None = None,
                    last: int | None = None) -> list[list[int]]:
    """Global layer ids of each stage: contiguous, in order."""
    out, start = [], 0
    for n in stage_layer_counts(num_layers, pp, first, last):
        out.append(list(range(start, start + n)))
        start += n
    return out


def virtual_pipeline_size(num_layers: int, pp: int, layers_per_virtual_stage: int | None,
                          first: int | None = None, last: int | None = None) -> int:
    """Number of model chunks per stage (v) for --num-layers-per-virtual-pipeline-stage n.

    Even stages: v = L/(pp*n). Uneven (first/last given): n counts the layers of a virtual stage of
    the evenly split stages (of the first stage when both ends are fixed with pp = 2), and every
    stage's layers must split into v equal chunks (Megatron-LM: stage layers // vp_size per chunk).
    """
    if layers_per_virtual_stage is None:
        return 1
    n = layers_per_virtual_stage
    if pp < 2:
        raise PipelineLayoutError("--num-layers-per-virtual-pipeline-stage needs "
                                  "--pipeline-model-parallel-size > 1.")
    if first is None and last is None:
        if n < 1 or num_layers % (pp * n):
            raise PipelineLayoutError(
                f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp} "
                f"x --num-layers-per-virtual-pipeline-stage {n} = {pp * n}: every virtual stage "
                f"needs {n} layers.")
        return num_layers // (pp * n)
    counts = stage_layer_counts(num_layers, pp, first, last)
    fixed = {0} if first is not None else set()
    fixed |= {pp - 1} if last is not None else set()
    even = [counts[r] for r in range(pp) if r not in fixed] or [counts[0]]
    if n < 1 or even[0] % n:
        raise PipelineLayoutError(
            f"{even[0]} layers per pipeline stage are not divisible by "
            f"--num-layers-per-virtual-pipeline-stage {n}.")
    v = even[0] // n
    for r, count in enumerate(counts):
        if count % v:
            raise PipelineLayoutError(
                f"pipeline stage {r} holds {count} layers, which do not split into {v} virtual "
                f"stages ({even[0]} layers per stage / --num-layers-per-virtual-pipeline-stage {n}): "
                f"choose --decoder-first/last-pipeline-num-layers as multiples of {v}.")
    return v


def chunk_layer_ids(num_layers: int, pp: int, pp_rank: int, *, layers_per_virtual_stage=None,
                    first: int | None = None, last: int | None = None) -> list[list[int]]:
    """Global layer ids of each model chunk held by stage `pp_rank` (one chunk unless interleaved).

    Interleaved, as Megatron-LM's get_transformer_layer_offset: stage r's layers split into v
    chunks of c_r = count_r/v; round c of the model (layers [c*L/v, (c+1)*L/v)) gives stage r its
    c_r layers after those of stages 0..r-1. With even stages this is virtual stage c*pp + r.
    """
    v = virtual_pipeline_size(num_layers, pp, layers_per_virtual_stage, first, last)
    if v == 1:
        return [stage_layer_ids(num_layers, pp, first, last)[pp_rank]]
    per_chunk = [count // v for count in stage_layer_counts(num_layers, pp, first, last)]
    start = sum(per_chunk[:pp_rank])
    return [list(range(c * (num_layers // v) + start, c * (num_layers // v) + start + per_chunk[pp_rank]))
            for c in range(v)]


def check_num_microbatches(num_microbatches: int, pp: int, num_chunks: int = 1) -> None:
    """Refuse a micro-batch count the schedule cannot run (interleaved: a multiple of pp)."""
    if num_microbatches < 1:
        raise PipelineLayoutError(f"the pipeline needs at least one micro-batch, got {num_microbatches}.")
    if num_chunks > 1 and num_microbatches % pp:
        raise PipelineLayoutError(
            f"the interleaved pipeline schedule needs the number of micro-batches "
            f"({num_microbatches} = global batch / (micro-batch size x dp)) to be a multiple of "
            f"--pipeline-model-parallel-size {pp} (as Megatron-LM): change --global-batch-size.")
