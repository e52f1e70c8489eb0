"""--use-torch-fsdp2 (and --optimizer-cpu-offload) against the same model on one rank (docs/design.md §8, §11).

Every rank trains the one-rank reference locally and the FSDP2-sharded model on the real mesh, on
the same fresh seeded batches, for 3 optimizer steps, and compares after every step:
- the loss (1e-5 relative) and the global gradient norm (1e-4 relative);
- every full gradient and every updated parameter (gathered over dp x sp, then tp): 1e-4 absolute;
- with --bf16 (bf16 gathered parameters and bf16 gradients on the wire) against the fp32
  reference: loss 2e-2 relative, gradients and parameters 1e-2 absolute (bf16 has 8 mantissa bits;
  measured worst difference 2.1e-3).
The per-rank model-state bytes measured from the tensors (local shards) equal the formula of docs/design.md §11
exactly: 16 P_r / n on the device (0 on the host); with CPU offload 0 on the device, 16 P_r / n on
the host (P_r: parameters of the rank's (tp, pp) slice, n = dp*sp; every dim 0 divides by n here,
so FSDP2 pads nothing and the shards are equal).
Checkpoints across all modes: saved unsharded, with the distributed optimizer and under FSDP2 in
sp2 x dp2, each loads into each other mode (sharded targets also with CPU offload) in tp2 x dp2 with
bit-identical full parameters and Adam moments; FSDP2's files hold the full tensors; a resumed run
continues with bit-identical losses under FSDP2 and under the distributed optimizer.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_sp.checkpointing import load_checkpoint, save_checkpoint
from megatron_sp.config import JobConfig
from megatron_sp.grad_sync import all_reduce_sum, expert_groups_of, is_expert_parallel
from megatron_sp.memory import MemoryOptions
from megatron_sp.mesh import ParallelMesh
from megatron_sp.models import preset
from megatron_sp.training.optimizer import LRScheduler, build_optimizer
from megatron_sp.sharding.distributed_optimizer import DistributedOptimizer
from megatron_sp.sharding.fsdp import apply_fsdp2, full_tensor
from megatron_sp.tensor_parallel import gather_full_like
from megatron_sp.tensor_parallel.mappings import gather_along_dim
from megatron_sp.testing import FaultInjection, assert_same_curve, run_distributed, run_script
from megatron_sp.training import Trainer

from layout_utils import build_chunks, global_batches, micro_batches
from library_helpers import read_full_tensors

LOSS_RTOL, ATOL = 1e-5, 1e-4
BF16_LOSS_RTOL, BF16_ATOL = 2e-2, 1e-2
SMALL_LLAMA = {"hidden_size": 128, "ffn_hidden_size": 352}   # llama-tiny, narrower: faster tests
SEQ, GLOBAL_BATCH, STEPS = 32, 8, 3
# Mixture of experts (--num-experts 4, top 2, a shared expert): seq_aux_loss, whose mean over
# sequences is what data parallelism averages, so every layout equals one rank.
MOE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
           ffn_hidden_size=96, vocab_size=300, num_experts=4, moe_ffn_hidden_size=32,
           moe_router_topk=2, moe_aux_loss_coeff=1.0, moe_z_loss_coeff=0.1,
           moe_router_load_balancing_type="seq_aux_loss", moe_shared_expert_intermediate_size=48)


def _trainer(mesh, cfg, micro_batch, *, fsdp=None, distopt=None, sequence_parallel=False,
             pipeline=None, memory=None, seed=7, flags=None, step_hooks=(), model_kwargs=None):
    """fsdp / distopt: the keyword arguments of apply_fsdp2 / DistributedOptimizer (None: not);
    flags: more JobConfig flags; step_hooks: the Trainer's; model_kwargs: more GPTModel
    arguments (expert_parallel_size)."""
    chunks, schedule = build_chunks(mesh, cfg, sequence_parallel=sequence_parallel,
                                    pipeline=pipeline, seed=seed,
                                    model_kwargs={"memory": MemoryOptions(**(memory or {})),
                                                  **(model_kwargs or {})})
    sharding = apply_fsdp2(chunks, mesh, **fsdp) if fsdp is not None else None
    if distopt is not None:
        sharding = optimizer = DistributedOptimizer(chunks, mesh, lr=1e-3, weight_decay=0.1,
                                                    bucket_mb=0.05, **distopt)
    else:
        optimizer = build_optimizer(chunks, lr=1e-3, weight_decay=0.1)
    scheduler = LRScheduler(optimizer, 1e-3, 1e-4, warmup_iters=1, decay_iters=STEPS, style="cosine")
    job = JobConfig.from_flags({"global_batch_size": GLOBAL_BATCH, "micro_batch_size": micro_batch,
                                "seq_length": SEQ, "clip_grad": 1.0, "grad_bucket_size_mb": 0.05,
                                "bf16": bool(fsdp and fsdp.get("bf16")), **(flags or {})})
    return Trainer(job, mesh, chunks, optimizer, scheduler, schedule=schedule, sharding=sharding,
                   step_hooks=step_hooks)


def _full(tensor, param, mesh):
    """The full tensor of a parameter-shaped tensor: over dp x sp (FSDP2; an ep rank's experts
    over their edp group), then over tp, then expert-parallel experts over ep (E/ep rows each)."""
    full = gather_full_like(full_tensor(tensor), param, mesh.tp_group)
    if is_expert_parallel(param):
        full = gather_along_dim(full.contiguous(), 0, expert_groups_of(mesh, param).ep_group)
    return full


def _train(trainer, batches, mesh):
    """Per step: (loss, grad norm, {name: full gradient}, {name: full updated parameter})."""
    history = []
    for batch in batches:
        micro_batch = GLOBAL_BATCH // (trainer.num_micro_batches * mesh.dp_size)
        mbs = micro_batches(batch, micro_batch, mesh.dp_rank, mesh.dp_size)
        result = trainer.train_step(mbs)
        named = [(n, p) for c in trainer.chunks for n, p in c.named_parameters()]
        history.append((result.loss, result.grad_norm,
                        {n: _full(p.grad, p, mesh) for n, p in named},
                        {n: _full(p.detach(), p, mesh) for n, p in named}))
    return history


def _compare(ref, cand, what, loss_rtol=LOSS_RTOL, atol=ATOL):
    worst = 0.0
    assert len(ref) == len(cand) == STEPS
    for step, ((l0, n0, g0, p0), (l1, n1, g1, p1)) in enumerate(zip(ref, cand)):
        assert abs(l1 - l0) <= loss_rtol * abs(l0), f"{what}: step {step} loss {l1} vs {l0}"
        assert abs(n1 - n0) <= max(loss_rtol, 1e-4) * max(1.0, n0), f"{what}: norm {n1} vs {n0}"
        for kind, a, b in (("gradient", g0, g1), ("parameter", p0, p1)):
            assert set(b) <= set(a) and b, f"{what}: parameter names differ"
            for name, t in b.items():
                r = a[name]
                rows = min(r.shape[0], t.shape[0])      # the padded vocabulary differs with tp
                diff = (t[:rows].float() - r[:rows].float()).abs().max().item()
                assert diff <= atol, f"{what}: step {step} {kind} of {name} differs by {diff:.2e}"
                worst = max(worst, diff)
    return worst


def _state_bytes_formula(trainer, mesh, offloaded):
    """docs/design.md §11: 16 P_r / n per rank (on the host with offload), P_r the (tp, pp) slice;
    an ep rank's experts (P_e of its E/ep experts) over their edp group instead: 16 P_e / edp."""
    params = [p for c in trainer.chunks for p in c.parameters()]   # DTensor numel: slice shape
    p_r = sum(p.numel() for p in params if not is_expert_parallel(p))
    n = mesh.dp_size * mesh.sp_size * mesh.cp_size       # dp x (the whole context: sp x cp)
    sharded = 16 * p_r // n
    for p in params:
        if is_expert_parallel(p):
            sharded += 16 * p.numel() // expert_groups_of(mesh, p).edp
    return {"device_bytes": 0 if offloaded else sharded, "host_bytes": sharded if offloaded else 0}


def _check_cases(rank, world, cases):
    torch.manual_seed(100 + rank)
    results, references = [], {}
    for case in cases:
        cfg = preset(case["model"], **case.get("overrides", {}))
        batches = global_batches(cfg.vocab_size, SEQ, GLOBAL_BATCH, STEPS, seed=case["seed"])
        key = (case["model"], case["seed"], tuple(sorted(case.get("memory", {}).items())),
               tuple(sorted(case.get("overrides", {}).items())))
        if key not in references:
            references[key] = _train(_trainer(ParallelMesh.single(), cfg, GLOBAL_BATCH,
                                              memory=case.get("memory")),
                                     batches, ParallelMesh.single())
        mesh = ParallelMesh.from_sizes(tp=case.get("tp", 1), sp=case.get("sp", 1),
                                       pp=case.get("pp", 1), cp=case.get("cp", 1))
        fsdp = case.get("fsdp", {})
        trainer = _trainer(mesh, cfg, case["micro_batch"], fsdp=fsdp,
                           sequence_parallel=case.get("sequence_parallel", False),
                           pipeline=case.get("pipeline"), memory=case.get("memory"),
                           model_kwargs=case.get("model_kwargs"))
        candidate = _train(trainer, batches, mesh)
        tol = (BF16_LOSS_RTOL, BF16_ATOL) if fsdp.get("bf16") else (LOSS_RTOL, ATOL)
        worst = _compare(references[key], candidate, case["name"], *tol)
        if case.get("check_bytes"):
            measured = trainer.sharding.model_state_bytes(trainer.optimizer)
            expected = _state_bytes_formula(trainer, mesh, fsdp.get("cpu_offload", False))
            got = {k: measured[k] for k in expected}
            assert got == expected, f"{case['name']}: model-state bytes {got} != formula {expected}"
        results.append((case["name"], worst))
    return results


def _full_moment(trainer, p, key, mesh):
    """The full Adam moment `key` of parameter p: the distributed optimizer's owned rows of every
    rank summed over dp x sp (zeros elsewhere: exact), FSDP2's DTensor gathered, then over tp."""
    opt = trainer.optimizer
    if not isinstance(opt, DistributedOptimizer):
        return _full(opt.state[p][key], p, mesh)
    full = torch.zeros_like(p.detach())
    if p in opt.master:
        opt.pieces[p].piece(full, opt.rank).copy_(opt.state[opt.master[p]][key])
    return gather_full_like(all_reduce_sum(full, opt.group), p, mesh.tp_group)


def _full_state(trainer, mesh):
    """{name: full parameter}, {name/moment: full Adam moment} of a trainer, gathered."""
    params, moments = {}, {}
    for chunk in trainer.chunks:
        for name, p in chunk.named_parameters():
            params[name] = _full(p.detach(), p, mesh)
            for key in ("exp_avg", "exp_avg_sq"):
                moments[f"{name}/{key}"] = _full_moment(trainer, p, key, mesh)
    return params, moments


def _assert_identical(a: dict, b: dict, what: str):
    assert a.keys() == b.keys() and a, f"{what}: names differ"
    for name, t in a.items():
        u = b[name]
        if t.shape != u.shape:   # the stored layout: fused parts [c, n/c, ...], unpadded vocabulary
            rows = min(t.shape[0], u.shape[0])
            t, u = (t.reshape(u.shape), u) if t.numel() == u.numel() else (t[:rows], u[:rows])
        assert torch.equal(t, u), f"{what}: {name} is not bit-identical"


MODES = {"unsharded": {}, "distributed optimizer": {"distopt": {}}, "FSDP2": {"fsdp": {}}}
OFFLOAD = {"distributed optimizer": {"distopt": {"cpu_offload": True}},
           "FSDP2": {"fsdp": {"cpu_offload": True}}}


def _check_checkpoints(rank, world, folder):
    """Save in each mode (sp2 x dp2), load into each other mode (tp2 x dp2), sharded targets
    without and with CPU offload: full parameters and Adam moments bit-identical; FSDP2's files
    hold the full tensors; exact resume under FSDP2 and under the distributed optimizer."""
    torch.manual_seed(200 + rank)
    cfg = preset("llama-tiny", **SMALL_LLAMA)
    batches = global_batches(cfg.vocab_size, SEQ, GLOBAL_BATCH, STEPS, seed=21)
    sp2dp2, tp2dp2 = ParallelMesh.from_sizes(sp=2), ParallelMesh.from_sizes(tp=2)

    def load(trainer, mesh, path):
        load_checkpoint(path, trainer.chunks, mesh, optimizer=trainer.optimizer,
                        scheduler=trainer.scheduler, train_state=trainer.state, config=cfg,
                        load_rng=False, missing_ok=False)
        return trainer

    saved = {}
    for mode, kwargs in MODES.items():
        trainer = _trainer(sp2dp2, cfg, 2, **kwargs)
        _train(trainer, batches[:2], sp2dp2)
        path = save_checkpoint(os.path.join(folder, mode.replace(" ", "_")), 2, trainer.chunks,
                               sp2dp2, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                               train_state=trainer.state, config=cfg)
        saved[mode] = (trainer, path, _full_state(trainer, sp2dp2))
    # The files hold the full tensors (read in one process, no process group).
    _, path, (params, moments) = saved["FSDP2"]
    _assert_identical(params, read_full_tensors(path), "FSDP2 save -> files")
    stored = read_full_tensors(path, prefix="optim/")
    _assert_identical(moments, {k: v for k, v in stored.items() if not k.endswith("/step")},
                      "FSDP2 save -> files (Adam moments)")
    # Every mode -> every other mode (and its offloaded variant), in another layout.
    hops = 0
    for source, (_, path, (params, moments)) in saved.items():
        targets = [(m, MODES[m]) for m in MODES if m != source]
        targets += [(m + " + offload", OFFLOAD[m]) for m in OFFLOAD if m != source]
        for target, kwargs in targets:
            loaded = load(_trainer(tp2dp2, cfg, 2, seed=99, **kwargs), tp2dp2, path)
            got_params, got_moments = _full_state(loaded, tp2dp2)
            _assert_identical(got_params, params, f"{source} -> {target} tp2 x dp2")
            _assert_identical(got_moments, moments, f"{source} -> {target} tp2 x dp2 (Adam)")
            hops += 1
    # Exact resume in each sharded mode: the third step of the saved run and of the resumed one.
    for mode in OFFLOAD:
        trainer, path, _ = saved[mode]
        resumed = load(_trainer(sp2dp2, cfg, 2, seed=99, **MODES[mode]), sp2dp2, path)
        (l0, n0, _, p0), = _train(trainer, batches[2:], sp2dp2)
        (l1, n1, _, p1), = _train(resumed, batches[2:], sp2dp2)
        assert (l1, n1) == (l0, n0), f"{mode} resume: loss/norm {(l1, n1)} != {(l0, n0)}"
        _assert_identical(p1, p0, f"{mode} resume: updated parameters")
    return hops


def _check_nonfinite_skip(rank, world):
    """A NaN loss at iteration 2 (rank 0 only) skips that step on every rank under FSDP2: the
    sharded parameters and Adam moments stay bit-identical, and iteration 3 trains normally."""
    cfg = preset("gpt2-tiny")
    mesh = ParallelMesh.from_sizes()
    batches = global_batches(cfg.vocab_size, SEQ, GLOBAL_BATCH, STEPS, seed=31)
    trainer = _trainer(mesh, cfg, 2, fsdp={}, flags={"nonfinite_loss": "skip"},
                       step_hooks=[FaultInjection(mesh.rank,
                                                  environ={"MEGATRON_SP_INJECT_NAN_AT_ITER": "2"})])
    results = []
    for i, batch in enumerate(batches):
        results.append(trainer.train_step(micro_batches(batch, 2, mesh.dp_rank, mesh.dp_size)))
        if i == 0:
            before = _full_state(trainer, mesh)
        if i == 1:
            after = _full_state(trainer, mesh)
    assert [r.skipped for r in results] == [False, True, False], results
    _assert_identical(after[0], before[0], "skipped step: parameters")
    _assert_identical(after[1], before[1], "skipped step: Adam moments")
    assert trainer.state.skipped_iterations == 1 and results[2].loss == results[2].loss
    return True


def _two_rank_checks(rank, world, cases):
    return _check_cases(rank, world, cases), _check_nonfinite_skip(rank, world)


def _four_rank_checks(rank, world, cases, folder):
    return _check_cases(rank, world, cases), _check_checkpoints(rank, world, folder)


def _case(name, model, seed, micro_batch, **kw):
    return dict(name=name, model=model, seed=seed, micro_batch=micro_batch, **kw)


@pytest.mark.timeout(200)
def test_fsdp2_two_ranks_dp2_sp2_offload_nonfinite_skip():
    cases = [
        _case("dp2 gpt2", "gpt2-tiny", 1, 2, check_bytes=True),      # 2 micro-batches per rank
        _case("sp2 llama (GQA)", "llama-tiny", 2, 4, sp=2, check_bytes=True, overrides=SMALL_LLAMA),
        _case("dp2 gpt2 + cpu offload", "gpt2-tiny", 1, 4, fsdp={"cpu_offload": True},
              check_bytes=True),
    ]
    for rank_results, skipped in run_distributed(_two_rank_checks, 2, cases):
        assert [name for name, _ in rank_results] == [c["name"] for c in cases] and skipped


@pytest.mark.timeout(300)
def test_fsdp2_four_ranks_layouts_memory_bf16_checkpoints(tmp_path):
    cases = [
        _case("sp2 x dp2 gpt2", "gpt2-tiny", 3, 2, sp=2, check_bytes=True),
        _case("sp2 x dp2 llama + cpu offload", "llama-tiny", 4, 4, sp=2,
              fsdp={"cpu_offload": True}, check_bytes=True, overrides=SMALL_LLAMA),
        _case("tp2 x sp2 llama + full recompute, tiled mlp, chunked loss", "llama-tiny", 5, 4,
              tp=2, sp=2, memory={"recompute_granularity": "full", "mlp_tiles": 2,
                                  "loss_chunks": 2}, check_bytes=True, overrides=SMALL_LLAMA),
        _case("tp2 x dp2 --sequence-parallel gpt2 + selective, activation offload", "gpt2-tiny", 6,
              2, tp=2, sequence_parallel=True,
              memory={"recompute_granularity": "selective", "offload_activations": True}),
        _case("pp2 x dp2 gpt2 (1F1B, tied embeddings)", "gpt2-tiny", 7, 1, pp=2, check_bytes=True),
        _case("pp2 x dp2 llama (interleaved)", "llama-tiny", 8, 2, pp=2,
              pipeline={"virtual": 1}, overrides=SMALL_LLAMA),
        _case("sp2 x dp2 gpt2 --bf16", "gpt2-tiny", 3, 2, sp=2, fsdp={"bf16": True}),
        _case("ring cp2 x dp2 llama (sharded over dp x cp)", "llama-tiny", 9, 2, cp=2,
              check_bytes=True, overrides=SMALL_LLAMA),
        _case("moe ep2 x sp2 (dp2): each ep rank's experts over its edp 2", "llama-tiny", 10, 1,
              sp=2, check_bytes=True, overrides=MOE, model_kwargs={"expert_parallel_size": 2}),
        _case("moe ep4 over dp2 x sp2 (edp 1) + cpu offload", "llama-tiny", 11, 2, sp=2,
              fsdp={"cpu_offload": True}, check_bytes=True, overrides=MOE,
              model_kwargs={"expert_parallel_size": 4}),
        _case("moe tp2 x sp2 --sequence-parallel, ep2 folded over tp", "llama-tiny", 12, 4, tp=2,
              sp=2, sequence_parallel=True, check_bytes=True, overrides=MOE,
              model_kwargs={"expert_parallel_size": 2, "expert_tensor_parallel_size": 1}),
        _case("moe tp2 x dp2 --sequence-parallel, etp2 ep2 (experts split over tp)", "llama-tiny",
              13, 2, tp=2, sequence_parallel=True, check_bytes=True, overrides=MOE,
              model_kwargs={"expert_parallel_size": 2, "expert_tensor_parallel_size": 2}),
    ]
    outputs = run_distributed(_four_rank_checks, 4, cases, str(tmp_path))
    print("worst full gradient / parameter difference per case:", outputs[0][0])
    for rank_results, hops in outputs:
        assert [name for name, _ in rank_results] == [c["name"] for c in cases]
        assert hops == 10     # from unsharded 4 targets, from each sharded mode 3


def _eight_rank_checks(rank, world, cases):
    """FSDP2's cases and the distributed optimizer's tp2 x sp2 x pp2 case in one spawn (8 ranks
    cost ~9 s to start)."""
    from test_distributed_optimizer import EIGHT_RANK_CASE, check_distributed_optimizer
    return _check_cases(rank, world, cases), check_distributed_optimizer(rank, world,
                                                                         [EIGHT_RANK_CASE])


@pytest.mark.timeout(300)
def test_eight_ranks_tp2_sp2_pp2_both_modes():
    cases = [_case("tp2 x sp2 x pp2 llama", "llama-tiny", 9, 4, tp=2, sp=2, pp=2,
                   sequence_parallel=True, overrides=dict(SMALL_LLAMA, num_layers=2))]
    for fsdp_results, distopt_results in run_distributed(_eight_rank_checks, 8, cases,
                                                         timeout_s=280):
        assert [name for name, _ in fsdp_results] == [c["name"] for c in cases]
        assert [name for name, *_ in distopt_results] == ["llama tp2 x sp2 x pp2 sequence-parallel"]


TORCHRUN_ARGS = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
                 "--num-attention-heads", "8", "--num-query-groups", "4", "--swiglu",
                 "--position-embedding-type", "rope", "--normalization", "RMSNorm",
                 "--disable-bias-linear", "--seq-length", "32", "--micro-batch-size", "2",
                 "--global-batch-size", "8", "--train-iters", "4", "--log-interval", "1",
                 "--eval-iters", "1", "--eval-interval", "4", "--lr", "1e-3",
                 "--distributed-backend", "gloo", "--attention-dropout", "0", "--hidden-dropout", "0"]


@pytest.mark.timeout(300)
def test_pretrain_torchrun_sp2_dp2_fsdp2_offload_matches_one_rank(tmp_path):
    """The metrics curve (4 training losses, 1 validation loss) of sp2 x dp2 with
    --use-torch-fsdp2 --optimizer-cpu-offload equals the one-rank curve to 1e-5 relative; its
    --report-memory record holds the sharded state on the host, none on the device."""
    runs = {"one": (1, []),
            "fsdp": (4, ["--sequence-parallel-size", "2", "--use-torch-fsdp2",
                         "--optimizer-cpu-offload", "--report-memory"])}
    outputs = {}
    for name, (nproc, extra) in runs.items():   # ranks forked (run_script), not torchrun's
        rcs, outputs[name] = run_script("pretrain_gpt.py", TORCHRUN_ARGS + extra + [
            "--metrics-jsonl", str(tmp_path / f"{name}.jsonl")], world=nproc, timeout_s=280)
        assert rcs == [0] * nproc, f"{name}:\n{outputs[name][-4000:]}"
    assert "model state per rank (MB): device 0.0 " in outputs["fsdp"], outputs["fsdp"][-2000:]
    assert_same_curve(tmp_path / "one.jsonl", tmp_path / "fsdp.jsonl", train=4, valid=1)
    with open(tmp_path / "fsdp.jsonl") as f:
        record = json.loads(f.readline())
    assert record["model_state_device_bytes"] == 0 and record["model_state_host_bytes"] > 0
