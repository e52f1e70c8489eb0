"""The exact causal-LM loss over a sequence cut into Ulysses (x ring) chunks (design.md §4, §15).

    loss(logits, shard, sp_group, cp_group)          logits [b, n, V] of this rank's n tokens
    tiled_loss(hidden, lm_head_weight, shard, ...)   the same from the final hidden states
                                                     [b, n, H], the logits one tile at a time

Both return L = S / N on every rank: S the sum of token cross entropies (fp32) over the whole
sequence's unmasked tokens (shift_labels != -100), N their count. Each rank computes its local sum
S_r and count N_r; both go in ONE all-reduce per group (sp, then cp, then dp; the count without
gradient), S's with a backward that all-reduces the incoming gradients (megatron_sp/hf/comm.py).
Which tokens a rank holds (contiguous chunks, or the ring's zigzag ones) does not matter: sums
are sums. Never a mean of per-rank means (the sp-size over-scaling bug); an all-masked chunk
contributes 0, and N = 0 over the whole group gives L = 0 with zero gradients, never NaN.
num_items_in_batch=N given (the Trainer's count of the optimizer step's targets, already known):
only S is reduced, L = S / N.

Gradient reduction. Every rank seeds its backward with dL = 1 and the all-reduce's backward sums
those n seeds, so each rank's parameter gradient is n * (its share of dL/dtheta), where n is the
number of ranks the sum was reduced over. Hence:
- dp_group given (sum and count reduced over dp x sp x cp): L is the mean over the GLOBAL batch's
  tokens, and AVERAGING the gradients over the flattened dp x sp x cp group (what DDP and FSDP2
  do by default over the world, or over a dp x sp mesh dimension) gives exactly one process's
  gradient of that global mean, whatever the token counts of the dp replicas.
- dp_group None (reduced over sp x cp only): L is this replica's sequence mean; averaging over
  dp x sp x cp gives the mean over dp of the replicas' means (equal to the global token mean only
  when every replica has the same token count: what DDP without sp computes too).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_sp.hf.batch import IGNORE_INDEX, SequenceParallelError
from megatron_sp.hf.comm import sum_over_groups
from megatron_sp.memory.options import resolve_count
from megatron_sp.memory.recompute import checkpoint


def _targets(shard: dict, tokens: int) -> torch.Tensor:
    labels = shard.get("shift_labels") if isinstance(shard, dict) else shard
    if labels is None:
        raise SequenceParallelError(
            "megatron_sp.hf.loss: the batch has no 'shift_labels'; pass the dict shard_batch "
            "returned (its labels are shifted over the whole sequence before the cut).")
    if labels.shape[1] != tokens:
        raise SequenceParallelError(
            f"megatron_sp.hf.loss: shift_labels cover {labels.shape[1]} tokens but the logits "
            f"{tokens}; pass the same shard_batch output that went into the model.")
    return labels


def _token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Sum of fp32 cross entropies of logits [b, c, V] against labels [b, c] (ignored: 0)."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),   # [b*c, V], [b*c]
                           ignore_index=ignore_index, reduction="sum")


def _reduce(local_sum: torch.Tensor, labels: torch.Tensor, groups, ignore_index: int,
            num_items=None):
    """sum / count over the groups, both in one all-reduce per group (the count carries no
    gradient); with num_items (the count, known) only the sum is reduced."""
    if num_items is not None:
        total = sum_over_groups(local_sum.float(), groups)
        return total / torch.as_tensor(num_items, dtype=torch.float32,
                                       device=total.device).clamp(min=1.0)
    count = (labels != ignore_index).sum().to(torch.float32)
    both = sum_over_groups(torch.stack([local_sum.float(), count]), groups)   # [2]: sum, count
    return both[0] / both[1].detach().clamp(min=1.0)


def loss(logits: torch.Tensor, batch: dict, sp_group, cp_group=None, *, dp_group=None,
         num_items_in_batch=None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The exact mean token cross entropy over the whole sequence (over the global batch with
    dp_group): logits [b, n, V] of this rank's tokens, batch the dict shard_batch returned (or
    its shift_labels); cp_group the ring shard_batch was given (or None). See the module
    docstring for the gradient reduction that makes the gradients equal to one process's: average
    them over dp x sp x cp. num_items_in_batch: the denominator when already known (no count is
    reduced)."""
    labels = _targets(batch, logits.shape[1])
    local = _token_loss_sum(logits, labels, ignore_index)
    return _reduce(local, labels, (sp_group, cp_group, dp_group), ignore_index,
                   num_items_in_batch)


def _tile_loss(hidden, labels, weight, bias, ignore_index):
    logits = F.linear(hidden, weight, bias)                   # [b, c, H] -> [b, c, V]
    return _token_loss_sum(logits, labels, ignore_index)


def tiled_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, batch: dict, sp_group,
               cp_group=None, *, tiles="auto", lm_head_bias=None, dp_group=None,
               num_items_in_batch=None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """loss() from the final hidden states hidden [b, n, H] and the output projection
    lm_head_weight [V, H] (model.lm_head.weight), without the [b, s/sp, V] logits ever existing
    whole: the chunk is cut into `tiles` sequence tiles ("auto": megatron_sp.memory's rule,
    about ceil(V / H) tiles of at least its minimum tokens) and each tile's projection + cross
    entropy is one checkpoint, recomputed in backward (only the tile's input is kept).
    The value and gradients equal loss(hidden @ W.T + b, ...) up to summation order."""
    labels = _targets(batch, hidden.shape[1])
    b, s_local, h = hidden.shape
    n = resolve_count(tiles, s_local, lm_head_weight.shape[0], h, tokens=b * s_local)
    size = -(-s_local // n)
    pieces = zip(hidden.split(size, dim=1), labels.split(size, dim=1))   # [b, c, H], [b, c]
    if n == 1 or not torch.is_grad_enabled():
        sums = [_tile_loss(x, y, lm_head_weight, lm_head_bias, ignore_index) for x, y in pieces]
    else:
        sums = [checkpoint(_tile_loss, x, y, lm_head_weight, lm_head_bias, ignore_index)
                for x, y in pieces]
    return _reduce(torch.stack(sums).sum(), labels, (sp_group, cp_group, dp_group), ignore_index,
                   num_items_in_batch)
