"""Cross-entropy over vocabulary-parallel logits (Megatron-LM's vocab_parallel_cross_entropy).

Each tp rank holds logits [b, s, V_pad/tp] for its slice of the (padded) vocabulary. The loss is
computed without ever gathering the full logits: the max is all-reduced (MAX), then the target
logit, the sum of exps (and, with label smoothing, the sum of logits) are all-reduced (SUM) in one
small buffer of [b, s, 2 or 3] values.

Padding: columns whose global index is >= `vocab_size` (the real vocabulary) are excluded from the
softmax, so padding changes neither the loss nor its gradient, whatever the tp size.

Label smoothing follows Megatron: with K the real vocabulary and alpha = label_smoothing, the
target gets 1 - alpha and every other class alpha/(K-1):

    loss = (1 - a) * nll - a * mean_i log p_i,   a = alpha * K / (K - 1)

i.e. `F.cross_entropy(..., label_smoothing=a)`. Unlike Megatron, the mean over the vocabulary is
taken over all of it (all-reduced over tp), not over the local slice only.
"""
from __future__ import annotations

import torch

from megatron_sp.tensor_parallel import mappings


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward keeps only the fp32 softmax [b, s, V/tp] (reused in place for the gradient)."""

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_size, label_smoothing):
        v_local = logits.size(-1)
        start = mappings.group_rank(group) * v_local
        n_valid = max(0, min(v_local, vocab_size - start))  # real (unpadded) columns held here
        smoothing = label_smoothing * vocab_size / (vocab_size - 1) if label_smoothing > 0 else 0.0

        # Our own fp32 copy [b, s, V/tp], modified in place from here on.
        x = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        if n_valid < v_local:
            x[..., n_valid:] = float("-inf")
        logits_max = mappings.all_reduce_(x.max(dim=-1).values.contiguous(), group, op="max")
        x.sub_(logits_max.unsqueeze(-1))                   # [b, s, V/tp] - [b, s, 1]

        outside = (labels < start) | (labels >= start + v_local)
        local_labels = (labels - start).masked_fill(outside, 0).long()
        target = x.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1)  # [b, s, 1] -> [b, s]
        stats = [target.masked_fill(outside, 0.0)]
        if smoothing:
            stats.append(x[..., :n_valid].sum(dim=-1))     # sum of real shifted logits [b, s]
        x.exp_()
        stats.insert(1, x.sum(dim=-1))                     # sum of exps [b, s]
        stats = mappings.all_reduce_(torch.stack(stats, dim=-1), group)  # [b, s, 2 or 3]

        log_z = stats[..., 1].log()                        # [b, s]
        loss = log_z - stats[..., 0]
        if smoothing:
            mean_log_probs = stats[..., 2] / vocab_size - log_z
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs

        x.div_(stats[..., 1].unsqueeze(-1))                # softmax [b, s, V/tp]
        ctx.save_for_backward(x, local_labels, outside)
        ctx.smoothing, ctx.vocab_size, ctx.n_valid = smoothing, vocab_size, n_valid
        ctx.logits_dtype = logits.dtype
        ctx.done = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.done:
            raise RuntimeError("vocab_parallel_cross_entropy reuses its saved softmax in place: "
                               "backward can run only once (do not retain_graph through it).")
        ctx.done = True
        grad, local_labels, outside = ctx.saved_tensors  # softmax, turned into the gradient
        # d loss / d logits = softmax - (1 - a) * onehot(target) - a / K over the real columns.
        grad_2d = grad.view(-1, grad.size(-1))             # [b*s, V/tp]
        rows = torch.arange(grad_2d.size(0), device=grad.device)
        hit = (~outside).view(-1).to(grad.dtype)           # [b*s]: 1 where the target is local
        grad_2d[rows, local_labels.view(-1)] -= (1.0 - ctx.smoothing) * hit  # labels [b*s]
        if ctx.smoothing:
            grad[..., :ctx.n_valid] -= ctx.smoothing / ctx.vocab_size
        grad.mul_(grad_loss.unsqueeze(-1))                 # [b, s, V/tp] * [b, s, 1]
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group, *,
                                 vocab_size: int | None = None,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss [b, s] (fp32, unreduced) of vocabulary-parallel `logits` [b, s, V_pad/tp].

    `labels` [b, s] are global ids < `vocab_size` (default: the padded vocabulary V_pad = p * V/tp).
    Any float dtype in; computed in fp32. The caller applies the loss mask and the reduction.
    """
    padded = logits.size(-1) * mappings.group_size(group)
    vocab_size = padded if vocab_size is None else int(vocab_size)
    if not 1 <= vocab_size <= padded:
        raise ValueError(f"vocab_size {vocab_size} must be between 1 and the padded vocabulary "
                         f"{padded} (= {logits.size(-1)} local columns x tp size).")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}.")
    if label_smoothing > 0 and vocab_size < 2:
        raise ValueError("label smoothing needs a vocabulary of at least 2 tokens.")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels of shape {tuple(labels.shape)} do not match logits of shape "
                         f"{tuple(logits.shape)} (expected labels {tuple(logits.shape[:-1])}).")
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_size,
                                            float(label_smoothing))
