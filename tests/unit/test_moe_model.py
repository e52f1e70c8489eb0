"""GPTModel with experts on one rank (issue 37): the MoE fields of GPTConfig, the router losses'
gradient through the auxiliary-loss scaler, the parameter count, Megatron's FLOPs on the active
width, and what is refused."""
import pytest
import torch

from megatron_sp.models import GPTModel, preset
from megatron_sp.models.init import init_parameters
from megatron_sp.models.moe import MoELayer, MoEMLP
from megatron_sp.training.flops import active_ffn_hidden_size, flops_for_config

MOE = dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2,
           ffn_hidden_size=128, vocab_size=256, num_experts=4, moe_ffn_hidden_size=32,
           moe_router_topk=2, moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1)


def test_config_fields_layers_and_parameter_count():
    cfg = preset("llama-tiny", **MOE, moe_layer_freq=2, moe_shared_expert_intermediate_size=48)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    listed = preset("llama-tiny", **{**MOE, "moe_layer_freq": [0, 1, 1, 0]})
    assert [listed.is_moe_layer(i) for i in range(4)] == [False, True, True, False]
    model = GPTModel(cfg)
    kinds = [type(layer.mlp).__name__ for layer in model.layers.values()]
    assert kinds == ["MoEMLP", "MLP", "MoEMLP", "MLP"]
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())   # vocab 256: no pad
    assert cfg.moe_config().moe_shared_expert_intermediate_size == 48
    assert preset("llama-tiny", **{**MOE, "moe_ffn_hidden_size": None}).moe_ffn_hidden_size == 128
    # Megatron's FLOPs on the active width: 2 MoE layers of 2 x 32 + 48, 2 dense of 128
    assert active_ffn_hidden_size(cfg) == (2 * (2 * 32 + 48) + 2 * 128) / 4
    # ... so its FLOPs are those of the dense model of MLP width 120 (the same attention)
    dense = preset("llama-tiny", **{**MOE, "num_experts": None, "ffn_hidden_size": 120})
    assert flops_for_config(cfg, 1, 64) == pytest.approx(flops_for_config(dense, 1, 64))


@pytest.mark.parametrize("bad,message", [
    (dict(activation="gelu"), "needs SwiGLU experts"),
    (dict(moe_layer_freq=[1, 0]), "give 0 or 1 for each of the 4 layers"),
    (dict(moe_layer_freq=0), "must be a positive integer or a list"),
    (dict(moe_router_topk=5), "exceeds num_experts=4"),
    (dict(moe_router_score_function="tanh"), "is not one of"),
])
def test_bad_moe_fields_are_one_sentence(bad, message):
    with pytest.raises(ValueError, match=message) as err:
        preset("llama-tiny", **{**MOE, **bad})
    assert "\n" not in str(err.value) and str(err.value).endswith(".")


def test_moe_with_tensor_parallelism_needs_sequence_parallel():
    cfg = preset("llama-tiny", **MOE)
    for tp, sp in ((2, 1), (2, 2)):
        with pytest.raises(ValueError, match=rf"num_experts=4 with tp={tp} needs "
                                             r"--sequence-parallel") as err:
            cfg.check_parallel(tp=tp, sp=sp)
        message = str(err.value)
        assert "\n" not in message and message.endswith(".") and ". " not in message, message
    cfg.check_parallel(tp=2, sp=2, sequence_parallel=True)    # Megatron's layout: accepted
    cfg.check_parallel(tp=1, sp=4)                              # no tp: nothing to shard


def test_planner_plans_moe():
    """The planner models MoE layers (tests/unit/test_planner_moe.py): a one-GPU plan, on the
    active parameters."""
    from megatron_sp.memory.planner import Hardware, Workload, plan
    cfg = preset("llama-tiny", **MOE)
    plans = plan(cfg, Workload(seq=64), Hardware(num_gpus=1))
    assert plans and plans[0].ep == 1
    assert plans[0].active_parameters == cfg.num_active_parameters() < cfg.num_parameters()


def test_router_losses_reach_the_router_through_the_scaler():
    """MoEMLP's output carries the router losses' gradient (x aux_loss_scale) without changing the
    value: its gradients equal those of MoELayer with scale x (load-balancing + z) added to the
    loss (fp32, 1e-6 of the largest entry), and scale 0 leaves the language-model loss alone."""
    cfg = preset("llama-tiny", **MOE).moe_config()
    gen = torch.Generator().manual_seed(torch.initial_seed() % 2**31)
    x = torch.randn(2, 16, 64, generator=gen)
    w = torch.randn(2, 16, 64, generator=gen)
    for scale in (1.0, 0.25, 0.0):
        torch.manual_seed(3)
        plain = MoELayer(cfg, 64)
        torch.manual_seed(3)
        scaled = MoEMLP(cfg, 64)
        scaled.aux_loss_scale = scale
        y, aux = plain(x)
        ((y * w).sum() + scale * (aux["load_balancing_loss"] + aux["z_loss"])).backward()
        out = scaled(x)
        assert torch.equal(out, y.detach())
        (out * w).sum().backward()
        for (name, a), b in zip(plain.named_parameters(), scaled.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=0,
                                       atol=1e-6 * a.grad.abs().max().item(), msg=name)
        assert scaled.last_aux["load_balancing_loss"] > 0 and scaled.last_aux["z_loss"] > 0


def test_model_reports_its_router_losses_and_trains():
    cfg = preset("llama-tiny", **MOE)
    model = GPTModel(cfg)
    init_parameters(model, seed=1)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids, labels=ids).mean().backward()
    losses = model.moe_router_losses()
    assert set(losses) == {"load_balancing_loss", "z_loss"} and all(v > 0 for v in losses.values())
    for mlp in model.moe_layers():
        assert mlp.router.weight.grad.abs().sum() > 0 and mlp.experts.w1.grad.abs().sum() > 0


def test_bench_moe_runs_and_agrees_with_hf():
    """bench/moe.py at a toy size: ours (grouped mm and loop) against HF's block, outputs within
    1e-5 (fp32), one row per implementation with a positive time."""
    from megatron_sp.testing import load_script
    rows = load_script("bench/moe.py").main(["--tokens", "64", "--hidden", "32", "--ffn", "16",
                                              "--experts", "4", "--topk", "2", "--reps", "1",
                                              "--no-write"])
    assert [r["impl"] for r in rows] == ["HF Qwen3MoeSparseMoeBlock", "ours, grouped mm",
                                         "ours, per-expert loop"]
    assert all(r["ms"] > 0 and r["max_abs_diff"] <= 1e-5 for r in rows), rows


def test_printed_flags_rebuild_the_moe_config(monkeypatch):
    """config_to_flags (what convert.py prints, what --use-checkpoint-args applies) read back by
    pretrain_gpt.py give the same GPTConfig, router and router-loss fields included."""
    from megatron_sp.cli.model_flags import config_to_flags
    from megatron_sp.testing import load_script
    pretrain_gpt = load_script("pretrain_gpt.py")
    cfg = preset("llama-tiny", **{**MOE, "moe_layer_freq": [1, 0, 1, 1], "moe_router_topk": 3,
                                  "moe_router_score_function": "sigmoid",
                                  "moe_router_load_balancing_type": "seq_aux_loss",
                                  "moe_router_topk_scaling_factor": 2.5,
                                  "moe_expert_capacity_factor": 1.25,
                                  "moe_shared_expert_intermediate_size": 48})
    monkeypatch.setenv("WORLD_SIZE", "1")
    job, _ = pretrain_gpt.load_job([*config_to_flags(cfg), "--vocab-size", "256", "--mock-data",
                                    "--seq-length", "32"])
    rebuilt = pretrain_gpt.model_config(job, 256)
    moe_fields = [f for f in cfg.to_dict() if f.startswith("moe_") or f == "num_experts"]
    assert {f: getattr(rebuilt, f) for f in moe_fields} == {f: getattr(cfg, f) for f in moe_fields}


@pytest.mark.parametrize("etp,words", [
    (2, "--expert-tensor-parallel-size 2 must be 1 or --tensor-model-parallel-size 1"),
])
def test_expert_tensor_parallel_refusals_are_one_sentence(etp, words):
    from megatron_sp.mesh import LayoutError, ParallelMesh
    from megatron_sp.models import GPTModel
    with pytest.raises(LayoutError) as err:
        GPTModel(preset("llama-tiny", **MOE), ParallelMesh.single(), expert_tensor_parallel_size=etp)
    message = str(err.value)
    assert words in message and message.endswith(".") and ". " not in message, message
    assert GPTModel(preset("llama-tiny", **MOE), ParallelMesh.single(),
                    expert_tensor_parallel_size=1).moe_layers()[0].expert_tp_group is None
