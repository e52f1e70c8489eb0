"""GPTModel with experts under activation recompute on one rank: full (uniform and block) and
selective recompute give the losses and gradients of the same model without recompute, over
several optimizer steps, from a fresh process's state (the grouped-GEMM probe not yet run, so it
runs inside the first checkpointed forward, as in a real run)."""
import pytest
import torch

from megatron_sp.memory import MemoryOptions
from megatron_sp.models import GPTModel, preset
from megatron_sp.models import moe as moe_module
from megatron_sp.models.init import init_parameters

MOE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
           ffn_hidden_size=64, vocab_size=128, num_experts=4, moe_ffn_hidden_size=32,
           moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
STEPS = 3


def train(memory: MemoryOptions, ids: torch.Tensor, monkeypatch, **overrides):
    """STEPS Adam steps of a fresh fp32 MoE model from the same init -> (losses, grads of the
    last step by name). The probe's cache is emptied first: its first run happens in forward."""
    monkeypatch.setattr(moe_module, "_GROUPED_MM_WORKS", {})
    torch.manual_seed(11)                                          # the same dropout masks
    model = GPTModel(preset("llama-tiny", **{**MOE, **overrides}), memory=memory)
    init_parameters(model, seed=7)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        batch = ids[step]                                          # [b, s]
        loss = model(input_ids=batch[:, :-1], labels=batch[:, 1:]).mean()
        loss.backward()
        losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return losses, grads


@pytest.mark.parametrize("memory", [
    MemoryOptions(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    MemoryOptions(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    MemoryOptions(recompute_granularity="selective"),
], ids=["full-uniform", "full-block", "selective"])
def test_moe_recompute_matches_no_recompute(memory, seed, monkeypatch):
    """Losses within 1e-5 and last-step gradients within 1e-4 (relative to each tensor's largest
    entry), fp32, with hidden dropout (the recompute must replay the forward's masks)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (STEPS, 2, 33), generator=gen)   # [steps, b, s+1]
    ref_losses, ref_grads = train(MemoryOptions(), ids, monkeypatch, hidden_dropout=0.1)
    losses, grads = train(memory, ids, monkeypatch, hidden_dropout=0.1)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    assert grads.keys() == ref_grads.keys() and any("experts" in n for n in grads)
    for name, ref in ref_grads.items():
        scale = ref.abs().max().clamp_min(1e-12)
        assert (grads[name] - ref).abs().max() / scale <= 1e-4, name


def test_grouped_mm_probe_leaves_no_trace_in_the_callers_hooks(monkeypatch):
    """The probe's saved tensors bypass an enclosing saved-tensor hook pair (a checkpoint's, an
    offload's, the memory accounting's) and it draws nothing from the global RNG."""
    monkeypatch.setattr(moe_module, "_GROUPED_MM_WORKS", {})
    packed = []
    before = torch.get_rng_state()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        moe_module._grouped_mm_probe(torch.device("cpu"), torch.float32)
    assert packed == [] and torch.equal(torch.get_rng_state(), before)
    assert (torch.device("cpu").type, torch.float32) in moe_module._GROUPED_MM_WORKS
