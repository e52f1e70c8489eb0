"""MoE layer on one rank (models/moe.py): equality with transformers' Mixtral and Qwen3-MoE sparse
blocks (outputs and gradients), the Switch aux loss against HF's load_balancing_loss_func, grouped
GEMM against the per-expert loop, permutation round trip, capacity dropping, config errors."""
import math

import pytest
import torch

from megatron_sp.models.moe import (GroupedExperts, MoEConfig, MoELayer, capacity_keep_mask,
                                    combine_aux_loss, expert_capacity, permute, seq_aux_loss,
                                    tokens_per_expert_of, topk_routing, unpermute, z_loss)

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.configuration_mixtral import MixtralConfig  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import (MixtralSparseMoeBlock,  # noqa: E402
                                                          load_balancing_loss_func)
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

OUT_TOL = 1e-5       # fp32 outputs, ours against HF's block
GRAD_TOL = 1e-4      # fp32 gradients (input, router, experts)
LOSS_TOL = 1e-6      # aux loss against HF's load_balancing_loss_func
PATH_TOL = 1e-5      # grouped mm against the per-expert loop, fp32

H, F, E, K = 16, 12, 6, 2     # H, F multiples of 4: fp32 rows 16-byte aligned for torch._grouped_mm


def switch_aux_loss(probs_all: torch.Tensor, tokens_per_expert: torch.Tensor, topk: int,
                    coeff: float) -> torch.Tensor:
    """The Switch Transformer / GShard load-balancing loss over probs_all [T, E] (the FULL softmax)
    and tokens_per_expert [E] (top-k assignments): coeff * E * sum_i f_i P_i, f_i normalised by T*k
    (the router's losses go through the same combine_aux_loss; this form is the tests' reference).

    HF's load_balancing_loss_func (Mixtral, Qwen3-MoE) normalises f_i by T alone, so its value is k
    times this one: HF's router_aux_loss_coef c matches moe_aux_loss_coeff = c * k.
    """
    n_tokens = torch.tensor(float(probs_all.shape[0]), device=probs_all.device)
    return combine_aux_loss(tokens_per_expert.float(), probs_all.float().sum(dim=0), n_tokens,
                            probs_all.shape[-1], topk, coeff)


def _fill_(module, gen, std=0.3):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def _hf_block(kind: str, norm_topk_prob: bool):
    if kind == "mixtral":
        cfg = MixtralConfig(hidden_size=H, intermediate_size=F, num_local_experts=E,
                            num_experts_per_tok=K, router_jitter_noise=0.0)
        return MixtralSparseMoeBlock(cfg)
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=F, num_experts=E,
                         num_experts_per_tok=K, norm_topk_prob=norm_topk_prob)
    return Qwen3MoeSparseMoeBlock(cfg)


def _ours_like(hf, kind: str, norm_topk_prob: bool, pre_softmax: bool, use_grouped_mm=None):
    cfg = MoEConfig(num_experts=E, moe_ffn_hidden_size=F, moe_router_topk=K,
                    moe_router_pre_softmax=pre_softmax, norm_topk_prob=norm_topk_prob)
    ours = MoELayer(cfg, H, use_grouped_mm=use_grouped_mm)
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)                  # [E, H]
        ours.experts.w1.copy_(hf.experts.gate_up_proj)            # [E, 2F, H], gate rows first
        ours.experts.w2.copy_(hf.experts.down_proj)               # [E, H, F]
    return ours


CASES = [  # (HF block, norm_topk_prob, moe_router_pre_softmax)
    ("mixtral", True, False),      # Megatron's default path (top-k of logits, softmax over k)
    ("mixtral", True, True),       # softmax over E, top-k, renormalise
    ("qwen3", True, True),
    ("qwen3", False, True),        # no renormalisation: weights sum to < 1
]


@pytest.mark.parametrize("use_grouped_mm", [None, False], ids=["auto", "loop"])
@pytest.mark.parametrize("kind,norm,pre_softmax", CASES)
def test_moe_layer_equals_hf_sparse_block(kind, norm, pre_softmax, use_grouped_mm, seed):
    gen = torch.Generator().manual_seed(seed)
    hf = _hf_block(kind, norm)
    _fill_(hf, gen)
    ours = _ours_like(hf, kind, norm, pre_softmax, use_grouped_mm)
    x = torch.randn(2, 7, H, generator=gen)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()

    y_hf = hf(x_hf)
    y_ours, aux = ours(x_ours)
    torch.testing.assert_close(y_ours, y_hf, rtol=OUT_TOL, atol=OUT_TOL)
    assert int(aux["tokens_per_expert"].sum()) == 2 * 7 * K
    assert float(aux["load_balancing_loss"]) == 0.0 and float(aux["z_loss"]) == 0.0

    grad = torch.randn(y_hf.shape, generator=gen)
    y_hf.backward(grad)
    y_ours.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, rtol=GRAD_TOL, atol=GRAD_TOL)
    pairs = [(ours.router.weight, hf.gate.weight), (ours.experts.w1, hf.experts.gate_up_proj),
             (ours.experts.w2, hf.experts.down_proj)]
    for mine, theirs in pairs:
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=GRAD_TOL, atol=GRAD_TOL)


def test_gated_shared_expert_equals_hf_qwen2_moe_block(seed):
    """--moe-shared-expert-gate: Qwen2MoeSparseMoeBlock's routed experts (softmax over all E, no
    renormalisation) plus sigmoid(x . g) * shared_expert(x); outputs and every gradient."""
    from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    gen = torch.Generator().manual_seed(seed)
    hf = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=F,
                                               num_experts=E, num_experts_per_tok=K,
                                               shared_expert_intermediate_size=8,
                                               norm_topk_prob=False))
    _fill_(hf, gen)
    cfg = MoEConfig(num_experts=E, moe_ffn_hidden_size=F, moe_router_topk=K,
                    moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=8,
                    moe_shared_expert_gate=True)
    ours = MoELayer(cfg, H)
    shared = hf.shared_expert
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        ours.experts.w1.copy_(hf.experts.gate_up_proj)
        ours.experts.w2.copy_(hf.experts.down_proj)
        ours.shared_expert.fc1.weight.copy_(torch.cat([shared.gate_proj.weight,
                                                       shared.up_proj.weight]))   # [2Fs, H]
        ours.shared_expert.fc2.weight.copy_(shared.down_proj.weight)
        ours.shared_expert.gate.weight.copy_(hf.shared_expert_gate.weight)       # [1, H]
    x = torch.randn(2, 7, H, generator=gen)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_hf, (y_ours, _) = hf(x_hf), ours(x_ours)
    torch.testing.assert_close(y_ours, y_hf, rtol=OUT_TOL, atol=OUT_TOL)
    grad = torch.randn(y_hf.shape, generator=gen)
    y_hf.backward(grad)
    y_ours.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, rtol=GRAD_TOL, atol=GRAD_TOL)
    gate_up = torch.cat([shared.gate_proj.weight.grad, shared.up_proj.weight.grad])
    for mine, theirs in ((ours.shared_expert.gate.weight, hf.shared_expert_gate.weight.grad),
                         (ours.shared_expert.fc1.weight, gate_up),
                         (ours.shared_expert.fc2.weight, shared.down_proj.weight.grad),
                         (ours.router.weight, hf.gate.weight.grad)):
        torch.testing.assert_close(mine.grad, theirs, rtol=GRAD_TOL, atol=GRAD_TOL)


def test_switch_aux_loss_equals_hf_load_balancing_loss(seed):
    """HF normalises the token fraction by T (not T*k): its value is k times Megatron's."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(37, E, generator=gen) * 2.0              # one sequence, no attention mask
    probs_all = torch.softmax(logits, dim=-1)
    _, indices = torch.topk(logits, K, dim=-1)
    ours = switch_aux_loss(probs_all, tokens_per_expert_of(indices, E), K, coeff=1.0)
    theirs = load_balancing_loss_func((logits,), num_experts=E, top_k=K)
    torch.testing.assert_close(ours * K, theirs, rtol=LOSS_TOL, atol=LOSS_TOL)
    # uniform routing and probabilities give the loss's minimum, coeff
    torch.testing.assert_close(
        switch_aux_loss(torch.full((E, E), 1.0 / E), torch.full((E,), K), K, coeff=0.5),
        torch.tensor(0.5), rtol=LOSS_TOL, atol=LOSS_TOL)


def test_seq_aux_loss_is_mean_of_per_sequence_switch_losses(seed):
    gen = torch.Generator().manual_seed(seed)
    b, s = 3, 11
    logits = torch.randn(b * s, E, generator=gen)
    probs_all = torch.softmax(logits, dim=-1)
    _, indices = torch.topk(logits, K, dim=-1)
    per_seq = [switch_aux_loss(p, tokens_per_expert_of(i, E), K, coeff=0.1)
               for p, i in zip(probs_all.view(b, s, E), indices.view(b, s, K))]
    torch.testing.assert_close(seq_aux_loss(probs_all, indices, b, coeff=0.1),
                               torch.stack(per_seq).mean(), rtol=LOSS_TOL, atol=LOSS_TOL)
    expected_z = 0.01 * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(z_loss(logits, 0.01), expected_z, rtol=LOSS_TOL, atol=LOSS_TOL)


def test_layer_reports_losses_when_enabled(seed):
    gen = torch.Generator().manual_seed(seed)
    cfg = MoEConfig(num_experts=E, moe_ffn_hidden_size=F, moe_router_topk=K, moe_aux_loss_coeff=0.01,
                    moe_z_loss_coeff=0.001, moe_shared_expert_intermediate_size=8)
    layer = MoELayer(cfg, H)
    _fill_(layer, gen)
    x = torch.randn(2, 5, H, generator=gen)
    y, aux = layer(x)
    logits = x.reshape(-1, H) @ layer.router.weight.T               # [T, E]
    _, indices = torch.topk(logits, K, dim=-1)
    expected = switch_aux_loss(torch.softmax(logits, -1), tokens_per_expert_of(indices, E), K, 0.01)
    torch.testing.assert_close(aux["load_balancing_loss"], expected, rtol=LOSS_TOL, atol=LOSS_TOL)
    torch.testing.assert_close(aux["z_loss"], z_loss(logits, 0.001), rtol=LOSS_TOL, atol=LOSS_TOL)
    (y.square().sum() + aux["load_balancing_loss"] + aux["z_loss"]).backward()
    assert layer.router.weight.grad is not None and layer.shared_expert.fc1.weight.grad is not None
    # the shared expert is added unscaled: removing it leaves the routed output
    y_routed = y - layer.shared_expert(x.reshape(-1, H)).view_as(y)
    layer.shared_expert = None
    torch.testing.assert_close(layer(x)[0], y_routed, rtol=OUT_TOL, atol=OUT_TOL)


def test_grouped_mm_probe_ignores_the_callers_grad_mode(monkeypatch):
    """The probe's verdict does not depend on the mode of the first MoE forward: under no_grad and
    inference_mode (an evaluation, a conversion check) it is the same as with autograd on, so a
    process whose first forward is an evaluation still trains with the grouped GEMM."""
    from megatron_sp.models import moe
    verdicts = {}
    for mode, ctx in (("grad", torch.enable_grad), ("no_grad", torch.no_grad),
                      ("inference", torch.inference_mode)):
        monkeypatch.setattr(moe, "_GROUPED_MM_WORKS", {})
        with ctx():
            verdicts[mode] = moe._grouped_mm_probe(torch.device("cpu"), torch.float32)
    assert verdicts["no_grad"] == verdicts["inference"] == verdicts["grad"], verdicts
    if torch.__version__ >= (2, 13):        # seen: torch 2.13's CPU grouped GEMM in fp32
        assert verdicts["grad"]


def test_grouped_mm_equals_loop_with_idle_experts(seed):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    gen = torch.Generator().manual_seed(seed)
    experts = GroupedExperts(E, H, F, use_grouped_mm=True)
    experts.reset_parameters(std=0.3, generator=gen)
    tokens_per_expert = torch.tensor([3, 0, 5, 0, 1, 4])          # experts 1 and 3 get no token
    x = torch.randn(int(tokens_per_expert.sum()), H, generator=gen)
    outs, grads = [], []
    for path in (experts.forward_grouped, experts.forward_loop):
        experts.zero_grad()
        xi = x.clone().requires_grad_()
        out = path(xi, tokens_per_expert)
        out.sum().backward()                                      # expanded grad: stride 0
        outs.append(out)
        grads.append((xi.grad, experts.w1.grad.clone(), experts.w2.grad.clone()))
    torch.testing.assert_close(outs[0], outs[1], rtol=PATH_TOL, atol=PATH_TOL)
    for g_grouped, g_loop in zip(*grads):
        torch.testing.assert_close(g_grouped, g_loop, rtol=PATH_TOL, atol=PATH_TOL)
    assert grads[0][1][1].abs().max() == 0 and grads[0][2][3].abs().max() == 0   # idle: zero grad


def test_permute_unpermute_round_trip(seed):
    gen = torch.Generator().manual_seed(seed)
    T, k = 9, 3
    hidden = torch.randn(T, H, generator=gen)
    indices = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])   # [T, k]
    probs = torch.rand(T, k, generator=gen)
    permuted, tokens_per_expert, order = permute(hidden, indices, E)
    assert permuted.shape == (T * k, H)
    assert tokens_per_expert.dtype == torch.int64
    assert torch.equal(tokens_per_expert, torch.bincount(indices.reshape(-1), minlength=E))
    # rows are expert-major: the expert of each row never decreases
    row_expert = indices.reshape(-1)[order]
    assert torch.all(row_expert[1:] >= row_expert[:-1])
    assert torch.equal(permuted, hidden[order // k])
    # identity experts: each token comes back as (sum of its weights) * x
    out = unpermute(permuted, probs, order, T)
    torch.testing.assert_close(out, probs.sum(-1, keepdim=True) * hidden, rtol=1e-6, atol=1e-6)


def test_capacity_drops_lowest_probability_assignments(seed):
    gen = torch.Generator().manual_seed(seed)
    T, cf = 40, 0.5
    cfg = MoEConfig(num_experts=E, moe_ffn_hidden_size=F, moe_router_topk=K,
                    moe_expert_capacity_factor=cf)
    logits = torch.randn(T, E, generator=gen)
    logits[:, 0] += 2.0                                           # overload expert 0
    probs, indices = topk_routing(logits, cfg)
    capacity = expert_capacity(T, K, E, cf)
    assert capacity == math.ceil(cf * T * K / E)
    keep = capacity_keep_mask(probs, indices, E, capacity)
    overloaded = 0
    for e in range(E):
        routed = indices == e                                     # [T, k]
        kept, dropped = probs[routed & keep], probs[routed & ~keep]
        assert kept.numel() == min(capacity, int(routed.sum()))
        if dropped.numel():
            overloaded += 1
            assert dropped.max() <= kept.min()                    # the lowest ones went
    assert overloaded >= 1

    # The layer computes only the kept assignments, and dropped ones contribute nothing.
    layer = MoELayer(cfg, H)
    x = torch.randn(1, T, H, generator=gen)
    probs, indices, _ = layer.router(x.reshape(T, H))
    keep = capacity_keep_mask(probs, indices, E, capacity)
    y, aux = layer(x)
    assert torch.all(aux["tokens_per_expert"] <= capacity)
    assert int(aux["tokens_per_expert"].sum()) == int(keep.sum())
    expected = torch.zeros(T, H)
    for t in range(T):
        for j in range(K):
            if keep[t, j]:
                e = int(indices[t, j])
                out = layer.experts.forward_loop(x[0, t:t + 1], torch.eye(E, dtype=torch.int64)[e])
                expected[t] += probs[t, j] * out[0]
    torch.testing.assert_close(y[0], expected, rtol=OUT_TOL, atol=OUT_TOL)


@pytest.mark.parametrize("grouped", [False, None])
def test_padding_to_capacity_changes_shapes_not_values(seed, grouped):
    """--moe-pad-expert-input-to-capacity: every expert runs on exactly `capacity` rows (its kept
    ones, then zero rows), and the output and every gradient equal the unpadded layer's (1e-6)."""
    gen = torch.Generator().manual_seed(seed)
    T, cf = 24, 0.75
    kwargs = dict(num_experts=E, moe_ffn_hidden_size=F, moe_router_topk=K,
                  moe_expert_capacity_factor=cf)
    plain = MoELayer(MoEConfig(**kwargs), H, use_grouped_mm=grouped)
    padded = MoELayer(MoEConfig(**kwargs, moe_pad_expert_input_to_capacity=True), H,
                      use_grouped_mm=grouped)
    padded.load_state_dict(plain.state_dict())
    seen = []
    real_forward = padded.experts.forward
    padded.experts.forward = lambda rows, counts: (seen.append((rows.shape[0], counts.tolist())),
                                                   real_forward(rows, counts))[1]
    x = torch.randn(2, T // 2, H, generator=gen)
    x0, x1 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y0, _ = plain(x0)
    y1, _ = padded(x1)
    capacity = expert_capacity(T, K, E, cf)
    assert seen == [(E * capacity, [capacity] * E)]
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    g = torch.randn(y0.shape, generator=gen)
    (y0 * g).sum().backward()
    (y1 * g).sum().backward()
    torch.testing.assert_close(x1.grad, x0.grad, rtol=1e-6, atol=1e-6)
    for (name, p0), p1 in zip(plain.named_parameters(), padded.parameters()):
        torch.testing.assert_close(p1.grad, p0.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_sigmoid_and_scaling_routing(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(10, E, generator=gen)
    cfg = MoEConfig(num_experts=E, moe_ffn_hidden_size=F, moe_router_topk=3,
                    moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5)
    probs, indices = topk_routing(logits, cfg)
    top = torch.sigmoid(logits).gather(1, indices)
    torch.testing.assert_close(probs, 2.5 * top / top.sum(-1, keepdim=True), rtol=1e-6, atol=1e-6)
    assert torch.equal(indices, torch.topk(logits, 3, dim=-1).indices)


BAD_CONFIGS = [
    (dict(moe_router_topk=E + 1), "exceeds num_experts"),
    (dict(moe_router_score_function="relu"), "moe_router_score_function"),
    (dict(moe_expert_capacity_factor=0.0), "moe_expert_capacity_factor"),
    (dict(moe_expert_capacity_factor=-1.0), "moe_expert_capacity_factor"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type"),
    (dict(num_experts=0), "num_experts"),
    (dict(moe_pad_expert_input_to_capacity=True), "needs moe_expert_capacity_factor"),
]


@pytest.mark.parametrize("overrides,phrase", BAD_CONFIGS)
def test_bad_config_raises_one_sentence(overrides, phrase):
    kwargs = dict(num_experts=E, moe_ffn_hidden_size=F, moe_router_topk=K)
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=phrase) as info:
        MoEConfig(**kwargs)
    message = str(info.value)
    assert message.endswith(".") and message.count(". ") == 0 and "\n" not in message
