"""Forward-backward over the micro-batches of one global batch, without pipelining.

Loss normalisation (docs/design.md §4): each micro-batch contributes sum(per-token loss * mask) divided by the
number of unmasked tokens in the *global* batch (counted before the step, summed over dp). Gradients
are then summed over dp x sp, so every layout computes exactly the single-device mean, and a rank
whose chunk holds no unmasked token contributes zero (never NaN).
"""
from __future__ import annotations

import contextlib

import torch


def micro_batch_loss(model, mb: dict, num_tokens: torch.Tensor) -> torch.Tensor:
    """This rank's share of the global mean loss for one micro-batch (a scalar)."""
    per_token = model(input_ids=mb["tokens"], position_ids=mb.get("position_ids"),
                      labels=mb["labels"], document_ids=mb.get("document_ids"))   # [b, s/sp]
    mask = model.shard_sequence(mb["loss_mask"]).to(per_token.dtype)            # [b, s/sp]
    return (per_token * mask).sum() / num_tokens


def forward_backward_no_pipelining(model_chunks, micro_batches, mesh, *, num_tokens, grad_sync=None,
                                   autocast=contextlib.nullcontext, forward_only=False):
    """Gradient accumulation over micro-batches; returns the summed (normalised) loss of this rank.

    With a GradientSync, its bucketed all-reduce is armed before the last backward so communication
    overlaps it.
    """
    (model,) = model_chunks
    total = torch.zeros((), dtype=torch.float64, device=num_tokens.device)   # no host sync per micro-batch
    for i, mb in enumerate(micro_batches):
        with (torch.no_grad() if forward_only else contextlib.nullcontext()):
            with autocast():
                loss = micro_batch_loss(model, mb, num_tokens)
        if not forward_only:
            if grad_sync is not None and i == len(micro_batches) - 1:
                grad_sync.start_last_backward()
            loss.backward()
        total += loss.detach().double()
    return total
