"""--use-distributed-optimizer equals one rank and holds the bytes of docs/design.md §11.

Every rank trains the one-rank reference (torch's AdamW, no communication) and the layout with the
distributed optimizer (Adam state sharded over dp x sp, gradients reduce-scattered, parameters
all-gathered) on the same seeded batches, then compares after every one of 3 optimizer steps: loss
1e-5 relative, the full gradient (the owned rows of every rank, summed over dp x sp) and the full
updated parameters 1e-4 absolute, and the grad norm 1e-4 (layout_utils.compare). Also: a NaN on one
rank skips the step on every rank; with expert parallelism (a MoE model, ep 2 and ep 4 over dp 2 x
sp 2) the experts' Adam state is sharded over their expert-data-parallel group, the rest over
dp x sp, and the full expert tensors are gathered over ep to compare; the per-rank model-state bytes equal docs/design.md §11 (2% per
rank for the ceil(rows / n) split, exact summed over ranks); bf16 parameters keep fp32 master rows.
Checkpoints across every mode and exact resume: tests/distributed/test_fsdp.py (_check_checkpoints).
"""
from __future__ import annotations

import torch

from megatron_sp.config import JobConfig
from megatron_sp.grad_sync import all_reduce_sum, expert_groups_of
from megatron_sp.mesh import ParallelMesh
from megatron_sp.training.optimizer import LRScheduler, build_optimizer
from megatron_sp.sharding.distributed_optimizer import DistributedOptimizer
from megatron_sp.tensor_parallel import gather_full_like
from megatron_sp.tensor_parallel.mappings import gather_along_dim
from megatron_sp.testing import FaultInjection, run_distributed
from megatron_sp.training import Trainer
from megatron_sp.models import preset

from layout_utils import build_chunks, compare, global_batches, micro_batches

GPT2 = dict(model="gpt2-tiny", overrides=dict(num_layers=2, hidden_size=64, num_attention_heads=4,
                                              vocab_size=300, max_position_embeddings=64))
LLAMA = dict(model="llama-tiny", overrides=dict(num_layers=2, hidden_size=64, num_attention_heads=4,
                                                num_query_groups=2, ffn_hidden_size=96,
                                                vocab_size=300))
LLAMA4 = dict(model="llama-tiny", overrides=dict(num_layers=4, hidden_size=64, num_attention_heads=4,
                                                 num_query_groups=2, ffn_hidden_size=96,
                                                 vocab_size=300))
MOE = dict(model="llama-tiny", overrides=dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
    vocab_size=300, num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
    moe_aux_loss_coeff=1.0, moe_z_loss_coeff=0.1, moe_router_load_balancing_type="seq_aux_loss",
    moe_shared_expert_intermediate_size=48))
BYTES_RTOL = 0.02      # per rank: rows split in ceil(rows / n) pieces, the last shorter (padding)


def _trainer(mesh, cfg, case, *, distributed, global_batch, steps, micro_batch=None):
    chunks, schedule = build_chunks(mesh, cfg, sequence_parallel=case.get("sequence_parallel", False),
                                    pipeline=case.get("pipeline") if mesh.pp_size > 1 else None,
                                    model_kwargs=case.get("model_kwargs")
                                    if mesh.dims.world_size > 1 else None)   # one rank: all experts
    sharding = None
    if distributed is None:
        optimizer = build_optimizer(chunks, lr=1e-3, weight_decay=0.1)
    else:
        optimizer = sharding = DistributedOptimizer(chunks, mesh, lr=1e-3, weight_decay=0.1,
                                                    bucket_mb=0.05, **distributed)
    scheduler = LRScheduler(optimizer, 1e-3, 1e-4, warmup_iters=1, decay_iters=steps, style="cosine")
    flags, step_hooks = _inject_nan(case, mesh)
    job = JobConfig.from_flags({"global_batch_size": global_batch,
                                "micro_batch_size": micro_batch or case["micro_batch"],
                                "seq_length": case["seq"], "clip_grad": case.get("clip", 1.0),
                                "grad_bucket_size_mb": 0.05, **flags})
    return Trainer(job, mesh, chunks, optimizer, scheduler, schedule=schedule, sharding=sharding,
                   step_hooks=step_hooks)


def _full_grad(optimizer, p):
    """The reduced full gradient of p: every rank's owned rows (as clipped for the step), summed
    over the group p is sharded over (dp x sp, or an expert's edp group)."""
    if not isinstance(optimizer, DistributedOptimizer):
        return p.grad
    group, _, rank = optimizer.shard_of[p]
    full = torch.zeros_like(p.grad)
    if p in optimizer.master:
        optimizer.pieces[p].piece(full, rank).copy_(optimizer.master[p].grad)
    return all_reduce_sum(full, group)


def _over_ep(t, p, mesh):
    """An expert-parallel tensor [E/ep, ...] gathered over its ep group to [E, ...]."""
    if getattr(p, "expert_parallel", False) and getattr(p, "ep_size", 1) > 1:
        return gather_along_dim(t.contiguous(), 0, expert_groups_of(mesh, p).ep_group)
    return t


def _history(trainer, batches, mesh):
    history = []
    for batch in batches:
        size = batch["tokens"].shape[0] // (trainer.num_micro_batches * mesh.dp_size)
        mbs = micro_batches(batch, size, mesh.dp_rank, mesh.dp_size)
        result = trainer.train_step(mbs)
        tensors = {}
        for chunk in trainer.chunks:
            for name, p in chunk.named_parameters():
                if not result.skipped:
                    grad = gather_full_like(_full_grad(trainer.optimizer, p), p, mesh.tp_group)
                    tensors[name] = _over_ep(grad, p, mesh)
                tensors[name + "#updated"] = _over_ep(gather_full_like(p.detach(), p, mesh.tp_group),
                                                      p, mesh)
        # A skipped (non-finite) step: compare the unchanged parameters only.
        history.append((0.0, 0.0, tensors) if result.skipped else (result.loss, result.grad_norm, tensors))
    return history


def _check_bytes(optimizer, mesh):
    """docs/design.md §11: 4 P_r weights + 4 P_r grads on the device, 8 P_r / n Adam (+ 4 P_r / n master and
    4 P_r / n gradient rows on the host with offload); exact summed over the n ranks."""
    n = optimizer.n
    p_r = sum(p.numel() for p in optimizer.params)
    got = optimizer.model_state_bytes(optimizer)
    assert got["params_device_bytes"] == 4 * p_r and got["params_host_bytes"] == 0, got
    where = "host" if optimizer.cpu_offload else "device"
    per_rank_state = (16 if optimizer.cpu_offload else 8) * p_r / n
    state = got[f"{where}_bytes"] - (0 if optimizer.cpu_offload else 8 * p_r)
    assert got["grads_device_bytes"] == 4 * p_r, got
    assert abs(state - per_rank_state) <= BYTES_RTOL * per_rank_state, (state, per_rank_state)
    total = all_reduce_sum(torch.tensor(float(got[f"optim_{where}_bytes"]), dtype=torch.float64),
                           optimizer.group).item()
    assert total == (12 if optimizer.cpu_offload else 8) * p_r, (total, p_r)
    return got


def _inject_nan(case, mesh):
    """--nonfinite-loss skip, with a NaN loss on global rank 0 only at iteration case["nan_at"]:
    (the flags, the step hooks) of the Trainer."""
    if case.get("nan_at"):
        return ({"nonfinite_loss": "skip"},
                [FaultInjection(mesh.rank, environ={"MEGATRON_SP_INJECT_NAN_AT_ITER":
                                                    str(case["nan_at"])})])
    return {}, []


def check_distributed_optimizer(rank, world, cases):
    torch.manual_seed(1000 + rank)
    out = []
    for case in cases:
        cfg = preset(case["model"], **case.get("overrides", {}))
        batches = global_batches(cfg.vocab_size, case["seq"], case["global_batch"], case["steps"],
                                 seed=case.get("data_seed", 11))
        one = ParallelMesh.single()
        reference = _history(_trainer(one, cfg, case, distributed=None,
                                      micro_batch=case["global_batch"],
                                      global_batch=case["global_batch"],
                                      steps=case["steps"]), batches, one)
        mesh = ParallelMesh.from_sizes(tp=case.get("tp", 1), sp=case.get("sp", 1), pp=case.get("pp", 1),
                                       cp=case.get("cp", 1))
        trainer = _trainer(mesh, cfg, case, distributed=case.get("distributed", {}),
                           global_batch=case["global_batch"], steps=case["steps"])
        candidate = _history(trainer, batches, mesh)
        assert trainer.state.skipped_iterations == (1 if case.get("nan_at") else 0)
        worst = compare(reference, candidate, case["name"])
        got = _check_bytes(trainer.optimizer, mesh) if case.get("bytes") else None
        out.append((case["name"], worst, got))
    return out


def check_16bit_parameters(rank, world):
    """bf16 parameters (not this project's default): fp32 master rows, the parameters their rounding,
    identical on every rank after 3 steps; bytes 2 P_r weights + 2 P_r grads + 4 P_r / n fp32 grad
    rows + 12 P_r / n (Adam + master), exact."""
    cfg = preset(LLAMA["model"], **LLAMA["overrides"])
    mesh = ParallelMesh.from_sizes()
    chunks, schedule = build_chunks(mesh, cfg)
    chunks = [c.to(torch.bfloat16) for c in chunks]
    opt = DistributedOptimizer(chunks, mesh, lr=1e-2, bucket_mb=0.05)
    job = JobConfig.from_flags({"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 16})
    trainer = Trainer(job, mesh, chunks, opt, LRScheduler(opt, 1e-2, 1e-3, 0, 3), schedule=schedule,
                      sharding=opt)
    before = [p.detach().clone() for p in opt.params]
    for batch in global_batches(cfg.vocab_size, 16, 4, 3, seed=1):
        assert not trainer.train_step(micro_batches(batch, 2, mesh.dp_rank, mesh.dp_size)).skipped
    assert all(not torch.equal(b, p) for b, p in zip(before, opt.params))
    for p, master in opt.master.items():
        assert master.dtype == torch.float32 and torch.equal(opt._owned(p), master.to(torch.bfloat16))
    sums = torch.stack([p.detach().double().sum() for p in opt.params])
    assert torch.equal(all_reduce_sum(sums.clone(), opt.group), 2 * sums)
    p_r = sum(p.numel() for p in opt.params)
    got = opt.model_state_bytes(opt)
    assert (got["params_device_bytes"], got["grads_device_bytes"], got["optim_device_bytes"],
            got["host_bytes"]) == (2 * p_r, 2 * p_r + 4 * p_r // 2, 12 * p_r // 2, 0), got


def check_two_rank(rank, world, cases):
    check_16bit_parameters(rank, world)
    return check_distributed_optimizer(rank, world, cases)


def _run(world, cases, fn=check_distributed_optimizer):
    results = run_distributed(fn, world, cases)
    assert [r[0] for r in results[0]] == [c["name"] for c in cases]
    return results


def test_two_rank_layouts():
    common = dict(seq=16, global_batch=4, steps=3)
    _run(2, [
        dict(GPT2, name="gpt2 dp2", micro_batch=1, bytes=True, **common),
        dict(LLAMA, name="llama sp2", sp=2, micro_batch=4, **common),
        dict(LLAMA, name="llama dp2 cpu offload", micro_batch=2, bytes=True,
             distributed=dict(cpu_offload=True), **common),
        dict(GPT2, name="gpt2 dp2 NaN on rank 0 at step 2: skipped on every rank", micro_batch=1,
             nan_at=2, **common),
        dict(GPT2, name="gpt2 dp2 overlap param gather, no clipping", micro_batch=2, clip=0.0,
             distributed=dict(overlap_param_gather=True), **common),
    ], fn=check_two_rank)


def test_four_rank_layouts():
    common = dict(seq=16, global_batch=4, steps=3)
    cases = [
        dict(LLAMA, name="llama sp2 x dp2, ffn 90 (uneven pieces: 23, 23, 23, 21 rows)", sp=2,
             micro_batch=1, bytes=True, overrides=dict(LLAMA["overrides"], ffn_hidden_size=90),
             **common),
        dict(GPT2, name="gpt2 tp2 x sp2", tp=2, sp=2, micro_batch=4, **common),
        dict(LLAMA, name="llama tp2 x dp2 sequence-parallel", tp=2, micro_batch=1,
             sequence_parallel=True, bytes=True, **common),
        dict(GPT2, name="gpt2 pp2 x dp2 (tied embeddings, 1F1B)", pp=2, micro_batch=1, **common),
        dict(LLAMA4, name="llama pp2 x dp2 interleaved", pp=2, micro_batch=1,
             pipeline=dict(virtual=1), **dict(common, global_batch=8)),
        dict(LLAMA, name="llama sp2 x dp2 cpu offload", sp=2, micro_batch=1, bytes=True,
             distributed=dict(cpu_offload=True), **common),
        dict(LLAMA, name="llama ring cp2 x dp2 (Adam state over dp x cp)", cp=2, micro_batch=1,
             bytes=True, **common),
        dict(MOE, name="moe ep2 x sp2 (dp2): experts' Adam state over edp 2", sp=2, micro_batch=1,
             model_kwargs={"expert_parallel_size": 2}, **common),
        dict(MOE, name="moe ep4 over dp2 x sp2 (edp 1)", sp=2, micro_batch=2,
             model_kwargs={"expert_parallel_size": 4}, **common),
        dict(MOE, name="moe tp2 x dp2 --sequence-parallel, etp2 ep2 (experts split over tp)",
             tp=2, micro_batch=1, sequence_parallel=True,
             model_kwargs={"expert_parallel_size": 2, "expert_tensor_parallel_size": 2}, **common),
    ]
    _run(4, cases)


# tp2 x sp2 x pp2 on 8 ranks: EIGHT_RANK_CASE, run in the same spawn as FSDP2's
# (tests/distributed/test_fsdp.py::test_eight_ranks_tp2_sp2_pp2_both_modes).
EIGHT_RANK_CASE = dict(LLAMA, name="llama tp2 x sp2 x pp2 sequence-parallel", tp=2, sp=2, pp=2,
                       micro_batch=2, sequence_parallel=True, bytes=True, seq=16, global_batch=4,
                       steps=3)
