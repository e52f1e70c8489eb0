"""Mixture-of-experts terms of the memory model (models/moe.py): which layers are MoE layers and
the heaviest pipeline stage, the MoE block's saved bytes (the table in activations.py's docstring)
and its backward's largest phase, and the layouts our MoE layers refuse."""
from __future__ import annotations

import functools
import math

from megatron_sp.memory.planner.job import divisors

# The MLP block's saved terms, dense or MoE (what the attention phase of one layer's backward no
# longer holds: layer_backward_peak).
MLP_TERMS = ("mlp_norm", "fc1_input", "mlp_act", "router_input", "router_probs", "expert_input",
             "expert_act", "combine", "token_indices", "shared_expert")


def is_moe(cfg) -> bool:
    """Whether cfg has mixture-of-experts layers (GPTConfig.num_experts)."""
    return getattr(cfg, "num_experts", None) is not None


_MOE_FLAGS: dict = {}      # (layers, experts, moe_layer_freq) -> moe_layer_flags


def moe_layer_flags(cfg) -> tuple[bool, ...]:
    """cfg.is_moe_layer of every layer (all False for a dense model), asked once per pattern (the
    planner asks for them in every candidate it sizes)."""
    freq = getattr(cfg, "moe_layer_freq", None)
    key = (cfg.num_layers, getattr(cfg, "num_experts", None),
           tuple(freq) if isinstance(freq, list) else freq)
    if key not in _MOE_FLAGS:
        _MOE_FLAGS[key] = tuple(is_moe(cfg) and bool(cfg.is_moe_layer(i))
                                for i in range(cfg.num_layers))
    return _MOE_FLAGS[key]


def stage_layers(cfg, pp: int = 1) -> list[int]:
    """Global indices of the layers of the heaviest pipeline stage: of the pp contiguous stages of
    L/pp layers, the one with the most MoE layers (the first on a tie: the first stage for a
    dense model)."""
    return list(_heaviest_stage(moe_layer_flags(cfg), pp))


@functools.lru_cache(maxsize=None)
def _heaviest_stage(flags: tuple[bool, ...], pp: int) -> range:
    per = len(flags) // pp
    stages = [range(i * per, (i + 1) * per) for i in range(pp)]
    return max(stages, key=lambda layers: sum(flags[i] for i in layers))


def stage_kinds(cfg, num_layers: int) -> list[bool]:
    """Whether each of a stage's num_layers layers is a MoE layer: the heaviest stage when
    num_layers divides the model's layers (stage_layers), else its first num_layers."""
    flags = moe_layer_flags(cfg)
    if cfg.num_layers % num_layers == 0:
        return [flags[i] for i in stage_layers(cfg, cfg.num_layers // num_layers)]
    return list(flags[:num_layers])


def stage_moe_layers(cfg, pp: int) -> int:
    """MoE layers of the heaviest pipeline stage (stage_layers)."""
    flags = moe_layer_flags(cfg)
    return sum(flags[i] for i in stage_layers(cfg, pp))


def router_prob_bytes(cfg, e: int, r: int, device: str = "cuda") -> int:
    """Element size of the router's saved scores (models/moe.py TopKRouter: tokens.float() @
    weight.float()): fp32 without autocast (e == r); under autocast (e != r) its linear runs in
    bf16, and so do its scores on CPU, while CUDA's autocast runs softmax in fp32 (its fp32 op
    list; a sigmoid stays in bf16)."""
    if e == r:
        return 4
    return 4 if device == "cuda" and cfg.moe_router_score_function == "softmax" else e


def _router_terms(cfg, Tm, e, r, device) -> dict:
    """router_input and router_probs of one MoE layer over Tm tokens (the MoE block in
    activations.py's docstring)."""
    H, E, k = cfg.hidden_size, cfg.num_experts, cfg.moe_router_topk
    p = router_prob_bytes(cfg, e, r, device)
    probs = Tm * k * 8                                 # top-k indices [Tm, k] int64
    if cfg.moe_router_score_function == "sigmoid":      # sigmoid [Tm, E], normalised over the k
        probs += Tm * E * p + (Tm * k * p + Tm * p if k > 1 else 0)
    elif cfg.moe_router_pre_softmax:                    # softmax [Tm, E], top-k of it
        probs += Tm * E * p + (Tm * k * p + Tm * p if cfg.moe_norm_topk_prob else 0)
    else:                                               # softmax over the top-k logits [Tm, k]
        probs += Tm * k * p
    if cfg.moe_aux_loss_coeff > 0 and cfg.moe_router_load_balancing_type != "none":
        sigmoid = cfg.moe_router_score_function == "sigmoid"
        probs += Tm * E * p + (Tm * p if sigmoid and k > 1 else 0)   # the full scores [Tm, E]
    if cfg.moe_z_loss_coeff:
        probs += Tm * E * 4 + Tm * 4                    # fp32 logits, logsumexp [Tm]
    autocast = e != r
    return {"router_input": Tm * H * (e if autocast else 4), "router_probs": probs}


def expert_rows(cfg, Tm) -> tuple[float, float]:
    """(N, Nx): the routed rows of Tm tokens, N = Tm*k (uniform routing: capacity drops none), and
    the rows the experts compute, Nx = E*C with --moe-pad-expert-input-to-capacity (C =
    ceil(cf*Tm*k/E)), else N; with ep > 1 the rows received, whose uniform expectation is Nx."""
    N = Tm * cfg.moe_router_topk
    if cfg.moe_pad_expert_input_to_capacity:
        return N, cfg.num_experts * math.ceil(cfg.moe_expert_capacity_factor * N / cfg.num_experts)
    return N, N


def moe_terms(cfg, Tm, e, r, device="cuda", ep=1, weight_copies=False) -> dict:
    """Saved bytes of one MoE layer's MLP block beyond its norm, over the Tm tokens this rank routes
    (T/t* : each tp rank routes its own under --sequence-parallel), by named term (module
    docstring). The experts run in the tokens' dtype r (autocast has no rule for the grouped
    GEMM)."""
    H, E, Fm = cfg.hidden_size, cfg.num_experts, cfg.moe_ffn_hidden_size
    p = router_prob_bytes(cfg, e, r, device)
    N, Nx = expert_rows(cfg, Tm)
    autocast = e != r
    terms = _router_terms(cfg, Tm, e, r, device)
    indices = 3 * N * 8                       # permutation [N] + row -> token [N] twice, int64
    if cfg.moe_pad_expert_input_to_capacity:
        indices += N * 8                      # each row's slot in the padded [E*C, H] buffer
    if ep > 1:
        indices += 2 * Nx * 8                 # the received rows' regroup order and its inverse
    terms.update({
        "expert_input": Nx * H * r,                      # the first grouped GEMM's input [Nx, H]
        "expert_act": Nx * 4 * Fm * r + E // ep * 4,     # [Nx, 2Fm], silu, fc2 input; offsets
        "combine": N * H * (4 + r) + N * p,              # fp32 output, weighted rows, weights
        "token_indices": indices,
        "shared_expert": _shared_expert_bytes(cfg, Tm, e, r, autocast),
    })
    if weight_copies:       # the router's and shared expert's linears (the experts keep no copy)
        Fs = cfg.moe_shared_expert_intermediate_size or 0
        terms["w_moe"] = (E * H + 3 * H * Fs + (H if cfg.moe_shared_expert_gate else 0)) * e
    return terms


def _shared_expert_bytes(cfg, Tm, e, r, autocast) -> float:
    """The shared expert (a dense SwiGLU of Fs over the Tm tokens; models/moe.py SharedExpertMLP):
    fc1 output [Tm, 2Fs] + silu + fc2 input = Tm*4*Fs*e, + its input (autocast's bf16 copy Tm*H*e;
    without autocast the tokens themselves, shared with router_input when r = 4); the gate
    (--moe-shared-expert-gate) + its input's copy (autocast) + sigmoid Tm*e + the output Tm*H*e."""
    Fs, H = cfg.moe_shared_expert_intermediate_size, cfg.hidden_size
    if not Fs:
        return 0.0
    shared = Tm * 4 * Fs * e + (Tm * H * e if autocast else 0 if r == 4 else Tm * H * r)
    if cfg.moe_shared_expert_gate:
        shared += (Tm * H * e if autocast else 0) + Tm * e + Tm * H * e
    return shared


def check_moe_layout(cfg, tp: int, seqpar: bool, ep: int) -> None:
    """Refuse (ValueError) what our MoE layers cannot run: tp > 1 without --sequence-parallel,
    an ep that does not divide the experts, ep > 1 on a dense model."""
    if not is_moe(cfg):
        if ep != 1:
            raise ValueError(f"--expert-model-parallel-size {ep} needs a mixture-of-experts model "
                             f"(num_experts): use 1 for this dense model.")
        return
    if tp > 1 and not seqpar:
        raise ValueError(f"num_experts={cfg.num_experts} with tp={tp} needs --sequence-parallel "
                         f"(sequence_parallel=True): each tp rank routes its own tokens.")
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or cfg.num_experts % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide num_experts="
                         f"{cfg.num_experts}: choose one of {divisors(cfg.num_experts)}.")


def moe_backward_bytes(cfg, Tm, e, r, device="cuda", ep=1) -> float:
    """The most one MoE layer's MLP backward holds beyond its saved tensors and the residual
    gradient, over Tm tokens (N routed rows, Nx at the experts: expert_rows; El = E/ep local
    experts; measured on CPU with LiveTensorPeak, tests/unit/test_planner_moe.py), the largest of
    its phases in backward order:
      shared    the shared expert's, a dense SwiGLU of Fs: at most its fc1 output's gradient
                [Tm, 2Fs] e (its saved activations are freed as their gradients form); then all
                its saved tensors are freed (_shared_expert_bytes) and its tokens' gradient
                (Tm*H*r) stays
      combine   unpermute's backward: index_add frees the weighted rows and gives their gradient
                [N, H] r, whose product with the weights and with the fp32 expert output makes
                two [N, H] fp32 (+ its fp32 cast with 16-bit rows):     N*H*(8 (+4))
      experts   unpermute's saved tensors freed (N*H*(4 + r) + N*p + 2*N*8), + the largest of
                the second GEMM's backward (the expert output's gradient [Nx, H], w2's El*H*Fm
                and its input's [Nx, Fm]), the SwiGLU's (the product's, silu's and up's gradients,
                its saved product freed: 2 [Nx, Fm]) and the first GEMM's (h's gradient [Nx, 2Fm],
                its input's [Nx, H], w1's El*2*Fm*H with w2's still held: their transposes'
                backward runs after it; the SwiGLU's saved 4 [Nx, Fm] freed), all in r."""
    H, Fm, El = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_experts // ep
    N, Nx = expert_rows(cfg, Tm)
    Fs = cfg.moe_shared_expert_intermediate_size or 0
    shared = Tm * 2 * Fs * e
    after_shared = Tm * H * r - _shared_expert_bytes(cfg, Tm, e, r, e != r) if Fs else 0
    combine = after_shared + N * H * (8 + (4 if r != 4 else 0))
    freed = N * H * (4 + r) + N * router_prob_bytes(cfg, e, r, device) + 2 * N * 8
    gemm2 = Nx * H + El * H * Fm + Nx * Fm
    swiglu = 2 * Nx * Fm
    gemm1 = Nx * 2 * Fm + Nx * H + El * 3 * Fm * H - Nx * 4 * Fm
    experts = after_shared - freed + max(gemm2, swiglu, gemm1) * r
    return max(shared, combine, experts)
