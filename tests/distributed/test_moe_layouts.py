"""A mixture-of-experts GPTModel (models/moe.py MoEMLP layers; issue 37) trained in parallel
layouts against the same model on one rank, 4 gloo ranks, one spawn (layout_utils: 3 optimizer
steps, loss 1e-5 relative, every gradient 1e-4, router and experts included).

Each rank routes its own tokens; without expert parallelism every layer holds all experts, with it
(model_kwargs expert_parallel_size) E/ep, the rows dispatched by all-to-all over the ep group. The
router losses are those of whole sequences: their statistics are summed over the context ranks
(sp x cp) before they are combined (megatron_sp/moe/comm.py), and they are averaged over
micro-batches and data-parallel replicas through the scale the trainer sets. The Switch loss of a
micro-batch is not linear in its sequences, so the layouts with data parallelism or several
micro-batches use the per-sequence loss (seq_aux_loss), whose mean is; the z-loss is linear. Cases:
sp 4 (aux_loss + z-loss, every layer MoE), sp 2 x cp 2 with packed documents (aux_loss, a shared
expert, MoE every other layer), sp 2 x dp 2 (seq_aux_loss), pp 2 x sp 2 with 4 micro-batches
(seq_aux_loss, sigmoid scores), ep 2 x sp 2 (dp 2, seq_aux_loss), ep 4 x sp 4, ep 2 over dp 2 x sp 2
with packed documents (a shared expert, every other layer), ep 4 over sp 2 x cp 2 packed (ring ranks
hold different experts), ep 2 x pp 2 x sp 2, ep 2 x sp 2 under full recompute (the dispatch
all-to-alls replayed in backward), and the router losses' statistics all-reduce and the
dispatcher's row all-to-alls counted exactly (the ep / edp groups checked against the mesh's rank
arithmetic on the way). Capacity dropping under ep (ep 2, and ep 4 padded to capacity) against ep 1
in the same layout: dropping is per rank's tokens, as Megatron's (see _capacity_under_ep).
"""
import pytest
import torch

from megatron_sp import comm_stats
from megatron_sp.memory import MemoryOptions
from megatron_sp.moe import COMM_KIND
from megatron_sp.testing import run_distributed

from layout_utils import check_layouts

MOE = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
           ffn_hidden_size=128, vocab_size=300, num_experts=4, moe_ffn_hidden_size=32,
           moe_router_topk=2, moe_aux_loss_coeff=1.0, moe_z_loss_coeff=0.1)   # large: router gradients


def _case(name, overrides=None, **layout):
    return dict(model="llama-tiny", name=name, overrides={**MOE, **(overrides or {})},
                seq=32, global_batch=4, steps=3, **layout)


def _statistics_bytes():
    """One forward + backward of a 2-layer MoE model at sp 4 on rank tokens: the statistics
    all-reduce runs once per MoE layer and loss in forward (none in backward), E + E + 1 fp32
    values for the Switch loss and 2 for the z-loss, in the ring all-reduce's bytes."""
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import GPTModel, preset
    from megatron_sp.models.init import init_parameters
    mesh = ParallelMesh.from_sizes(sp=4)
    model = GPTModel(preset("llama-tiny", **MOE), mesh)
    init_parameters(model, seed=3)
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(5))
    comm_stats.reset()
    model(input_ids=ids, labels=ids).sum().backward()
    calls = comm_stats.calls().get(COMM_KIND, 0)
    nbytes = comm_stats.snapshot().get(COMM_KIND, 0)
    per_layer = [2 * 3 * (4 + 4 + 1) * 4 // 4, 2 * 3 * 2 * 4 // 4]    # 2 (p-1)/p x numel x 4
    return calls, nbytes, 2 * sum(per_layer)


def _dispatch_bytes():
    """One forward + backward at sp 2 x dp 2 with ep 2: the dispatcher's row all-to-alls send, per
    MoE layer, the formula's bytes (megatron_sp.moe.dispatch_bytes) from every ep rank's tokens per
    expert, gathered after the step."""
    import torch.distributed as dist
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import GPTModel, preset
    from megatron_sp.models.init import init_parameters
    from megatron_sp.moe import DISPATCH_KIND, dispatch_bytes
    mesh = ParallelMesh.from_sizes(sp=2)
    model = GPTModel(preset("llama-tiny", **MOE), mesh, expert_parallel_size=2)
    init_parameters(model, seed=3)
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(5 + mesh.dp_rank))
    comm_stats.reset()
    model(input_ids=ids, labels=ids).sum().backward()
    calls = comm_stats.calls().get(DISPATCH_KIND, 0)
    nbytes = comm_stats.snapshot().get(DISPATCH_KIND, 0)
    groups = mesh.expert_groups(2)
    ep_ranks, edp_ranks = mesh.dims.expert_ranks(2, mesh.rank)    # the DeviceMesh's groups
    assert dist.get_process_group_ranks(groups.ep_group) == ep_ranks, ep_ranks
    assert dist.get_process_group_ranks(groups.edp_group) == edp_ranks, edp_ranks
    expected = 0
    for mlp in model.moe_layers():
        mine = mlp.last_aux["tokens_per_expert"]                          # [E]
        counts = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(counts, mine, group=groups.ep_group)
        expected += dispatch_bytes(torch.stack(counts), groups.ep_rank, 64, 4)
    return calls, nbytes, expected


def _capacity_under_ep():
    """Capacity dropping (factor 0.5: tokens are dropped) is that of each rank's own tokens, before
    any dispatch, so at dp 2 x sp 2 the runs with ep 2 and with ep 4 plus padding to capacity
    train exactly as ep 1 (the same layout: the one-rank model would drop among all tokens).
    Returns the comparisons and the assignments kept / routed in the last forward of ep 1."""
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import preset
    from layout_utils import compare, global_batches, train_layout
    cfg = preset("llama-tiny", **{**MOE, "moe_router_load_balancing_type": "seq_aux_loss",
                                  "moe_expert_capacity_factor": 0.5})
    padded = preset("llama-tiny", **{**MOE, "moe_router_load_balancing_type": "seq_aux_loss",
                                     "moe_expert_capacity_factor": 0.5,
                                     "moe_pad_expert_input_to_capacity": True})
    batches = global_batches(cfg.vocab_size, 32, 4, 3, seed=17)
    mesh = ParallelMesh.from_sizes(sp=2)
    ep1 = train_layout(mesh, cfg, batches, 2)
    results = [("capacity ep2 vs ep1",) + compare(ep1, train_layout(
                   mesh, cfg, batches, 2, model_kwargs={"expert_parallel_size": 2}), "ep2")]
    results.append(("capacity ep4 padded vs ep1",) + compare(ep1, train_layout(
        mesh, padded, batches, 2, model_kwargs={"expert_parallel_size": 4}), "ep4 padded"))
    from megatron_sp.models import GPTModel
    from megatron_sp.models.init import init_parameters
    model = GPTModel(cfg, mesh)
    init_parameters(model, seed=3)
    ids = batches[0]["tokens"][:2, mesh.sp_rank * 16:(mesh.sp_rank + 1) * 16]
    model(input_ids=ids, labels=ids)
    kept = sum(int(m.last_aux["tokens_per_expert"].sum()) for m in model.moe_layers())
    return results, kept, 2 * 2 * 16 * 2            # 2 layers x tokens (2 x 16) x topk


def _checks(rank, world):
    torch.set_num_threads(1)
    seq_aux = {"moe_router_load_balancing_type": "seq_aux_loss"}
    cases = [
        _case("moe sp4, aux + z loss", sp=4, micro_batch=4),
        _case("moe sp2 x cp2 packed, shared expert, every other layer",
              {"moe_shared_expert_intermediate_size": 48, "moe_layer_freq": 2},
              sp=2, cp=2, micro_batch=4, packed=True),
        _case("moe sp2 x dp2, seq aux loss", seq_aux, sp=2, micro_batch=2),
        _case("moe pp2 x sp2, 4 micro-batches, seq aux loss, sigmoid",
              {**seq_aux, "moe_router_score_function": "sigmoid"}, sp=2, pp=2, micro_batch=1,
              pipeline={}),
        _case("moe ep2 x sp2 (dp2), seq aux loss", seq_aux, sp=2, micro_batch=2,
              model_kwargs={"expert_parallel_size": 2}),
        _case("moe ep4 x sp4", sp=4, micro_batch=4, model_kwargs={"expert_parallel_size": 4}),
        _case("moe ep2 over dp2 x sp2 packed, shared expert, every other layer",
              {**seq_aux, "moe_shared_expert_intermediate_size": 48, "moe_layer_freq": 2},
              sp=2, micro_batch=1, packed=True, model_kwargs={"expert_parallel_size": 2}),
        _case("moe ep4 over sp2 x cp2 packed", sp=2, cp=2, micro_batch=4, packed=True,
              model_kwargs={"expert_parallel_size": 4}),
        _case("moe ep4 over dp2 x sp2, seq aux loss", seq_aux, sp=2, micro_batch=2,
              model_kwargs={"expert_parallel_size": 4}),
        _case("moe ep4 over dp4, seq aux loss", seq_aux, micro_batch=1,
              model_kwargs={"expert_parallel_size": 4}),
        _case("moe ep2 x pp2 x sp2, 4 micro-batches, seq aux loss", seq_aux, sp=2, pp=2,
              micro_batch=1, pipeline={}, model_kwargs={"expert_parallel_size": 2}),
        _case("moe ep2 x sp2 (dp2), full recompute, seq aux loss", seq_aux, sp=2, micro_batch=2,
              model_kwargs={"expert_parallel_size": 2,
                            "memory": MemoryOptions(recompute_granularity="full")}),
    ]
    return {"model": check_layouts(rank, world, cases), "stats": _statistics_bytes(),
            "dispatch": _dispatch_bytes(), "capacity": _capacity_under_ep()}


@pytest.mark.timeout(400)
def test_moe_layouts_match_one_rank():
    results = run_distributed(_checks, 4)
    for r in results:
        calls, nbytes, expected = r["stats"]
        assert calls == 4 and nbytes == expected, r["stats"]
        calls, nbytes, expected = r["dispatch"]
        assert calls == 2 * 2 * 2 and nbytes == expected > 0, r["dispatch"]   # 2 layers x 2 x fwd+bwd
    capacity, kept, routed = results[0]["capacity"]
    assert 0 < kept < routed, (kept, routed)          # tokens were dropped
    for name, loss, grad in results[0]["model"] + capacity:
        print(f"{name}: loss rel {loss:.1e}, grad {grad:.1e}")
