"""Layout equivalence: train the same model in a parallel layout and on one rank, compare.

Every rank of a spawned gloo job trains the one-rank reference locally (a ParallelMesh.single()
model, no communication) and the parallel model on the real mesh, on the same global batches, then
compares per-step losses (1e-5 relative) and full gradients (gathered over tp, and over ep for
expert-parallel experts; 1e-4) after every step. Parameters are initialised layout-independently, so both start from identical weights.

A case's "fp8" (an Fp8Recipe) runs the FP8 linears in both (the one-rank reference with the same
recipe); "sharding" ("fsdp2" | "distopt") trains the candidate under FSDP2 or the distributed
optimizer, compared on losses and gradient norms (its gradients are sharded: not compared).
"""
from __future__ import annotations

import numpy as np
import torch

from megatron_sp.config import JobConfig
from megatron_sp.grad_sync import expert_groups_of
from megatron_sp.mesh import ParallelMesh
from megatron_sp.training.optimizer import LRScheduler, build_optimizer
from megatron_sp.pipeline import chunk_specs, get_forward_backward_func
from megatron_sp.tensor_parallel import gather_full_like
from megatron_sp.tensor_parallel.mappings import gather_along_dim
from megatron_sp.training import Trainer
from megatron_sp.models import GPTModel, preset
from megatron_sp.models.init import init_parameters

LOSS_RTOL = 1e-5
GRAD_ATOL = 1e-4


def document_starts(mix, rng, global_batch: int, seq: int):
    """[b, s] bool, True where a document starts. mix: True (about 4 random documents a row),
    "skewed" (one long document of about 60% of the row at a random place among short ones of
    1-4 tokens, one-token ones included), "short" (documents of 1-6 tokens), "one-token" (every
    token its own document) or "whole" (one document the whole row)."""
    if mix is True:
        starts = rng.random((global_batch, seq)) < 4.0 / seq
    elif mix == "skewed":
        starts = rng.random((global_batch, seq)) < 0.5
        for row in starts:
            first = int(rng.integers(0, seq - int(0.6 * seq) + 1))
            row[first + 1:first + int(0.6 * seq)] = False
            row[first] = True
    elif mix == "short":
        starts = rng.random((global_batch, seq)) < 0.3
    elif mix in ("one-token", "whole"):
        starts = np.full((global_batch, seq), mix == "one-token")
    else:
        raise ValueError(f"unknown document mix {mix!r}")
    starts[:, 0] = True
    return starts


def global_batches(vocab: int, seq: int, global_batch: int, steps: int, seed: int, packed=False):
    """Fresh random samples with random loss masks (some all-zero spans), as numpy. packed: a
    document mix (document_starts) or False."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        text = rng.integers(0, vocab, (global_batch, seq + 1))
        mask = (rng.random((global_batch, seq)) > 0.2).astype(np.float32)
        mask[0, : seq // 2] = 0.0          # a sequence chunk with no unmasked token
        batch = {"tokens": text[:, :-1], "labels": text[:, 1:], "loss_mask": mask,
                 "position_ids": np.tile(np.arange(seq), (global_batch, 1))}
        if packed:   # documents of random lengths, crossing sp chunk boundaries
            starts = document_starts(packed, rng, global_batch, seq)
            doc = np.cumsum(starts, axis=1) - 1
            first = np.maximum.accumulate(np.where(starts, np.arange(seq), 0), axis=1)
            batch["document_ids"] = doc
            batch["position_ids"] = np.arange(seq) - first
        out.append({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()})
    return out


def micro_batches(batch: dict, micro_batch_size: int, dp_rank: int, dp_size: int) -> list[dict]:
    """This dp rank's micro-batches of a global batch, in Megatron's sampler order."""
    n = batch["tokens"].shape[0]
    step = micro_batch_size * dp_size
    out = []
    for start in range(0, n, step):
        lo = start + dp_rank * micro_batch_size
        out.append({k: v[lo:lo + micro_batch_size] for k, v in batch.items()})
    return out


def build_chunks(mesh, config, *, sequence_parallel=False, model_kwargs=None, pipeline=None, seed=7):
    """This stage's model chunks (one unless interleaved) and the schedule of the layout.

    pipeline: {"virtual": layers per virtual stage, "first"/"last": uneven stage sizes}.
    """
    pipeline = pipeline or {}
    specs = chunk_specs(config.num_layers, mesh, layers_per_virtual_stage=pipeline.get("virtual"),
                        first=pipeline.get("first"), last=pipeline.get("last"))
    chunks = []
    for spec in specs:
        chunk = GPTModel(config, mesh, sequence_parallel=sequence_parallel, **spec,
                         **(model_kwargs or {}))
        init_parameters(chunk, seed=seed)
        chunks.append(chunk)
    return chunks, get_forward_backward_func(mesh.pp_size, len(chunks))


def full_gradient(p, mesh):
    """p's gradient at full shape: tp shards gathered (gather_full_like), and expert-parallel
    experts (E/ep rows per ep rank) gathered over the ep group along dim 0."""
    grad = gather_full_like(p.grad, p, mesh.tp_group)
    if getattr(p, "expert_parallel", False) and getattr(p, "ep_size", 1) > 1:
        grad = gather_along_dim(grad, 0, expert_groups_of(mesh, p).ep_group)
    return grad


def train_layout(mesh, config, batches, micro_batch_size, *, sequence_parallel=False, seed=7,
                 model_kwargs=None, lr=1e-3, pipeline=None, fp8=None, sharding=None):
    """Train on `mesh`; return per-step (loss, grad_norm, {name: full gradient}).

    With pipelining each stage reports the gradients of the parameters it holds (names are global);
    the loss and grad norm are global on every rank. fp8: an Fp8Recipe for the FP8 linears;
    sharding: "fsdp2" or "distopt" (then no gradients are reported).
    """
    chunks, schedule = build_chunks(mesh, config, sequence_parallel=sequence_parallel,
                                    model_kwargs=model_kwargs, pipeline=pipeline, seed=seed)
    if fp8 is not None:
        from megatron_sp.training.fp8 import enable_fp8
        assert enable_fp8(chunks, fp8, mesh) > 0
    sharded = None
    if sharding == "distopt":
        from megatron_sp.sharding.distributed_optimizer import DistributedOptimizer
        sharded = optimizer = DistributedOptimizer(chunks, mesh, lr=lr, weight_decay=0.1,
                                                   bucket_mb=0.05)
    else:
        if sharding == "fsdp2":
            from megatron_sp.sharding.fsdp import apply_fsdp2
            sharded = apply_fsdp2(chunks, mesh)
        optimizer = build_optimizer(chunks, lr=lr, weight_decay=0.1)
    scheduler = LRScheduler(optimizer, lr, lr / 10, warmup_iters=1, decay_iters=len(batches),
                            style="cosine")
    global_batch = batches[0]["tokens"].shape[0]
    job = JobConfig.from_flags({"global_batch_size": global_batch,
                                "micro_batch_size": micro_batch_size,
                                "seq_length": batches[0]["tokens"].shape[1],
                                "clip_grad": 1.0, "grad_bucket_size_mb": 0.05})
    trainer = Trainer(job, mesh, chunks, optimizer, scheduler, schedule=schedule, sharding=sharded)
    history = []
    for batch in batches:
        result = trainer.train_step(micro_batches(batch, micro_batch_size, mesh.dp_rank, mesh.dp_size))
        grads = {} if sharded is not None else {
            name: full_gradient(p, mesh) for chunk in chunks for name, p in chunk.named_parameters()}
        history.append((result.loss, result.grad_norm, grads))
    return history


def compare(reference, candidate, what: str, loss_rtol=LOSS_RTOL, grad_atol=GRAD_ATOL):
    """Assert per-step losses and every full gradient agree; returns the worst differences."""
    worst_loss, worst_grad = 0.0, 0.0
    for step, ((l0, n0, g0), (l1, n1, g1)) in enumerate(zip(reference, candidate)):
        rel = abs(l1 - l0) / max(abs(l0), 1e-12)
        assert rel <= loss_rtol, f"{what}: step {step} loss {l1} vs one rank {l0} (rel {rel:.2e})"
        for name, g in g1.items():
            ref = g0[name]
            if name.startswith("embedding.word_embeddings") or name.startswith("output_layer"):
                rows = min(ref.shape[0], g.shape[0])     # padded vocab differs with tp
                ref, g = ref[:rows], g[:rows]
            diff = (g - ref).abs().max().item()
            assert diff <= grad_atol, f"{what}: step {step} gradient of {name} differs by {diff:.2e}"
            worst_grad = max(worst_grad, diff)
        assert abs(n1 - n0) <= 1e-4 * max(1.0, n0), f"{what}: step {step} grad norm {n1} vs {n0}"
        worst_loss = max(worst_loss, rel)
    assert len(candidate) == len(reference) > 0
    return worst_loss, worst_grad


def check_layouts(rank, world, cases):
    """Run each (name, preset overrides, tp, sp, cp, pp, pipeline, micro_batch, sequence_parallel,
    packed, model_kwargs, fp8, sharding) case."""
    torch.manual_seed(1000 + rank)
    results = []
    for case in cases:
        cfg = preset(case["model"], **case.get("overrides", {}))
        batches = global_batches(cfg.vocab_size, case["seq"], case["global_batch"], case["steps"],
                                 seed=case.get("data_seed", 11), packed=case.get("packed", False))
        reference = train_layout(ParallelMesh.single(), cfg, batches, case["global_batch"],
                                 fp8=case.get("reference_fp8", case.get("fp8")))
        mesh = ParallelMesh.from_sizes(tp=case.get("tp", 1), sp=case.get("sp", 1),
                                       pp=case.get("pp", 1), cp=case.get("cp", 1))
        candidate = train_layout(mesh, cfg, batches, case["micro_batch"],
                                 sequence_parallel=case.get("sequence_parallel", False),
                                 pipeline=case.get("pipeline"), model_kwargs=case.get("model_kwargs"),
                                 fp8=case.get("fp8"), sharding=case.get("sharding"))
        results.append((case["name"],) + compare(reference, candidate, case["name"]))
    return results
