#!/usr/bin/env python
"""Model-state bytes per rank and step time of each sharding mode over dp x sp (docs/design.md §11), on CPU.

For dp x sp = 1, 2 (dp2) and 4 (sp2 x dp2), every mode trains the same model in the same gloo job:
- none: replicated state (today's bucketed all-reduce);
- distributed optimizer (--use-distributed-optimizer), and with --optimizer-cpu-offload;
- FSDP2 (--use-torch-fsdp2), and with --optimizer-cpu-offload.
Bytes are measured on rank 0 from the tensors themselves (the Trainer's sharding.model_state_bytes,
as --report-memory prints them) after a step, next to the formula of docs/design.md §11 (P_r parameters per
(tp, pp) slice, n = dp*sp): none 16 P_r | distributed optimizer 8 P_r + 8 P_r / n (offload: 8 P_r,
host 16 P_r / n) | FSDP2 16 P_r / n (offload: host 16 P_r / n). Rows are cut in ceil(rows / n)
pieces, so rank 0 may hold slightly more than 1/n. On a CPU "host" and "device" are the same
memory: the offload rows show the split, not a saving, and their time the extra copies.
Step time: the modes take turns, one step each, for --rounds rounds; the median of each mode divided
by the median of "none" at the same layout (on a CPU, with one thread per rank, comm is cheap and
FSDP2's extra all-gathers show up as Python/launch overhead, not bandwidth).

    python bench/sharded_state.py [--model llama-tiny] [--seq 256] [--rounds 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "distributed"))

from megatron_sp.config import JobConfig                       # noqa: E402
from megatron_sp.mesh import ParallelMesh                      # noqa: E402
from megatron_sp.models import preset                          # noqa: E402
from megatron_sp.training.optimizer import LRScheduler, build_optimizer  # noqa: E402
from megatron_sp.sharding.distributed_optimizer import DistributedOptimizer   # noqa: E402
from megatron_sp.sharding.fsdp import apply_fsdp2              # noqa: E402
from megatron_sp.testing import run_distributed                # noqa: E402
from megatron_sp.training import Trainer                       # noqa: E402

from layout_utils import build_chunks, global_batches, micro_batches   # noqa: E402

MODES = ("none", "distributed optimizer", "distributed optimizer + offload", "FSDP2",
         "FSDP2 + offload")


def _trainer(mesh, cfg, mode, seq, global_batch):
    chunks, schedule = build_chunks(mesh, cfg)
    offload = mode.endswith("offload")
    sharding = apply_fsdp2(chunks, mesh, cpu_offload=offload) if mode.startswith("FSDP2") else None
    if mode.startswith("distributed optimizer"):       # the optimizer and the sharding
        sharding = optimizer = DistributedOptimizer(chunks, mesh, lr=1e-4, weight_decay=0.1,
                                                    cpu_offload=offload)
    else:
        optimizer = build_optimizer(chunks, lr=1e-4, weight_decay=0.1)
    scheduler = LRScheduler(optimizer, 1e-4, 1e-5, warmup_iters=1, decay_iters=1000)
    job = JobConfig.from_flags({"global_batch_size": global_batch,
                                "micro_batch_size": global_batch // mesh.dp_size, "seq_length": seq})
    return Trainer(job, mesh, chunks, optimizer, scheduler, schedule=schedule, sharding=sharding)


def _formula(mode, p_r, n) -> tuple[int, int]:
    """(device, host) bytes per rank from docs/design.md §11."""
    return {"none": (16 * p_r, 0),
            "distributed optimizer": (8 * p_r + 8 * p_r // n, 0),
            "distributed optimizer + offload": (8 * p_r, 16 * p_r // n),
            "FSDP2": (16 * p_r // n, 0),
            "FSDP2 + offload": (0, 16 * p_r // n)}[mode]


def _run(rank, world, model, sp, seq, global_batch, rounds):
    torch.manual_seed(rank)
    cfg = preset(model)
    mesh = ParallelMesh.from_sizes(sp=sp)
    trainers = {m: _trainer(mesh, cfg, m, seq, global_batch) for m in MODES}
    batches = global_batches(cfg.vocab_size, seq, global_batch, rounds + 1, seed=5)
    times = {m: [] for m in MODES}
    for step, batch in enumerate(batches):
        mbs = micro_batches(batch, global_batch // mesh.dp_size, mesh.dp_rank, mesh.dp_size)
        for m in MODES:                         # interleaved: every mode sees the same load
            start = time.perf_counter()
            trainers[m].train_step(mbs)
            if step:                            # the first step is warm-up
                times[m].append(time.perf_counter() - start)
    p_r = sum(p.numel() for p in trainers["none"].chunks[0].parameters())
    rows = []
    for m in MODES:
        measured = trainers[m].sharding.model_state_bytes(trainers[m].optimizer)
        rows.append((m, measured["device_bytes"], measured["host_bytes"],
                     *_formula(m, p_r, mesh.dp_size * mesh.sp_size), statistics.median(times[m])))
    return p_r, rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    layouts = [("1", 1, 1), ("2 (dp2)", 2, 1), ("4 (sp2 x dp2)", 4, 2)]
    print(f"model {args.model}, seq {args.seq}, global batch {args.global_batch}, fp32, CPU gloo, "
          f"one thread per rank; bytes on rank 0 after a step; step time median of {args.rounds} "
          f"interleaved steps")
    print("\n| dp x sp | mode | device MB (measured) | device MB (design §11) | host MB (measured) "
          "| host MB (design §11) | step time vs none |")
    print("|---|---|---|---|---|---|---|")
    for name, world, sp in layouts:
        p_r, rows = run_distributed(_run, world, args.model, sp, args.seq, args.global_batch,
                                    args.rounds, timeout_s=900)[0]
        base = rows[0][5]
        for mode, dev, host, f_dev, f_host, seconds in rows:
            print(f"| {name} | {mode} | {dev / 2**20:.2f} | {f_dev / 2**20:.2f} | "
                  f"{host / 2**20:.2f} | {f_host / 2**20:.2f} | {seconds / base:.2f} |", flush=True)
    print(f"\nP_r = {p_r} parameters per (tp, pp) slice.")


if __name__ == "__main__":
    main()
