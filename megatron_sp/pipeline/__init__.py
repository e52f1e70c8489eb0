"""Pipeline parallelism: stage partition, point-to-point communication, 1F1B and interleaved schedules.

    specs = chunk_specs(config.num_layers, mesh, layers_per_virtual_stage=..., first=..., last=...)
    chunks = [GPTModel(config, mesh, **spec, ...) for spec in specs]
    schedule = get_forward_backward_func(mesh.pp_size, len(chunks))

The core does not import the models (docs/design.md §2): callers build the chunks from the specs.
"""
from __future__ import annotations

from .p2p import P2PCommunicator
from .partition import (PipelineLayoutError, check_num_microbatches, chunk_layer_ids,
                        stage_layer_counts, stage_layer_ids, virtual_pipeline_size)
from .schedules import (forward_backward_pipelining_with_interleaving,
                        forward_backward_pipelining_without_interleaving, get_forward_backward_func)


def chunk_specs(num_layers: int, mesh, *, layers_per_virtual_stage=None, first=None,
                last=None) -> list[dict]:
    """GPTModel keyword arguments (layer_ids, pre_process, post_process) of this stage's chunks.

    Only chunk 0 of stage 0 embeds; only the last chunk of the last stage has the output and loss.
    """
    ids = chunk_layer_ids(num_layers, mesh.pp_size, mesh.pp_rank,
                          layers_per_virtual_stage=layers_per_virtual_stage, first=first, last=last)
    v = len(ids)
    return [dict(layer_ids=layer_ids,
                 pre_process=mesh.is_first_stage and c == 0,
                 post_process=mesh.is_last_stage and c == v - 1)
            for c, layer_ids in enumerate(ids)]


__all__ = ["P2PCommunicator", "PipelineLayoutError", "check_num_microbatches", "chunk_layer_ids",
           "chunk_specs", "forward_backward_pipelining_with_interleaving",
           "forward_backward_pipelining_without_interleaving", "get_forward_backward_func",
           "stage_layer_counts", "stage_layer_ids", "virtual_pipeline_size"]
