"""A mixture-of-experts GPTModel under tensor parallelism (issue 37), 4 gloo ranks, one spawn,
against the same model on one rank (layout_utils: 3 optimizer steps, loss 1e-5 relative, every
gradient 1e-4, router and experts included).

Megatron-LM's layout with expert tensor parallelism 1 ("parallel folding", asked for with
--expert-tensor-parallel-size 1: the default is etp = tp, as in Megatron-LM): MoE under tp > 1 needs
--sequence-parallel, so each tp rank's MoE layer takes its own s/(sp*tp) slice of the tokens and
routes it without any tp all-gather. The router losses' statistics are summed over cp x sp x tp
(mesh.token_group); the router, the shared expert and (ep 1) the experts are replicated over tp
but see different tokens, so their gradients are summed over tp like the norms'; with ep > 1 the
ep group is ep consecutive ranks of the stage's (dp, cp, sp, tp) order (tp ranks first) and the
expert gradients are summed over the edp group, which then holds the tp ranks too. The Switch loss
is not linear in the sequences, so the layouts with dp > 1 use seq_aux_loss (test_moe_layouts.py's
docstring). moe_aux_loss_coeff 1 and moe_z_loss_coeff 0.1 are large on purpose: summing the
statistics over sp x cp only (without tp) moves the router gradients by ~1e-3, so that mistake
fails here. The groups themselves are checked against the mesh's rank arithmetic on the way.

Expert tensor parallelism etp = tp (--expert-tensor-parallel-size tp): every expert split
like the dense SwiGLU MLP (w1 [E, 2F/tp, H], gate and up rows each split; w2 [E, H, F/tp]), the
tokens, routing weights and indices all-gathered over tp before permute, the partial outputs
reduce-scattered after unpermute; cases tp 2 x sp 2 (a shared expert), tp 4 (every other layer)
and tp 2 x dp 2 (seq_aux_loss), the local shapes checked. With ep 2 as well (Megatron's default
layout: ep over dp x cp x sp, the gathered rows sent by all-to-all to the ranks of the same tp
rank holding the other experts, expert gradients summed over the edp group of the same tp rank):
tp 2 x sp 2 and tp 2 x dp 2.
"""
import pytest
import torch

from megatron_sp.testing import run_distributed

from layout_utils import check_layouts

MOE = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
           ffn_hidden_size=128, vocab_size=300, num_experts=4, moe_ffn_hidden_size=32,
           moe_router_topk=2, moe_aux_loss_coeff=1.0, moe_z_loss_coeff=0.1)   # large: router gradients
SEQ_AUX = {"moe_router_load_balancing_type": "seq_aux_loss"}
FOLD = {"expert_tensor_parallel_size": 1}     # whole experts (the default with tp > 1 is etp = tp)


def _case(name, overrides=None, **layout):
    return dict(model="llama-tiny", name=name, overrides={**MOE, **(overrides or {})}, seq=32,
                global_batch=4, steps=3, sequence_parallel=True, **layout)


def _group_ranks():
    """(token group, ep group, edp group) ranks of this rank at tp 2 x sp 2 with ep 4, at
    tp 2 x dp 2 with ep 2 and at tp 2 x sp 2 with ep 2 x etp 2 (the ep group: the ranks with the
    same tp rank), each with what the rank arithmetic says."""
    import torch.distributed as dist
    from megatron_sp.mesh import ParallelMesh
    out = []
    for sizes, ep, etp in (({"tp": 2, "sp": 2}, 4, 1), ({"tp": 2}, 2, 1), ({"tp": 2, "sp": 2}, 2, 2)):
        mesh = ParallelMesh.from_sizes(**sizes)
        groups = mesh.expert_groups(ep, etp)
        got = [dist.get_process_group_ranks(g) if g is not None else [mesh.rank]
               for g in (mesh.token_group(), groups.ep_group, groups.edp_group)]
        tokens = mesh.dims.group_ranks(("sp", "tp"), mesh.rank)
        out.append((got, [tokens, *mesh.dims.expert_ranks(ep, mesh.rank, etp)]))
    return out


def _expert_shapes():
    """Local expert shapes at tp 2 x sp 2: whole experts (etp 1) and tp-split (etp 2: w1's gate
    and up rows each halved, tp_chunks 2; w2's ffn columns halved)."""
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import GPTModel, preset
    mesh = ParallelMesh.from_sizes(tp=2, sp=2)
    out = []
    for etp in (1, None):        # None: the default, etp = tp
        model = GPTModel(preset("llama-tiny", **MOE), mesh, sequence_parallel=True,
                         expert_tensor_parallel_size=etp)
        experts = model.moe_layers()[0].experts
        out.append([(tuple(w.shape), getattr(w, "tp_partition_dim", None),
                     getattr(w, "tp_chunks", 1)) for w in (experts.w1, experts.w2)])
    return out


def _capacity_under_etp():
    """Capacity dropping (factor 0.5: tokens are dropped) is that of each tp rank's own tokens
    (routed before any gather), so at tp 2 x sp 2 with --sequence-parallel the runs with the
    experts split over tp (etp 2, and etp 2 x ep 2 padded to capacity: p*C rows per expert after
    the gather) train exactly as whole experts (etp 1). Returns the comparisons."""
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import preset
    from layout_utils import compare, global_batches, train_layout
    base = {**MOE, **SEQ_AUX, "moe_expert_capacity_factor": 0.5}
    cfg, padded = preset("llama-tiny", **base), preset("llama-tiny", **base,
                                                       moe_pad_expert_input_to_capacity=True)
    batches = global_batches(cfg.vocab_size, 32, 4, 3, seed=19)
    mesh = ParallelMesh.from_sizes(tp=2, sp=2)
    run = lambda c, **kw: train_layout(mesh, c, batches, 4, sequence_parallel=True,
                                       model_kwargs=kw)
    ref = run(cfg, expert_tensor_parallel_size=1)
    return [("capacity etp2 vs etp1",) + compare(ref, run(cfg, expert_tensor_parallel_size=2),
                                                 "capacity etp2"),
            ("capacity etp2 ep2 padded vs etp1",) + compare(
                ref, run(padded, expert_tensor_parallel_size=2, expert_parallel_size=2),
                "capacity etp2 ep2 padded")]


def _checks(rank, world):
    torch.set_num_threads(1)
    cases = [
        _case("moe tp2 x sp2 sequence-parallel, aux + z loss", tp=2, sp=2, micro_batch=4,
              model_kwargs=FOLD),
        _case("moe tp2 x dp2 ep2, shared expert, seq aux loss",
              {**SEQ_AUX, "moe_shared_expert_intermediate_size": 48}, tp=2, micro_batch=2,
              model_kwargs={**FOLD, "expert_parallel_size": 2}),
        _case("moe tp2 x sp2 ep4, every other layer", {"moe_layer_freq": 2}, tp=2, sp=2,
              micro_batch=4, model_kwargs={**FOLD, "expert_parallel_size": 4}),
        _case("moe tp4 ep2, shared expert", {"moe_shared_expert_intermediate_size": 48}, tp=4,
              micro_batch=4, model_kwargs={**FOLD, "expert_parallel_size": 2}),
        _case("moe tp2 x pp2 ep2, 4 micro-batches, seq aux loss", SEQ_AUX, tp=2, pp=2,
              micro_batch=1, pipeline={}, model_kwargs={**FOLD, "expert_parallel_size": 2}),
        _case("moe tp2 x sp2 etp2, shared expert, aux + z loss",
              {"moe_shared_expert_intermediate_size": 48}, tp=2, sp=2, micro_batch=4,
              model_kwargs={"expert_tensor_parallel_size": 2}),
        _case("moe tp4 etp4, every other layer", {"moe_layer_freq": 2}, tp=4, micro_batch=4,
              model_kwargs={"expert_tensor_parallel_size": 4}),
        _case("moe tp2 x dp2 etp2, seq aux loss", SEQ_AUX, tp=2, micro_batch=1,
              model_kwargs={"expert_tensor_parallel_size": 2}),
        _case("moe tp2 x sp2 etp2 ep2, shared expert, aux + z loss",
              {"moe_shared_expert_intermediate_size": 48}, tp=2, sp=2, micro_batch=4,
              model_kwargs={"expert_tensor_parallel_size": 2, "expert_parallel_size": 2}),
        _case("moe tp2 x dp2 etp2 ep2, every other layer, seq aux loss",
              {**SEQ_AUX, "moe_layer_freq": 2}, tp=2, micro_batch=1,
              model_kwargs={"expert_tensor_parallel_size": 2, "expert_parallel_size": 2}),
    ]
    return {"groups": _group_ranks(), "shapes": _expert_shapes(),
            "model": check_layouts(rank, world, cases) + _capacity_under_etp()}


@pytest.mark.timeout(400)
def test_moe_tensor_parallel_layouts_match_one_rank():
    results = run_distributed(_checks, 4, timeout_s=380.0)
    for r in results:
        for got, expected in r["groups"]:
            assert got == expected, (got, expected)
        assert r["shapes"] == [[((4, 64, 64), None, 1), ((4, 64, 32), None, 1)],
                               [((4, 32, 64), 1, 2), ((4, 64, 16), 2, 1)]], r["shapes"]
    for name, loss, grad in results[0]["model"]:
        print(f"{name}: loss rel {loss:.1e}, grad {grad:.1e}")
