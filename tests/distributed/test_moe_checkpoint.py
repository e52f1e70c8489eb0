"""Checkpoints of a mixture-of-experts model under expert parallelism, resumed across ep sizes.

One 4-rank gloo spawn, dp 2 x sp 2. A model with --expert-model-parallel-size 2 trains 2 AdamW
steps, saves (model, AdamW moments and steps, LR schedule) and trains 2 more. The checkpoint stores
each expert stack at its full [E, ...] shape (each ep rank's E/ep rows at offset ep_rank * E/ep), so
it loads under ep 1 and ep 4 on the same ranks, and on one rank:
- after the load every parameter and AdamW moment equals the saved run's, gathered over ep (exact);
- the 2 steps trained after the load match the saved run's 2 steps: loss 1e-5 relative, every full
  gradient 1e-4, grad norm 1e-4 (layout_utils.compare; seq_aux_loss, whose mean over sequences is
  what data parallelism averages).
The same with the distributed optimizer (the experts' AdamW rows sharded over their edp group, the
rest over dp x sp): saved at ep 2, resumed at ep 4 and on one rank; the parameters come back exact
and the next 2 steps match in loss, grad norm and updated weights (1e-4; the moments must be back).
The same with FSDP2 (each ep rank's experts sharded over its edp group): saved at ep 2, resumed
under FSDP2 at ep 4 and unsharded on one rank, parameters and moments exact.
Expert tensor parallelism (etp 2, tp2 x sp2): resumed at etp 1 ep 2, at etp 2 ep 2 (experts split
over tp and ep) and on one rank, exact.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

from megatron_sp.testing import run_distributed

MOE = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
           ffn_hidden_size=128, vocab_size=300, num_experts=4, moe_ffn_hidden_size=32,
           moe_router_topk=2, moe_aux_loss_coeff=1.0, moe_z_loss_coeff=0.1,
           moe_router_load_balancing_type="seq_aux_loss", moe_shared_expert_intermediate_size=48)
SAVE_AT, STEPS, GLOBAL_BATCH = 2, 4, 4


def _full(t, p, mesh):
    """t (p itself or a state shaped like it) at the full shape: gathered over ep for experts."""
    from megatron_sp.tensor_parallel import gather_full_like
    from megatron_sp.tensor_parallel.mappings import gather_along_dim
    from megatron_sp.sharding.fsdp import full_tensor
    from megatron_sp.grad_sync import expert_groups_of
    t = full_tensor(t)                                      # FSDP2: gathered over dp x sp / edp
    t = gather_full_like(t, p, mesh.tp_group)               # etp = tp: the tp split gathered
    if getattr(p, "expert_parallel", False) and getattr(p, "ep_size", 1) > 1:
        t = gather_along_dim(t.contiguous(), 0, expert_groups_of(mesh, p).ep_group)
    rows = getattr(p, "real_rows", None)     # vocabulary padding differs between tp sizes
    return (t[:rows] if rows else t).clone()


def _snapshot(chunks, optimizer, mesh) -> dict:
    """{name: (param, exp_avg, exp_avg_sq, step)} at full shapes ((param,) with the distributed
    optimizer, whose moments are rows of its own)."""
    from megatron_sp.sharding.distributed_optimizer import DistributedOptimizer
    out = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if isinstance(optimizer, DistributedOptimizer):
                out[name] = (_full(p, p, mesh),)
                continue
            st = optimizer.state[p]
            out[name] = (_full(p, p, mesh), _full(st["exp_avg"], p, mesh),
                         _full(st["exp_avg_sq"], p, mesh), float(st["step"]))
    return out


def _run(mesh, cfg, batches, micro, ep, *, seed, root, save=False, load=False, distributed=False,
         etp=None, fsdp=False):
    """Train batches[SAVE_AT:] after saving (save) or loading (load) at SAVE_AT; (history,
    snapshot at SAVE_AT)."""
    from megatron_sp import checkpointing as ck
    from megatron_sp.config import JobConfig
    from megatron_sp.training import Trainer
    from megatron_sp.training.optimizer import LRScheduler, build_optimizer
    from layout_utils import build_chunks, full_gradient, micro_batches
    kwargs = {"expert_parallel_size": ep}
    if etp is not None:                      # tp > 1: MoE needs --sequence-parallel
        kwargs["expert_tensor_parallel_size"] = etp
    chunks, schedule = build_chunks(mesh, cfg, model_kwargs=kwargs, seed=seed,
                                    sequence_parallel=mesh.tp_size > 1)
    sharding = None
    if fsdp:
        from megatron_sp.sharding.fsdp import apply_fsdp2
        sharding = apply_fsdp2(chunks, mesh)
    if distributed:
        from megatron_sp.sharding.distributed_optimizer import DistributedOptimizer
        optimizer = sharding = DistributedOptimizer(chunks, mesh, lr=1e-3, weight_decay=0.1,
                                                    bucket_mb=0.05)
    else:
        optimizer = build_optimizer(chunks, lr=1e-3, weight_decay=0.1)
    scheduler = LRScheduler(optimizer, 1e-3, 1e-4, warmup_iters=1, decay_iters=STEPS,
                            style="cosine")
    job = JobConfig.from_flags({"global_batch_size": GLOBAL_BATCH, "micro_batch_size": micro,
                                "seq_length": batches[0]["tokens"].shape[1], "clip_grad": 1.0,
                                "grad_bucket_size_mb": 0.05})
    trainer = Trainer(job, mesh, chunks, optimizer, scheduler, schedule=schedule, sharding=sharding)

    def step(batch):
        result = trainer.train_step(micro_batches(batch, micro, mesh.dp_rank, mesh.dp_size))
        if distributed:   # p.grad is reduced in the owned rows only: compare the updated weights
            grads = {n + "#updated": _full(p, p, mesh) for c in chunks for n, p in c.named_parameters()}
        elif fsdp:
            grads = {n: _full(p.grad, p, mesh) for c in chunks for n, p in c.named_parameters()}
        else:
            grads = {n: full_gradient(p, mesh) for c in chunks for n, p in c.named_parameters()}
        return result.loss, result.grad_norm, grads

    if load:
        ck.load_checkpoint(root, chunks, mesh, optimizer=optimizer, scheduler=scheduler,
                           config=cfg)
        assert scheduler.num_steps == SAVE_AT
    else:
        for batch in batches[:SAVE_AT]:
            step(batch)
        if save:
            ck.save_checkpoint(root, SAVE_AT, chunks, mesh, optimizer=optimizer,
                               scheduler=scheduler, config=cfg)
    snapshot = _snapshot(chunks, optimizer, mesh)
    return [step(batch) for batch in batches[SAVE_AT:]], snapshot


def _checks(rank, world, root):
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import preset
    from layout_utils import compare, global_batches
    torch.manual_seed(100 + rank)
    cfg = preset("llama-tiny", **MOE)
    batches = global_batches(cfg.vocab_size, 32, GLOBAL_BATCH, STEPS, seed=21)
    mesh = ParallelMesh.from_sizes(sp=2)                                   # dp 2 x sp 2
    saved, at_save = _run(mesh, cfg, batches, 2, 2, seed=7, root=root, save=True)
    done = []
    for what, lmesh, micro, ep in (("ep 2 -> ep 4", mesh, 2, 4), ("ep 2 -> ep 1", mesh, 2, 1),
                                   ("ep 2 -> one rank", ParallelMesh.single(), GLOBAL_BATCH, 1)):
        resumed, loaded = _run(lmesh, cfg, batches, micro, ep, seed=99, root=root, load=True)
        assert loaded.keys() == at_save.keys()
        for name, values in at_save.items():
            for i, (a, b) in enumerate(zip(values, loaded[name])):
                same = torch.equal(a, b) if torch.is_tensor(a) else a == b
                assert same, f"{what}: {name} [{('param', 'exp_avg', 'exp_avg_sq', 'step')[i]}]"
        done.append((what,) + compare(saved, resumed, what))
    droot = root + "-distributed"
    saved, at_save = _run(mesh, cfg, batches, 2, 2, seed=7, root=droot, save=True, distributed=True)
    for what, lmesh, micro, ep, dist_opt in (
            ("distributed optimizer ep 2 -> ep 4", mesh, 2, 4, True),
            ("distributed optimizer ep 2 -> one rank", ParallelMesh.single(), GLOBAL_BATCH, 1,
             True)):
        resumed, loaded = _run(lmesh, cfg, batches, micro, ep, seed=99, root=droot, load=True,
                               distributed=dist_opt)
        for name, values in at_save.items():
            assert torch.equal(values[0], loaded[name][0]), f"{what}: {name}"
        done.append((what,) + compare(saved, resumed, what))
    # FSDP2: each ep rank's experts sharded over its edp group (AdamW moments DTensors like the
    # parameters); saved at ep 2, resumed under FSDP2 at ep 4 and unsharded on one rank.
    froot = root + "-fsdp"
    saved, at_save = _run(mesh, cfg, batches, 2, 2, seed=7, root=froot, save=True, fsdp=True)
    for what, lmesh, micro, ep, fsdp in (("FSDP2 ep 2 -> FSDP2 ep 4", mesh, 2, 4, True),
                                         ("FSDP2 ep 2 -> one rank", ParallelMesh.single(),
                                          GLOBAL_BATCH, 1, False)):
        resumed, loaded = _run(lmesh, cfg, batches, micro, ep, seed=99, root=froot, load=True,
                               fsdp=fsdp)
        assert loaded.keys() == at_save.keys()
        for name, values in at_save.items():
            for a, b in zip(values, loaded[name]):
                assert (torch.equal(a, b) if torch.is_tensor(a) else a == b), f"{what}: {name}"
        done.append((what,) + compare(saved, resumed, what))
    # Expert tensor parallelism: saved with the experts split over tp (etp 2, w1's gate and up
    # rows each halved), resumed with whole experts (etp 1, ep 2 folded over tp) and on one rank.
    tmesh, troot = ParallelMesh.from_sizes(tp=2, sp=2), root + "-etp"
    for distributed in (False, True):
        saved, at_save = _run(tmesh, cfg, batches, 4, 1, seed=7, root=troot + str(distributed),
                              save=True, distributed=distributed, etp=2)
        kind = "distributed optimizer " if distributed else ""
        for what, lmesh, micro, ep, etp in ((f"{kind}etp 2 -> etp 1 ep 2", tmesh, 4, 2, 1),
                                            (f"{kind}etp 2 -> etp 2 ep 2", tmesh, 4, 2, 2),
                                            (f"{kind}etp 2 -> one rank", ParallelMesh.single(),
                                             GLOBAL_BATCH, 1, None)):
            resumed, loaded = _run(lmesh, cfg, batches, micro, ep, seed=99,
                                   root=troot + str(distributed), load=True,
                                   distributed=distributed, etp=etp)
            for name, values in at_save.items():
                for a, b in zip(values, loaded[name]):
                    assert (torch.equal(a, b) if torch.is_tensor(a) else a == b), f"{what}: {name}"
            done.append((what,) + compare(saved, resumed, what))
    return done


@pytest.mark.timeout(300)
def test_moe_checkpoint_resumes_across_expert_parallel_sizes():
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "ckpt")
        results = run_distributed(_checks, 4, root)
    assert [r[0] for r in results[0]] == ["ep 2 -> ep 4", "ep 2 -> ep 1", "ep 2 -> one rank",
                                          "distributed optimizer ep 2 -> ep 4",
                                          "distributed optimizer ep 2 -> one rank",
                                          "FSDP2 ep 2 -> FSDP2 ep 4", "FSDP2 ep 2 -> one rank",
                                          "etp 2 -> etp 1 ep 2", "etp 2 -> etp 2 ep 2",
                                          "etp 2 -> one rank",
                                          "distributed optimizer etp 2 -> etp 1 ep 2",
                                          "distributed optimizer etp 2 -> etp 2 ep 2",
                                          "distributed optimizer etp 2 -> one rank"]
    for what, loss, grad in results[0]:
        print(f"{what}: loss rel {loss:.1e}, grad {grad:.1e}")
