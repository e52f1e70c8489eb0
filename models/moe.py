"""Mixture of experts on one rank (docs/design.md §16): router, load-balancing losses, token
permutation, grouped SwiGLU experts and the MoE layer that ties them together.

Shapes: b batch, s sequence, H hidden, T = b*s tokens, E experts, k = --moe-router-topk, F =
--moe-ffn-hidden-size, N = T*k routed assignments (fewer after capacity dropping).

    x [b, s, H] -> tokens [T, H]
    router       TopKRouter: logits [T, E] (fp32) -> probs [T, k] fp32, indices [T, k] int64
    (dropping)   capacity_keep_mask: keep [T, k] bool, at most ceil(cf*T*k/E) per expert
    permute      rows grouped by expert: permuted [N, H], tokens_per_expert [E], order [N]
    experts      GroupedExperts: one SwiGLU per expert over its contiguous rows -> [N, H]
    unpermute    y[t] = sum_j probs[t, j] * expert_out[row of (t, j)] -> [T, H]
    (+ shared)   SharedExpertMLP(tokens), ungated or sigmoid-gated (Qwen2-MoE) -> y [b, s, H]

The four steps are separate functions so that expert parallelism can slot an all-to-all (token
dispatch / combine, Megatron's MoEAlltoAllTokenDispatcher) between permute and the experts and
between the experts and unpermute. The load-balancing statistics (token counts, summed router
probabilities, token totals) are returned apart from the final combine, so a distributed version can
all-reduce them over the sequence-parallel ranks first (Megatron's global-batch aux loss).

Expert parallelism (alltoall dispatcher): megatron_sp/moe/dispatch.py. Under tp > 1 (with
--sequence-parallel) each tp rank routes its own tokens; the experts are whole on every rank
(expert tensor parallelism 1, parallel folding) or, with etp = tp, split like a dense SwiGLU MLP
(w1 column-parallel: the gate and the up rows each split over tp; w2 row-parallel), the tokens
all-gathered over tp before permute and the partial outputs reduce-scattered after unpermute
(megatron_sp/moe/comm.py gather_tokens / reduce_scatter_tokens); with ep > 1 too, the gathered
rows then go by all-to-all to the ep ranks with the same tp rank (mesh.expert_groups(ep, tp)).

Capacity (--moe-expert-capacity-factor) is that of this rank's tokens, as Megatron's: the dropping
happens before any dispatch, so it is the same whatever --expert-model-parallel-size. With
--moe-pad-expert-input-to-capacity every expert then gets exactly `capacity` rows (zero rows after
its kept ones: static shapes for the experts and the dispatch); their outputs are discarded.

Not done yet: expert tensor parallelism with ep > 1 or other than tp, capacity dropping under
expert tensor parallelism, group-limited routing, expert bias (aux-loss-free).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_sp.mesh import LayoutError, group_size
from megatron_sp.moe import (dispatch_experts_combine, gather_tokens, reduce_scatter_tokens,
                             reduce_statistics)
from megatron_sp.tensor_parallel.layers import set_tp_attributes

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------

@dataclass
class MoEConfig:
    """The MoE flags, named after Megatron-LM's (--num-experts -> num_experts, ...).

    norm_topk_prob (HF Qwen3-MoE's name; Megatron has no flag): renormalise the top-k weights to sum
    1 on the --moe-router-pre-softmax path. Megatron's default softmax path (top-k of the logits,
    then softmax over the k) and the sigmoid path (k > 1) are normalised whatever its value.
    """

    num_experts: int
    moe_ffn_hidden_size: int
    moe_router_topk: int = 2
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_router_pre_softmax: bool = False
    moe_router_score_function: str = "softmax"
    moe_router_topk_scaling_factor: float | None = None
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    norm_topk_prob: bool = False

    def __post_init__(self):
        for name in ("num_experts", "moe_ffn_hidden_size", "moe_router_topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be a positive integer, got {value!r}.")
        if self.moe_router_topk > self.num_experts:
            raise ValueError(f"moe_router_topk={self.moe_router_topk} (--moe-router-topk) exceeds "
                             f"num_experts={self.num_experts} (--num-experts).")
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None and (isinstance(shared, bool) or not isinstance(shared, int) or shared < 1):
            raise ValueError(f"moe_shared_expert_intermediate_size must be None (no shared expert) "
                             f"or a positive integer, got {shared!r}.")
        if self.moe_router_score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"moe_router_score_function={self.moe_router_score_function!r} "
                             f"(--moe-router-score-function) is not one of {SCORE_FUNCTIONS}.")
        if self.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
            raise ValueError(f"moe_router_load_balancing_type={self.moe_router_load_balancing_type!r} "
                             f"(--moe-router-load-balancing-type) is not one of {LOAD_BALANCING_TYPES}.")
        # (field, its flag, smallest allowed, strictly above it, what None means)
        for name, flag, low, strict, unset in (
                ("moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor", 0, True,
                 "None"),
                ("moe_aux_loss_coeff", "--moe-aux-loss-coeff", 0, False, None),
                ("moe_z_loss_coeff", "--moe-z-loss-coeff", 0, False, "None"),
                ("moe_expert_capacity_factor", "--moe-expert-capacity-factor", 0, True,
                 "None (no dropping)")):
            value = getattr(self, name)
            if value is None and unset:
                continue
            if not (value > low if strict else value >= low) or not math.isfinite(value):
                bound = f"{'>' if strict else '>='} {low} and finite"
                raise ValueError(f"{name} ({flag}) must be "
                                 f"{unset + ' or ' if unset else ''}{bound}, got {value!r}.")
        for name in ("moe_router_pre_softmax", "norm_topk_prob", "moe_pad_expert_input_to_capacity",
                     "moe_shared_expert_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoEConfig.{name} must be True or False, got {getattr(self, name)!r}.")
        if self.moe_shared_expert_gate and shared is None:
            raise ValueError("moe_shared_expert_gate (--moe-shared-expert-gate) needs a shared "
                             "expert (moe_shared_expert_intermediate_size, "
                             "--moe-shared-expert-intermediate-size): there is nothing to gate.")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity (--moe-pad-expert-input-to-capacity) "
                             "needs moe_expert_capacity_factor (--moe-expert-capacity-factor): "
                             "there is no capacity to pad to without it.")


# --------------------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------------------

def topk_routing(logits: torch.Tensor, config: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (fp32) -> (probs [T, k], indices [T, k] int64), Megatron's
    topk_softmax_with_capacity without the capacity part.

    - softmax (Megatron's default): top-k of the logits, softmax over those k. This equals softmax
      over all E, top-k, renormalise: HF Mixtral's router (either setting of
      moe_router_pre_softmax with norm_topk_prob=True gives Mixtral).
    - softmax with moe_router_pre_softmax: softmax over all E, then top-k, renormalised only when
      norm_topk_prob: HF Qwen3-MoE's router (norm_topk_prob as its config's).
    - sigmoid: sigmoid scores, top-k, normalised by their sum when k > 1 (as Megatron, DeepSeek-V3).
    moe_router_topk_scaling_factor then multiplies the weights.
    """
    k = config.moe_router_topk
    if config.moe_router_score_function == "sigmoid":
        probs, indices = torch.topk(torch.sigmoid(logits), k, dim=-1)
        if k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    elif config.moe_router_pre_softmax:
        probs, indices = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        if config.norm_topk_prob:
            probs = probs / probs.sum(dim=-1, keepdim=True)
    else:
        top_logits, indices = torch.topk(logits, k, dim=-1)
        probs = torch.softmax(top_logits, dim=-1)
    if config.moe_router_topk_scaling_factor is not None:
        probs = probs * config.moe_router_topk_scaling_factor
    return probs, indices


def scores_for_aux_loss(logits: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """The full-distribution scores [T, E] the load-balancing loss averages (Megatron's
    compute_routing_scores_for_aux_loss): softmax over all E, or sigmoid normalised over E (k > 1)."""
    if config.moe_router_score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = torch.sigmoid(logits)
    if config.moe_router_topk > 1:
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return scores


class TopKRouter(nn.Module):
    """Megatron's TopKRouter on one rank: a bias-free linear gate [E, H] computed in fp32
    (--moe-router-dtype fp32), then topk_routing.

    forward(tokens [T, H]) -> (probs [T, k] fp32, indices [T, k] int64, logits [T, E] fp32).
    """

    def __init__(self, config: MoEConfig, hidden_size: int):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, tokens: torch.Tensor):
        logits = F.linear(tokens.float(), self.weight.float())     # [T, E] fp32
        probs, indices = topk_routing(logits, self.config)
        return probs, indices, logits


# --------------------------------------------------------------------------------------------------
# Load-balancing and z losses: statistics, then combine
# --------------------------------------------------------------------------------------------------

def tokens_per_expert_of(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed assignments per expert [E] int64 from indices [T, k] (before any dropping)."""
    return torch.bincount(indices.reshape(-1), minlength=num_experts)   # [T*k] -> [E]


def aux_loss_statistics(scores: torch.Tensor, indices: torch.Tensor, num_experts: int):
    """The Switch / GShard loss's statistics over this rank's tokens: (counts [E] fp32 of routed
    assignments, prob_sums [E] fp32 = sum over tokens of the full scores, n_tokens fp32 scalar).
    Under sequence parallelism all three are summed over the sp ranks before combine_aux_loss."""
    counts = tokens_per_expert_of(indices, num_experts).float()
    n_tokens = torch.tensor(float(scores.shape[0]), device=scores.device)
    return counts, scores.float().sum(dim=0), n_tokens


def seq_aux_loss_statistics(scores: torch.Tensor, indices: torch.Tensor, num_experts: int,
                            batch_size: int):
    """Per-sequence statistics for --moe-router-load-balancing-type seq_aux_loss: (counts [b, E],
    prob_sums [b, E], n_tokens = tokens per sequence). Tokens are ordered [b, s] (our layout)."""
    k = indices.shape[-1]
    per_seq = indices.reshape(batch_size, -1)                   # [T, k] -> [b, s*k]
    counts = torch.zeros(batch_size, num_experts, device=scores.device)
    counts.scatter_add_(1, per_seq, torch.ones_like(per_seq, dtype=counts.dtype))
    per_seq_scores = scores.float().reshape(batch_size, -1, num_experts)   # [T, E] -> [b, s, E]
    prob_sums = per_seq_scores.sum(dim=1)                                 # [b, E]
    n_tokens = torch.tensor(float(per_seq.shape[1] // k), device=scores.device)
    return counts, prob_sums, n_tokens


def combine_aux_loss(counts: torch.Tensor, prob_sums: torch.Tensor, n_tokens, num_experts: int,
                     topk: int, coeff: float) -> torch.Tensor:
    """coeff * E * sum_i f_i * P_i with f_i = counts_i / (n * k) (fraction of assignments sent to
    expert i) and P_i = prob_sums_i / n (mean router probability of expert i), Megatron's
    switch_load_balancing_loss_func. Leading dimensions (sequences) are averaged."""
    f = counts / (n_tokens * topk)                                # [..., E]
    p = prob_sums / n_tokens                                      # [..., E]
    return coeff * num_experts * (f * p).sum(dim=-1).mean()


def seq_aux_loss(probs_all: torch.Tensor, indices: torch.Tensor, batch_size: int,
                 coeff: float) -> torch.Tensor:
    """The Switch loss of each sequence, averaged over the b sequences (Megatron's
    sequence_load_balancing_loss_func, DeepSeek-V2's sequence-wise balance loss)."""
    num_experts, topk = probs_all.shape[-1], indices.shape[-1]
    stats = seq_aux_loss_statistics(probs_all, indices, num_experts, batch_size)
    return combine_aux_loss(*stats, num_experts, topk, coeff)


def z_loss_statistics(logits: torch.Tensor):
    """(sum over tokens of logsumexp(logits)^2, n_tokens) over this rank's logits [T, E]."""
    lse = torch.logsumexp(logits.float(), dim=-1)                 # [T]
    return lse.square().sum(), torch.tensor(float(logits.shape[0]), device=logits.device)


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: coeff * mean over tokens of logsumexp(logits)^2 (Megatron's
    z_loss_func)."""
    total, n_tokens = z_loss_statistics(logits)
    return coeff * total / n_tokens


# --------------------------------------------------------------------------------------------------
# Token dropping, permutation, un-permutation
# --------------------------------------------------------------------------------------------------

def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Megatron's get_capacity: ceil(capacity_factor * T * k / E) assignments per expert."""
    return math.ceil(capacity_factor * num_tokens * topk / num_experts)


def capacity_keep_mask(probs: torch.Tensor, indices: torch.Tensor, num_experts: int,
                       capacity: int) -> torch.Tensor:
    """keep [T, k] bool: each expert keeps its `capacity` highest-probability assignments and drops
    the rest (Megatron's --moe-token-drop-policy probs), without a dense [T, E] map. Ties keep the
    earlier token."""
    flat_e, flat_p = indices.reshape(-1), probs.reshape(-1)      # [T, k] -> [N]
    by_prob = torch.argsort(flat_p, descending=True, stable=True)
    # Stable sort by expert of the prob-descending order: expert ascending, prob descending within.
    by_expert = by_prob[torch.argsort(flat_e[by_prob], stable=True)]
    counts = torch.bincount(flat_e, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts                     # [E] first row of each expert
    rank = torch.arange(flat_e.numel(), device=flat_e.device) - starts[flat_e[by_expert]]
    keep = torch.empty_like(flat_e, dtype=torch.bool)
    keep[by_expert] = rank < capacity
    return keep.view_as(indices)                                  # [N] -> [T, k]


def permute(hidden: torch.Tensor, indices: torch.Tensor, num_experts: int,
            keep: torch.Tensor | None = None):
    """Group token copies by expert (Megatron's permute): hidden [T, H], indices [T, k] ->
    (permuted [N, H], tokens_per_expert [E] int64, order [N] int64).

    order[r] is the flat assignment t*k + j that permuted row r holds: a stable argsort of the
    flattened indices, so rows are expert-major and token-ordered inside each expert. Dropped
    assignments (keep False) go to a sentinel bucket E that sorts last and is cut off (N = kept).
    """
    k = indices.shape[-1]
    flat = indices.reshape(-1)                                    # [T, k] -> [T*k]
    if keep is not None:
        flat = flat.masked_fill(~keep.reshape(-1), num_experts)   # [T, k] -> [T*k]
    order = torch.argsort(flat, stable=True)                      # [T*k]
    tokens_per_expert = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    if keep is not None:
        order = order[: int(tokens_per_expert.sum())]             # [N] (a host sync, as Megatron's)
    return hidden[order // k], tokens_per_expert, order


def pad_to_capacity(permuted: torch.Tensor, tokens_per_expert: torch.Tensor, capacity: int):
    """--moe-pad-expert-input-to-capacity: permuted [N, H] grouped by expert -> (padded
    [E*capacity, H], expert e's rows at e*capacity.. followed by zero rows, slots [N]: the padded row
    of each permuted row). Every expert has at most `capacity` rows (capacity_keep_mask)."""
    num_experts = tokens_per_expert.numel()
    expert = torch.repeat_interleave(torch.arange(num_experts, device=permuted.device),
                                     tokens_per_expert)                         # [N]
    starts = torch.cumsum(tokens_per_expert, 0) - tokens_per_expert             # [E]
    within = torch.arange(permuted.shape[0], device=permuted.device) - starts[expert]   # [N]
    slots = expert * capacity + within                                          # [N]
    padded = permuted.new_zeros(num_experts * capacity, permuted.shape[-1])     # [E*capacity, H]
    return padded.index_copy(0, slots, permuted), slots


def unpermute(expert_out: torch.Tensor, probs: torch.Tensor, order: torch.Tensor,
              num_tokens: int) -> torch.Tensor:
    """Weighted sum of each token's expert outputs (Megatron's unpermute with probs):
    expert_out [N, H], probs [T, k] -> [T, H] in expert_out's dtype. The weights are applied in fp32
    and the product cast back; a scatter-add (index_add_) sums the k copies of each token."""
    k = probs.shape[-1]
    weights = probs.reshape(-1)[order]                            # [T, k] -> [T*k] -> [N]
    weighted = (expert_out.float() * weights[:, None]).to(expert_out.dtype)   # [N, H]
    out = expert_out.new_zeros(num_tokens, expert_out.shape[-1])  # [T, H]
    return out.index_add(0, order // k, weighted)


# --------------------------------------------------------------------------------------------------
# Experts
# --------------------------------------------------------------------------------------------------

_GROUPED_MM_WORKS: dict = {}   # (device type, dtype) -> bool, probed once


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: torch._grouped_mm's backward refuses
    expanded (stride 0) gradients such as those of a .sum()."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped_mm_probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs forward and backward for this device and dtype (once, with
    autograd on whatever the caller's mode: a first forward under no_grad or inference_mode, an
    evaluation or a conversion check, must not turn the grouped GEMM off for the process).

    The probe runs inside the first forward only, so it must leave no trace there that a replay
    lacks: its saved tensors bypass the caller's saved-tensor hooks (an activation checkpoint
    counts the tensors saved in forward and in the recompute and refuses a difference; offload
    and memory accounting would see them too), and its inputs are not drawn from the global RNG
    (the recompute restores the RNG of the forward's start, so a draw here would shift dropout)."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM_WORKS:
        try:
            with torch.inference_mode(False), torch.enable_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                _GROUPED_MM_WORKS[key] = _grouped_mm_forward_backward(device, dtype)
        except (RuntimeError, NotImplementedError, TypeError):
            _GROUPED_MM_WORKS[key] = False
    return _GROUPED_MM_WORKS[key]


def _keep(t: torch.Tensor) -> torch.Tensor:
    """The identity saved-tensor hook: the innermost hooks win, so the probe's own saved tensors
    stay out of any enclosing checkpoint, offload or accounting hooks."""
    return t


def _grouped_mm_forward_backward(device: torch.device, dtype: torch.dtype) -> bool:
    """One tiny torch._grouped_mm forward and backward (raises where the kernel is missing)."""
    x = torch.ones(6, 8, device=device, dtype=dtype, requires_grad=True)
    w = torch.ones(2, 8, 8, device=device, dtype=dtype, requires_grad=True)
    offs = torch.tensor([0, 6], device=device, dtype=torch.int32)   # expert 0 gets none
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)        # [6, 8]
    y.backward(torch.ones_like(y))
    return True


def grouped_mm_usable(x: torch.Tensor, hidden_size: int, ffn_hidden_size: int) -> bool:
    """torch._grouped_mm exists, takes x's dtype (fp32 / bf16 / fp16), the strides are 16-byte
    aligned (H and F times the element size), and a small probe on x's device ran."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    size = x.element_size()
    if (hidden_size * size) % 16 or (ffn_hidden_size * size) % 16:
        return False
    if torch.compiler.is_compiling():
        return _GROUPED_MM_WORKS.get((x.device.type, x.dtype), False)
    return _grouped_mm_probe(x.device, x.dtype)


class GroupedExperts(nn.Module):
    """E SwiGLU experts (Megatron's GroupedMLP / TEGroupedMLP) with stacked weights:
    w1 [E, 2F, H] (gate rows first, then up: fc1 of every expert) and w2 [E, H, F] (fc2), the
    layout of HF's fused gate_up_proj / down_proj.

    forward(permuted [N, H], tokens_per_expert [E]) -> [N, H], rows grouped by expert as permute
    leaves them. use_grouped_mm: None = torch._grouped_mm where usable, else the per-expert loop;
    False = always the loop; True = grouped mm (error where it cannot run).
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int,
                 use_grouped_mm: bool | None = None):
        super().__init__()
        self.num_experts, self.hidden_size, self.ffn_hidden_size = num_experts, hidden_size, ffn_hidden_size
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        # Checkpoints store the stacks at [E, ...] with w1 as [E, 2, F, H] (format.py).
        self.w1.expert_stack = self.w2.expert_stack = True
        self.w1.stored_parts = 2
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None):
        with torch.no_grad():
            self.w1.normal_(0.0, std, generator=generator)
            self.w2.normal_(0.0, std, generator=generator)

    def _use_grouped(self, x: torch.Tensor) -> bool:
        if self.use_grouped_mm is False:
            return False
        usable = grouped_mm_usable(x, self.hidden_size, self.ffn_hidden_size)
        if self.use_grouped_mm and not usable:
            raise RuntimeError(f"torch._grouped_mm cannot run here ({x.device.type}, {x.dtype}, "
                               f"H={self.hidden_size}, F={self.ffn_hidden_size}); use the loop.")
        return usable

    def forward(self, permuted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if self._use_grouped(permuted):
            return self.forward_grouped(permuted, tokens_per_expert)
        return self.forward_loop(permuted, tokens_per_expert)

    def forward_grouped(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Two grouped GEMMs; expert e owns rows [offs[e-1], offs[e]) (offs = cumsum, int32)."""
        offs = torch.cumsum(tokens_per_expert, 0).to(torch.int32)                # [E]
        w1 = self.w1.to(x.dtype).transpose(-2, -1)               # [E, 2F, H] -> [E, H, 2F] (view)
        w2 = self.w2.to(x.dtype).transpose(-2, -1)               # [E, H, F] -> [E, F, H] (view)
        h = _ContiguousGrad.apply(torch._grouped_mm(x.contiguous(), w1, offs=offs))   # [N, 2F]
        gate, up = h.chunk(2, dim=-1)                             # each [N, F] (views)
        out = torch._grouped_mm(F.silu(gate) * up, w2, offs=offs)                 # [N, H]
        return _ContiguousGrad.apply(out)

    def forward_loop(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """One F.linear pair per expert over its slice of rows (Megatron's SequentialMLP)."""
        outs = []
        for e, rows in enumerate(x.split(tokens_per_expert.tolist())):   # each [n_e, H]
            gate, up = F.linear(rows, self.w1[e].to(x.dtype)).chunk(2, dim=-1)   # each [n_e, F]
            outs.append(F.linear(F.silu(gate) * up, self.w2[e].to(x.dtype)))    # [n_e, H]
        return torch.cat(outs, dim=0)                             # [N, H]


class SharedExpertMLP(nn.Module):
    """Megatron's shared expert (--moe-shared-expert-intermediate-size): a dense SwiGLU MLP every
    token passes through, added to the routed output. fc1 [2*Fs, H] gate rows first, fc2 [H, Fs].
    gate (--moe-shared-expert-gate, Qwen2-MoE's shared_expert_gate): the output is scaled by
    sigmoid(x . g) per token, g = gate.weight [1, H]; without it the sum is ungated."""

    def __init__(self, hidden_size: int, intermediate_size: int, gate: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.fc2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate = nn.Linear(hidden_size, 1, bias=False) if gate else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(tokens).chunk(2, dim=-1)              # each [T, Fs]
        out = self.fc2(F.silu(gate) * up)                         # [T, H]
        if self.gate is not None:
            out = torch.sigmoid(self.gate(tokens)) * out          # [T, 1] * [T, H]
        return out


# --------------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------------

class MoELayer(nn.Module):
    """Megatron's MoELayer on one rank: router -> (capacity dropping) -> permute -> experts ->
    unpermute (+ shared expert).

    forward(x [b, s, H]) -> (y [b, s, H], aux) with aux = {"load_balancing_loss": scalar (0 when
    moe_aux_loss_coeff is 0 or the type is "none"), "z_loss": scalar (0 without moe_z_loss_coeff),
    "tokens_per_expert": [E] int64 assignments each expert computed (after dropping)}. The caller
    adds the two losses to the language-model loss.
    """

    def __init__(self, config: MoEConfig, hidden_size: int, use_grouped_mm: bool | None = None,
                 expert_groups=None, expert_tp_group=None):
        super().__init__()
        self.config = config
        self.router = TopKRouter(config, hidden_size)
        # Expert tensor parallelism (etp = tp; None: whole experts): each rank holds F/etp of its
        # experts' ffn width and computes it for the tokens of every rank of the group.
        etp = group_size(expert_tp_group)
        self.expert_tp_group = expert_tp_group if etp > 1 else None
        if etp > 1 and config.moe_ffn_hidden_size % etp:
            raise LayoutError(f"--moe-ffn-hidden-size {config.moe_ffn_hidden_size} is not "
                              f"divisible by --expert-tensor-parallel-size {etp}: each rank holds "
                              f"an equal slice of every expert's ffn width.")
        # Expert parallelism (megatron_sp.mesh.ExpertGroups; None: every expert here): E/ep local
        # experts, the router still over all E; the rows travel by megatron_sp.moe.dispatch.
        ep = 1 if expert_groups is None else expert_groups.ep
        if config.num_experts % ep:
            raise LayoutError(f"--num-experts {config.num_experts} is not divisible by "
                              f"--expert-model-parallel-size {ep}: each expert-parallel rank "
                              f"must hold the same number of whole experts.")
        self.experts = GroupedExperts(config.num_experts // ep, hidden_size,
                                      config.moe_ffn_hidden_size // etp, use_grouped_mm)
        if etp > 1:   # w1 [E, 2F/etp, H]: gate and up rows each split (as the dense SwiGLU fc1)
            set_tp_attributes(self.experts.w1, 1, chunks=2)
            set_tp_attributes(self.experts.w2, 2)                 # w2 [E, H, F/etp]: row-parallel
        self.ep_group = None if expert_groups is None else expert_groups.ep_group
        if ep > 1:   # init_parameters draws the full [E, ...] tensor and keeps these rows
            for w in (self.experts.w1, self.experts.w2):
                w.expert_parallel, w.ep_rank, w.ep_size = True, expert_groups.ep_rank, ep
                w.etp_size = etp                  # which mesh.expert_groups(ep, etp) they use
        shared = config.moe_shared_expert_intermediate_size
        self.shared_expert = (SharedExpertMLP(hidden_size, shared, config.moe_shared_expert_gate)
                              if shared else None)
        self.context_group = None     # set by the model: the ranks sharing its sequences

    def router_losses(self, logits: torch.Tensor, indices: torch.Tensor, batch_size: int) -> dict:
        """The load-balancing and z losses of one micro-batch (scalars, 0 when off), over the
        whole sequences: their statistics are summed over self.context_group first (the ranks
        holding other parts of the same sequences; None on one rank)."""
        cfg = self.config
        zero = logits.new_zeros(())
        lb = z = zero
        if cfg.moe_aux_loss_coeff > 0 and cfg.moe_router_load_balancing_type != "none":
            scores = scores_for_aux_loss(logits, cfg)
            if cfg.moe_router_load_balancing_type == "seq_aux_loss":
                stats = seq_aux_loss_statistics(scores, indices, cfg.num_experts, batch_size)
            else:
                stats = aux_loss_statistics(scores, indices, cfg.num_experts)
            counts, prob_sums, n_tokens = reduce_statistics(list(stats), self.context_group)
            lb = combine_aux_loss(counts, prob_sums, n_tokens, cfg.num_experts,
                                  cfg.moe_router_topk, cfg.moe_aux_loss_coeff)
        if cfg.moe_z_loss_coeff:
            total, n_tokens = reduce_statistics(list(z_loss_statistics(logits)), self.context_group)
            z = cfg.moe_z_loss_coeff * total / n_tokens
        return {"load_balancing_loss": lb, "z_loss": z}

    def run_experts(self, permuted: torch.Tensor, tokens_per_expert: torch.Tensor,
                    capacity: int | None) -> torch.Tensor:
        """permuted [N, H] grouped by expert -> the experts' outputs [N, H]: here, or all-to-all
        to the experts' ranks and back (ep > 1); padded to `capacity` rows per expert first with
        --moe-pad-expert-input-to-capacity (the padding rows' outputs are discarded)."""
        slots = None
        if self.config.moe_pad_expert_input_to_capacity:
            permuted, slots = pad_to_capacity(permuted, tokens_per_expert, capacity)  # [E*C, H]
            tokens_per_expert = torch.full_like(tokens_per_expert, capacity)
        if self.ep_group is not None:
            out = dispatch_experts_combine(permuted, tokens_per_expert, self.experts, self.ep_group)
        else:
            out = self.experts(permuted, tokens_per_expert)
        return out if slots is None else out[slots]               # [E*C, H] -> [N, H]

    def forward(self, x: torch.Tensor):
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)                              # [b, s, H] -> [T, H]
        probs, indices, logits = self.router(tokens)
        aux = self.router_losses(logits, indices, b)
        keep = capacity = None
        if self.config.moe_expert_capacity_factor is not None:   # of this rank's b*s tokens
            capacity = expert_capacity(b * s, self.config.moe_router_topk, self.config.num_experts,
                                       self.config.moe_expert_capacity_factor)
            keep = capacity_keep_mask(probs, indices, self.config.num_experts, capacity)
        if self.expert_tp_group is not None:   # etp = tp
            y, tokens_per_expert = self._tensor_parallel_experts(tokens, probs, indices, keep,
                                                                 capacity)
        else:
            permuted, tokens_per_expert, order = permute(tokens, indices, self.config.num_experts,
                                                         keep)
            expert_out = self.run_experts(permuted, tokens_per_expert, capacity)
            y = unpermute(expert_out, probs, order, b * s)        # [T, H]
        if self.shared_expert is not None:
            y = y + self.shared_expert(tokens)
        aux["tokens_per_expert"] = tokens_per_expert
        return y.view(b, s, h), aux                               # [T, H] -> [b, s, H]


    def _tensor_parallel_experts(self, tokens, probs, indices, keep=None, capacity=None):
        """Expert tensor parallelism: tokens [T, H], probs / indices [T, k] of this rank ->
        gathered over the group ([p*T, ...]), permuted, this rank's ffn shard of every expert
        (ep > 1: of the ep group's ranks with the same tp rank, all-to-all there and back),
        unpermuted, the partial sums reduce-scattered back -> (y [T, H], tokens_per_expert [E] of
        the gathered tokens). Capacity: each rank's keep mask [T, k] (of its own tokens, as with
        etp 1) is gathered too; padded to capacity, an expert gets p*capacity rows (p ranks'
        capacity each)."""
        group = self.expert_tp_group
        p = group_size(group)
        all_tokens = gather_tokens(tokens, group)                 # [p*T, H]
        all_probs = gather_tokens(probs, group)                   # [p*T, k]
        all_indices = gather_tokens(indices, group)               # [p*T, k]
        all_keep = None if keep is None else gather_tokens(keep.long(), group).bool()  # [p*T, k]
        permuted, tokens_per_expert, order = permute(all_tokens, all_indices,
                                                     self.config.num_experts, all_keep)
        padded = None if capacity is None else p * capacity
        partial = unpermute(self.run_experts(permuted, tokens_per_expert, padded), all_probs,
                            order, all_tokens.shape[0])           # [p*T, H], this shard's part
        return reduce_scatter_tokens(partial, group), tokens_per_expert   # [T, H]


class _AuxLossScaler(torch.autograd.Function):
    """Megatron's MoEAuxLossAutoScaler: the identity on the layer's output whose backward also
    gives the router losses the gradient `scale`, so that they train the router without entering
    the language-model loss the model returns."""

    @staticmethod
    def forward(ctx, y, loss, scale):
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


class MoEMLP(MoELayer):
    """MoELayer as a transformer layer's MLP (GPTModel with num_experts): x [b, s, H] -> [b, s, H].

    The router losses reach backward through _AuxLossScaler with `aux_loss_scale` (GPTModel.
    set_moe_aux_loss_scale: 1 / (micro-batches x data-parallel replicas) in training, so that they
    are averaged as Megatron averages them); `last_aux` keeps their values (detached) and the
    tokens per expert of the last forward, for logging."""

    aux_loss_scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, aux = super().forward(x)
        loss = aux["load_balancing_loss"] + aux["z_loss"]
        if loss.requires_grad:
            y = _AuxLossScaler.apply(y, loss, self.aux_loss_scale)
        self.last_aux = {k: v.detach() for k, v in aux.items()}
        return y
