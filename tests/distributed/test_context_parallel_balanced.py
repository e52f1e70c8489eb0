"""The document-aware balanced ring layout (context_parallel/balance.py, the default with packed
documents) in the whole model equals one rank: loss 1e-5 relative, gradients 1e-4 (FSDP2 and the
distributed optimizer: losses and gradient norms), 3 optimizer steps
(layout_utils.check_layouts), on 4 gloo ranks in one spawn: cp 4 and cp 2 x dp 2 p2p, a2a+p2p /
sp 2 x cp 2, cp 2 x tp 2 --sequence-parallel, cp 2 x pp 2, FSDP2, the distributed optimizer,
full and selective recompute, head chunks; mixes skewed (one long document among short and
one-token ones), short ones, one-token documents, one document the whole row, and
--context-parallel-layout zigzag on the same skewed rows. In the same spawn, the work the model
counts per ring rank (GPTModel.take_cp_work, summed over two micro-batches) equals a brute-force
count of causal (query, key) pairs, Trainer.cp_log_fields gives the worst dp replica's max/mean,
and at cp 4 the ring sends only the travelling keys: the bytes counted ("cp/ring_p2p") equal
those of the plan's blocks exactly and are fewer than the zigzag ring's. Outside the spawn:
those rows really are laid out differently from the zigzag (and the whole-row document
identically)."""
from types import SimpleNamespace

import pytest
import torch

from megatron_sp import comm_stats
from megatron_sp.attention.segments import document_bounds
from megatron_sp.context_parallel import COMM_KIND as RING_KIND
from megatron_sp.context_parallel.balance import (LayoutPlanner, causal_pairs, cp_layout,
                                                  work_balance)
from megatron_sp.context_parallel.ring import ring_attention
from megatron_sp.memory import MemoryOptions
from megatron_sp.mesh import ParallelMesh
from megatron_sp.models import GPTModel, preset
from megatron_sp.testing import run_distributed
from megatron_sp.training import Trainer

from layout_utils import check_layouts, global_batches
from test_model_parallel import LLAMA, LLAMA_GQA2

COMMON = dict(seq=32, global_batch=4, steps=3)
ZIGZAG = {"context_parallel_layout": "zigzag"}


def _cases():
    skewed = dict(COMMON, packed="skewed")
    return [
        dict(LLAMA, name="cp4 skewed", cp=4, micro_batch=4, **skewed),
        dict(LLAMA, name="cp4 skewed, --context-parallel-layout zigzag", cp=4, micro_batch=4,
             model_kwargs=ZIGZAG, **skewed),
        dict(LLAMA, name="cp2 x dp2 one-token documents", cp=2, micro_batch=2, packed="one-token",
             **COMMON),
        dict(LLAMA, name="cp2 x dp2 one document the whole row", cp=2, micro_batch=1,
             packed="whole", **COMMON),
        dict(LLAMA, name="a2a+p2p sp2 x cp2 skewed", sp=2, cp=2, micro_batch=2, **skewed),
        dict(LLAMA, name="cp2 x tp2 sequence-parallel skewed", cp=2, tp=2, micro_batch=2,
             sequence_parallel=True, **skewed),
        dict(LLAMA, name="cp2 x pp2 (1F1B) skewed", cp=2, pp=2, micro_batch=1, **skewed),
        dict(LLAMA, name="cp2 x dp2 FSDP2 skewed", cp=2, micro_batch=2, sharding="fsdp2",
             **skewed),
        dict(LLAMA, name="cp2 x dp2 distributed optimizer skewed", cp=2, micro_batch=2,
             sharding="distopt", **skewed),
        dict(LLAMA, name="cp2 x dp2 full recompute, short documents", cp=2, micro_batch=2,
             packed="short", model_kwargs={"memory": MemoryOptions(recompute_granularity="full")},
             **COMMON),
        dict(LLAMA_GQA2, name="cp4 selective recompute + 2 head chunks, short documents", cp=4,
             micro_batch=2, packed="short",
             model_kwargs={"memory": MemoryOptions(recompute_granularity="selective",
                                                   ulysses_head_chunks=2)}, **COMMON),
    ]


def test_mixes_are_laid_out_differently_from_the_zigzag():
    """The skewed and short rows of the cases move tokens; the whole-row document does not."""
    for mix, cp, moved in (("skewed", 4, True), ("skewed", 2, True), ("short", 4, True),
                           ("whole", 2, False)):
        batches = global_batches(300, COMMON["seq"], COMMON["global_batch"], COMMON["steps"],
                                 seed=11, packed=mix)
        ids = batches[0]["document_ids"]
        bounds = document_bounds(ids)
        balanced = cp_layout("balanced", bounds, ids.shape[0], ids.shape[1], cp)
        zigzag = cp_layout("zigzag", bounds, ids.shape[0], ids.shape[1], cp)
        same = all(torch.equal(balanced.positions(r), zigzag.positions(r)) for r in range(cp))
        assert same != moved, mix
        if moved:
            assert balanced.balance() < zigzag.balance(), mix


def _brute_work(ids, cp):
    """Per ring rank, brute-force causal pairs of the balanced layout's positions of ids [b, s]."""
    bounds = document_bounds(ids)
    layout = cp_layout("balanced", bounds, ids.shape[0], ids.shape[1], cp)
    return [sum(causal_pairs(bounds[i], layout.positions(r)[i].tolist())
                for i in range(ids.shape[0])) for r in range(cp)]


def _check_work_counted(rank, world):
    """cp 2 x dp 2: two forwards of this replica's rows; the model's count and the log field."""
    cfg = preset(LLAMA["model"], **LLAMA["overrides"])
    mesh = ParallelMesh.from_sizes(cp=2)
    model = GPTModel(cfg, mesh)
    batches = global_batches(cfg.vocab_size, 32, 4, 1, seed=5 + mesh.dp_rank, packed="skewed")
    expected = [0, 0]
    with torch.no_grad():
        for half in (slice(0, 2), slice(2, 4)):
            ids = batches[0]["document_ids"][half]
            model(input_ids=batches[0]["tokens"][half], document_ids=ids)
            expected = [a + b for a, b in zip(expected, _brute_work(ids, 2))]
    counted = model.take_cp_work()
    assert counted == expected and model.take_cp_work() is None, (counted, expected)
    fields = Trainer.cp_log_fields(SimpleNamespace(_cp_work=counted, mesh=mesh,
                                                   device=torch.device("cpu")))
    replicas = [work_balance([a + b for a, b in zip(
        _brute_work(global_batches(cfg.vocab_size, 32, 4, 1, seed=5 + d,
                                   packed="skewed")[0]["document_ids"][:2], 2),
        _brute_work(global_batches(cfg.vocab_size, 32, 4, 1, seed=5 + d,
                                   packed="skewed")[0]["document_ids"][2:], 2))])
        for d in range(2)]
    assert fields == {"cp_work_balance": max(replicas)}, (fields, replicas)


def _ring_bytes(plan, ids, b, n, g, d, seed):
    """(forward, backward) bytes this rank's ring sends on random fp32 q, k, v under plan."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, 4, d, generator=gen, requires_grad=True)
    k, v = (torch.randn(b, n, g, d, generator=gen, requires_grad=True) for _ in range(2))
    comm_stats.reset()
    out = ring_attention(q, k, v, plan.group, plan=plan.plan)
    forward = comm_stats.snapshot().get(RING_KIND, 0)
    comm_stats.reset()
    out.backward(torch.randn(out.shape, generator=gen))
    return forward, comm_stats.snapshot().get(RING_KIND, 0)


def _check_bytes_only_travelling(rank, world):
    """cp 4 over the whole world: the skewed rows' ring under the balanced (compact) plan."""
    group = torch.distributed.new_group(list(range(world)))
    ids = global_batches(300, 64, 2, 1, seed=3, packed="skewed")[0]["document_ids"]
    b, s, g, d = 2, 64, 2, 8
    n = s // world
    sent = {}
    for kind in ("balanced", "zigzag"):
        planner = LayoutPlanner(kind, world, rank)
        plan = SimpleNamespace(group=group, plan=planner.plan(ids, b, n, True))
        sent[kind] = _ring_bytes(plan, ids, b, n, g, d, seed=rank)
    plan = LayoutPlanner("balanced", world, rank).plan(ids, b, n, True)
    blocks = [plan.block_tokens[(rank - i) % world] for i in range(world)]   # held at step i
    kv = lambda m: 2 * b * m * g * d * 4                                      # k and v, fp32
    assert sent["balanced"] == (sum(kv(m) for m in blocks[:-1]),
                                sum(kv(m) for m in blocks[:-1]) + sum(kv(m) for m in blocks[1:]))
    assert sent["zigzag"] == ((world - 1) * kv(n), (world - 1) * kv(n) + world * kv(n))
    assert sum(sent["balanced"]) < sum(sent["zigzag"])


def _spawned(rank, world, cases):
    _check_work_counted(rank, world)
    _check_bytes_only_travelling(rank, world)
    return check_layouts(rank, world, cases)


@pytest.mark.timeout(600)
def test_balanced_layout_equals_one_rank():
    cases = _cases()
    results = run_distributed(_spawned, 4, cases)
    assert [r[0] for r in results[0]] == [c["name"] for c in cases]
