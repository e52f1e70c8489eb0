"""Long-context memory techniques under tp and Ulysses sp (one 4-rank spawn).

1. Each technique, alone and combined, leaves loss and gradients equal to the one-rank plain model
   (layout_utils: loss 1e-5 relative, gradients 1e-4) under tp x sp, tp sequence-parallel, sp.
2. With dropout (RNGTracker streams), recompute/tiling/chunking equal the plain model on the same
   layout: the masks are replayed exactly.
3. Saved bytes per rank: sp=p divides them by p (within 10%), and the planner's prediction agrees
   with the measured bytes within 10% for several layouts and techniques.
"""
import torch

from megatron_sp.memory import MemoryOptions, measure_saved_bytes
from megatron_sp.memory.planner import activation_bytes
from megatron_sp.mesh import ParallelMesh
from megatron_sp.models import GPTModel, preset
from megatron_sp.models.init import init_parameters
from megatron_sp.tensor_parallel import RNGTracker
from megatron_sp.testing import run_distributed

from layout_utils import compare, global_batches, train_layout

LLAMA = dict(model="llama-tiny", overrides=dict(num_layers=2, hidden_size=64, num_attention_heads=8,
                                                num_query_groups=4, ffn_hidden_size=128,
                                                vocab_size=300))
GPT2 = dict(model="gpt2-tiny", overrides=dict(num_layers=2, hidden_size=64, num_attention_heads=8,
                                              vocab_size=300, max_position_embeddings=64))
FULL = dict(recompute_granularity="full")
ALL = dict(recompute_granularity="full", recompute_num_layers=2, mlp_tiles=3, loss_chunks=3,
           offload_activations=True)

EQUIVALENCE = [
    # (name, model, tp, sp, sequence_parallel, micro_batch, MemoryOptions kwargs)
    ("full recompute tp2 x sp2", LLAMA, 2, 2, False, 2, FULL),
    ("full block recompute tp2 x sp2", LLAMA, 2, 2, False, 2,
     dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)),
    ("selective recompute tp2 x sp2", LLAMA, 2, 2, False, 2, dict(recompute_granularity="selective")),
    ("tiled mlp tp2 x sp2", LLAMA, 2, 2, False, 2, dict(mlp_tiles=3)),
    ("chunked loss tp2 x sp2", LLAMA, 2, 2, False, 2, dict(loss_chunks=3)),
    ("offload tp2 x sp2", LLAMA, 2, 2, False, 2, dict(offload_activations=True)),
    ("all combined tp2 x sp2 sequence-parallel", LLAMA, 2, 2, True, 4, ALL),
    ("tiled mlp + chunked loss tp4 sequence-parallel (gpt2, tied)", GPT2, 4, 1, True, 4,
     dict(mlp_tiles=2, loss_chunks=2)),
    ("all combined sp4 (gpt2)", GPT2, 1, 4, False, 4, dict(ALL, recompute_granularity="selective")),
]


def _equivalence(rank):
    out = []
    common = dict(seq=32, global_batch=4, steps=2)
    refs = {}
    for name, model, tp, sp, seqpar, mb, mem in EQUIVALENCE:
        cfg = preset(model["model"], **model["overrides"])
        batches = global_batches(cfg.vocab_size, common["seq"], common["global_batch"],
                                 common["steps"], seed=11)
        if model["model"] not in refs:
            refs[model["model"]] = train_layout(ParallelMesh.single(), cfg, batches, 4)
        mesh = ParallelMesh.from_sizes(tp=tp, sp=sp)
        got = train_layout(mesh, cfg, batches, mb, sequence_parallel=seqpar,
                           model_kwargs={"memory": MemoryOptions(**mem)})
        out.append((name,) + compare(refs[model["model"]], got, name))
    return out


def _dropout(rank):
    """Same layout, dropout on: each technique equals the plain model (masks replayed)."""
    cfg = preset("llama-tiny", **dict(LLAMA["overrides"], hidden_dropout=0.1, attention_dropout=0.1))
    batches = global_batches(cfg.vocab_size, 32, 4, 2, seed=5)
    mesh = ParallelMesh.from_sizes(tp=2, sp=2)

    def run(mem):
        tracker = RNGTracker(9, tp_rank=mesh.tp_rank, sp_rank=mesh.sp_rank)
        return train_layout(mesh, cfg, batches, 2, sequence_parallel=True,
                            model_kwargs={"memory": MemoryOptions(**mem), "rng_tracker": tracker})
    plain = run({})
    out = []
    for mem in (FULL, dict(recompute_granularity="selective"), ALL):
        out.append(("dropout " + str(mem),) + compare(plain, run(mem), f"dropout {mem}"))
    return out


def _measure(mesh, cfg, mem, seq, b, seqpar=False):
    model = GPTModel(cfg, mesh, sequence_parallel=seqpar, memory=mem)
    init_parameters(model, seed=3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (b, seq), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (b, seq), generator=g)
    return measure_saved_bytes(model, ids, labels)[1]


def _bytes(rank):
    cfg = preset("llama-tiny", **dict(LLAMA["overrides"], num_layers=2))
    seq, b = 256, 1
    out = {"sp_scaling": {}, "planner": []}
    # sp = p divides the per-layer bytes by p (layer 1: no shared RoPE tables)
    single = _measure(ParallelMesh.single(), cfg, MemoryOptions(), seq, b)["by_label"]["layer 1"]
    for sp in (2, 4):
        mesh = ParallelMesh.from_sizes(sp=sp)
        got = _measure(mesh, cfg, MemoryOptions(), seq, b)["by_label"]["layer 1"]
        out["sp_scaling"][sp] = single / got
        assert abs(single / got / sp - 1) <= 0.10, f"sp={sp}: layer bytes {got} vs {single}/sp"
    # the planner agrees with the measurement within 10%
    for tp, sp, seqpar, mem in [(1, 4, False, MemoryOptions()), (2, 2, False, MemoryOptions()),
                                (2, 2, True, MemoryOptions()), (4, 1, True, MemoryOptions(mlp_tiles=4)),
                                (2, 2, False, MemoryOptions(loss_chunks=4)),
                                (2, 2, True, MemoryOptions(recompute_granularity="full")),
                                (1, 4, False, MemoryOptions(recompute_granularity="selective",
                                                            mlp_tiles=2, loss_chunks=2))]:
        mesh = ParallelMesh.from_sizes(tp=tp, sp=sp)
        got = _measure(mesh, cfg, mem, seq, b, seqpar)
        pred = activation_bytes(cfg, seq, b, tp=tp, sp=sp, sequence_parallel=seqpar, memory=mem,
                                device="cpu")
        ratio = pred["total"] / got["device_bytes"]
        out["planner"].append((tp, sp, seqpar, str(mem), ratio))
        assert abs(ratio - 1) <= 0.10, f"tp={tp} sp={sp} {mem}: predicted {pred['total']} vs " \
                                       f"measured {got['device_bytes']}"
    return out


def _all(rank, world):
    torch.manual_seed(100 + rank)
    return {"equivalence": _equivalence(rank), "dropout": _dropout(rank), "bytes": _bytes(rank)}


def test_long_context_techniques_four_ranks():
    results = run_distributed(_all, 4)
    r = results[0]
    assert [x[0] for x in r["equivalence"]] == [c[0] for c in EQUIVALENCE]
    assert len(r["dropout"]) == 3
    assert set(r["bytes"]["sp_scaling"]) == {2, 4}
