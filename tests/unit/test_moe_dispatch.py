"""Expert parallelism on one process (no process group): the dispatcher's regrouping of received
rows from (source, local expert) order to local-expert order and back, its byte formula, the
expert-parallel parameters' initialisation from the full tensor, and what is refused."""
import pytest
import torch

from megatron_sp.checkpointing.format import model_state
from megatron_sp.mesh import LayoutError, ParallelMesh
from megatron_sp.models import GPTModel, preset
from megatron_sp.models.init import init_parameters
from megatron_sp.moe.dispatch import dispatch_bytes, regroup_order

MOE = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
           ffn_hidden_size=128, vocab_size=256, num_experts=4, moe_ffn_hidden_size=32,
           moe_router_topk=2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regroup_orders_rows_by_local_expert_stably(seed):
    gen = torch.Generator().manual_seed(seed)
    ep, local = 3, 2
    received = torch.randint(0, 4, (ep, local), generator=gen)            # [source, local expert]
    received[1, 0] = 0                                                    # an empty block
    # Each row labelled (source, local expert, index within its block), in arrival order.
    labels = [(s, e, i) for s in range(ep) for e in range(local) for i in range(received[s, e])]
    order = regroup_order(received)
    regrouped = [labels[j] for j in order.tolist()]
    assert regrouped == sorted(labels, key=lambda t: (t[1], t[0], t[2]))  # expert, then source
    counts = received.sum(dim=0).tolist()                                 # local tokens_per_expert
    assert [sum(1 for t in regrouped if t[1] == e) for e in range(local)] == counts
    inverse = torch.argsort(order)
    assert [regrouped[j] for j in inverse.tolist()] == labels             # undone exactly


def test_regroup_with_no_rows():
    assert regroup_order(torch.zeros(2, 2, dtype=torch.int64)).numel() == 0


def test_dispatch_bytes_formula():
    # ep 2, E 4: rank 0 holds experts 0, 1; rank 1 holds 2, 3.
    counts = torch.tensor([[1, 2, 3, 4],      # source 0 sends 3 + 4 rows to rank 1
                           [5, 6, 7, 8]])     # source 1 sends 5 + 6 rows to rank 0
    assert dispatch_bytes(counts, 0, 64, 4) == 2 * (7 + 11) * 64 * 4
    assert dispatch_bytes(counts, 1, 64, 4, backward=False) == (11 + 7) * 64 * 4


def test_expert_parallel_parameters_are_rows_of_the_full_tensor():
    cfg = preset("llama-tiny", **MOE)
    full = GPTModel(cfg)
    init_parameters(full, seed=3)
    ep = 2
    for ep_rank in range(ep):
        model = GPTModel(cfg)
        for layer in model.layers.values():   # what MoELayer marks under ep (groups need ranks)
            experts = layer.mlp.experts
            for name in ("w1", "w2"):
                w = torch.nn.Parameter(getattr(experts, name).data[: cfg.num_experts // ep].clone())
                w.__dict__.update(vars(getattr(experts, name)))     # expert_stack, stored_parts
                w.expert_parallel, w.ep_rank, w.ep_size = True, ep_rank, ep
                setattr(experts, name, w)
        init_parameters(model, seed=3)
        ref = dict(full.named_parameters())
        for name, p in model.named_parameters():
            if getattr(p, "expert_parallel", False):
                rows = slice(ep_rank * 2, ep_rank * 2 + 2)
                assert torch.equal(p, ref[name][rows]), name
            else:
                assert torch.equal(p, ref[name]), name
        # Checkpoint geometry: this rank's rows of the full [E, ...] stack, at ep_rank * E/ep;
        # w1 as [E, 2, F, H] (gate, up), as the one-rank model stores it.
        stored, ref_stored = model_state([model], 0, 1), model_state([full], 0, 1)
        for name, p in model.named_parameters():
            shard = stored[f"model/{name}"]
            if getattr(p, "expert_parallel", False):
                want = ref_stored[f"model/{name}"]
                assert tuple(shard.global_shape) == tuple(want.global_shape), name
                assert tuple(want.global_shape) == ((4, 2, 32, 64) if name.endswith("w1")
                                                    else (4, 64, 32)), name
                assert shard.offsets[0] == ep_rank * 2 and set(shard.offsets[1:]) == {0}
                assert torch.equal(shard.local, want.local[ep_rank * 2:ep_rank * 2 + 2]), name
            else:
                assert tuple(shard.global_shape) == tuple(p.shape)


@pytest.mark.parametrize("overrides,ep,words", [
    ({}, 2, "does not divide the 1 ranks of a pipeline stage"),
    ({"num_experts": 6, "moe_router_topk": 2}, 4, "--num-experts 6 is not divisible by "
                                                   "--expert-model-parallel-size 4"),
    ({"num_experts": None}, 2, "needs a mixture-of-experts model"),
])
def test_refusals_are_one_sentence(overrides, ep, words):
    with pytest.raises(LayoutError) as err:
        GPTModel(preset("llama-tiny", **{**MOE, **overrides}), ParallelMesh.single(),
                 expert_parallel_size=ep)
    message = str(err.value)
    assert words in message and message.endswith(".") and ". " not in message, message


@pytest.mark.parametrize("dims,fits,ep,etp,words", [
    (dict(world_size=8, tp=2, sp=2), (4, 2), 8, 2, "--expert-model-parallel-size 8 x "
                                                   "--expert-tensor-parallel-size 2 does not "
                                                   "divide the 8 ranks of a pipeline stage"),
    (dict(world_size=8, tp=4), (2, 4), 2, 2, "--expert-tensor-parallel-size 2 must be 1 or "
                                             "--tensor-model-parallel-size 4"),
    (dict(world_size=6, tp=1), (3, 1), 4, 1, "--expert-model-parallel-size 4 does not divide the "
                                             "6 ranks"),
])
def test_expert_layout_refusals_are_one_sentence(dims, fits, ep, etp, words):
    """ep x etp must divide the stage's ranks as folded (etp = tp: ep divides dp*cp*sp); `fits`
    (ep, etp) is a neighbouring layout that does."""
    from megatron_sp.mesh import ParallelDims
    ParallelDims(**dims).check_expert_parallel(*fits)
    with pytest.raises(LayoutError) as err:
        ParallelDims(**dims).check_expert_parallel(ep, etp)
    message = str(err.value)
    assert words in message and message.endswith(".") and ". " not in message, message


def test_expert_ranks_with_expert_tensor_parallelism():
    """etp = tp at tp 2 x sp 2 x dp 2 (8 ranks, f = tp + 2 sp + 4 dp): ep 2 over sp holds the
    ranks with the same tp rank; edp the same tp and ep rank."""
    from megatron_sp.mesh import ParallelDims
    dims = ParallelDims(world_size=8, tp=2, sp=2)
    assert dims.expert_ranks(2, 5, etp=2) == ([5, 7], [1, 5])
    assert dims.expert_ranks(4, 2, etp=2) == ([0, 2, 4, 6], [2])
    assert dims.expert_ranks(2, 5) == ([4, 5], [1, 3, 5, 7])        # etp 1: folded over tp



def test_mesh_expert_groups_on_one_rank():
    groups = ParallelMesh.single().expert_groups(1)
    assert (groups.ep, groups.ep_rank, groups.edp, groups.ep_group, groups.edp_group) == (1, 0, 1, None, None)


def test_expert_ranks_arithmetic():
    from megatron_sp.mesh import ParallelDims
    dims = ParallelDims(world_size=16, sp=2, cp=2, pp=2)      # dp 2: N = 8 ranks per stage
    assert dims.expert_ranks(4, 5) == ([4, 5, 6, 7], [1, 5])
    assert dims.expert_ranks(2, 13) == ([12, 13], [9, 11, 13, 15])
    assert dims.expert_ranks(8, 0) == (list(range(8)), [0])
    for rank in range(16):      # every ep group is a block of f, every edp group a stride of ep
        ep_ranks, edp_ranks = dims.expert_ranks(2, rank)
        assert rank in ep_ranks and rank in edp_ranks and len(set(ep_ranks) & set(edp_ranks)) == 1


def test_expert_ranks_fold_over_tensor_parallelism():
    """Parallel folding (expert tensor parallelism 1): the ep group is ep consecutive ranks of the
    stage's (dp, cp, sp, tp) order, tp ranks first; edp the rest of the stage, tp ranks included."""
    from megatron_sp.mesh import ParallelDims
    dims = ParallelDims(world_size=16, tp=2, sp=2, pp=2)       # dp 2: 8 ranks per stage
    assert dims.stage_ranks == 8
    assert dims.expert_ranks(2, 5) == ([4, 5], [1, 3, 5, 7])    # the tp pair of rank 5
    assert dims.expert_ranks(4, 9) == ([8, 9, 10, 11], [9, 13])  # tp 2 x sp 2 of dp 0, stage 1
    assert dims.expert_ranks(8, 3) == (list(range(8)), [3])
    for rank in range(16):
        ep_ranks, edp_ranks = dims.expert_ranks(4, rank)
        stage = {r // 8 for r in ep_ranks + edp_ranks}
        assert stage == {rank // 8} and set(ep_ranks) & set(edp_ranks) == {rank}
        assert len(ep_ranks) * len(edp_ranks) == 8


def test_mesh_refuses_ep_that_does_not_divide_the_stage():
    from megatron_sp.mesh import ParallelDims
    dims = ParallelDims(world_size=12, tp=2, sp=3, dp=2)
    with pytest.raises(LayoutError, match=r"does not divide the 12 ranks of a pipeline stage "
                                          r"\(dp\*cp\*sp\*tp = 2\*1\*3\*2\)"):
        dims.check_expert_parallel(8)
    dims.check_expert_parallel(4)     # tp 2 x dp 2 of the 12: fine
