#!/usr/bin/env python
"""Ring layouts for skewed document mixes: the whole-row zigzag against the document-aware
balanced layout (megatron_sp/context_parallel/balance.py; docs/design.md §14).

Plan (pure computation, no process group), per document mix x row length s x ring degree cp,
over --rows rows of each (every row its own layout, as a micro-batch of one row):

  balance     max over ring ranks of the causal (query, key) pairs / their mean (cp_work_balance;
              the query of offset t in its document has t + 1 keys), worst row and all rows summed;
              per step: the sum over ring steps of the slowest rank's pairs at that step over the
              mean total (a ring whose every step waits for its slowest rank)
  ring bytes  forward key/value bytes per attention layer, all ranks together, llama-8b's
              g = 8 kv heads x d = 128 in bf16 (4 KiB of k and v a token): the zigzag ring sends
              every rank's whole block cp - 1 hops, (cp - 1) s tokens; the balanced ring only
              the keys another rank's queries attend (CpLayout.travelling_tokens: a short
              document held whole by one rank needs none), (cp - 1) x those (before padding
              the rows of a micro-batch to one block length)
  plan ms     one balanced layout + one rank's ring plan, this CPU

Mixes (document lengths drawn from a generator seeded by the mix, s and the row):
  one long (60%) + short   one document of 60% of the row at a random place, short ones of
                           64..2047 tokens around it
  lognormal (median 1K)    lengths lognormal(ln 1024, 1.0)
  short, then one long     short ones of 64..1023 tokens for half the row, then one document
  long + lognormal short   one document of 30..90% of the row among lognormal(ln 256, 1.2) ones
                           (what a real .bin/.idx of web text with a book in it gives)
  uniform short            32..511 tokens (hundreds of short ones: both layouts balance it)

Measured step (--step SEQ ...): pretrain_gpt.py at --context-parallel-size 2 under torchrun (2
gloo ranks on this CPU, one thread each), a 1-layer GQA model, on a .bin/.idx corpus of skewed
documents (each row: long documents of 40..80% of the row among lognormal short ones, each
ending in the NullTokenizer's eod) with --reset-attention-mask --reset-position-ids: the
median "elapsed time per iteration" after the first iteration, the slowest rank's CPU time per
step (its main thread's, bench/step_cpu_time.py: what the ranks computed, whatever the load of
other jobs on the machine) and the logged cp_work_balance, --context-parallel-layout zigzag
against balanced, the launches interleaved (--reps each).

    python bench/cp_layouts.py                        # the plan table (~1 min)
    python bench/cp_layouts.py --step 16384 --reps 2  # plus the measured cp-2 step (~15 min)

Results: bench/results/context_parallel_layouts_cpu.json (plan) and
context_parallel_layout_step_cpu.json (measured), tables in docs/performance.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from megatron_sp.context_parallel.balance import (cp_layout, layout_ring_plan,  # noqa: E402
                                                  work_balance)

KV_BYTES_PER_TOKEN = 2 * 8 * 128 * 2        # k and v, 8 kv heads x 128, bf16 (llama-8b)
SKEWED = ("one long (60%) + short", "long + lognormal short")
MIXES = ("one long (60%) + short", "lognormal (median 1K)", "short, then one long",
         "long + lognormal short", "uniform short")


def _fill(s, lengths, draw):
    while sum(lengths) < s:
        lengths.append(max(1, int(draw())))
    lengths[-1] -= sum(lengths) - s
    return [m for m in lengths if m > 0]


def mix_lengths(mix: str, s: int, row: int) -> list[int]:
    """One row's document lengths of a mix (module docstring), seeded by (mix, s, row)."""
    rng = np.random.default_rng([MIXES.index(mix), s, row])
    if mix == "one long (60%) + short":
        long = int(0.6 * s)
        before = _fill(int(rng.integers(0, s - long + 1)), [], lambda: rng.integers(64, 2048))
        return before + [long] + _fill(s - long - sum(before), [], lambda: rng.integers(64, 2048))
    if mix == "lognormal (median 1K)":
        return _fill(s, [], lambda: rng.lognormal(np.log(1024), 1.0))
    if mix == "short, then one long":
        short = _fill(s // 2, [], lambda: rng.integers(64, 1024))
        return short + [s - sum(short)]
    if mix == "long + lognormal short":
        long = int(rng.uniform(0.3, 0.9) * s)
        before = _fill(int(rng.integers(0, s - long + 1)), [],
                       lambda: rng.lognormal(np.log(256), 1.2))
        return before + [long] + _fill(s - long - sum(before), [],
                                       lambda: rng.lognormal(np.log(256), 1.2))
    if mix == "uniform short":
        return _fill(s, [], lambda: rng.integers(32, 512))
    raise ValueError(f"unknown mix {mix!r}: one of {MIXES}")


def _bounds(lengths):
    out = [0]
    for m in lengths:
        out.append(out[-1] + m)
    return out


def plan_row(mix: str, s: int, cp: int, rows: int) -> dict:
    """The table's figures for one (mix, s, cp) over `rows` rows."""
    per_row = {"zigzag": [], "balanced": []}
    per_step = {"zigzag": [], "balanced": []}
    summed = {"zigzag": [0] * cp, "balanced": [0] * cp}
    travelling, plan_s, docs = 0, [], 0
    for row in range(rows):
        bounds = [_bounds(mix_lengths(mix, s, row))]
        docs += len(bounds[0]) - 1
        for kind in per_row:
            start = time.perf_counter()
            layout = cp_layout(kind, bounds, 1, s, cp)
            if kind == "balanced":
                layout_ring_plan(layout, 0)
                plan_s.append(time.perf_counter() - start)
                travelling += sum(layout.travelling_tokens())
            work = layout.work()
            per_row[kind].append(work_balance(work))
            plans = [layout_ring_plan(layout, r) for r in range(cp)]
            per_step[kind].append(step_balance([p.work for p in plans]))
            summed[kind] = [a + b for a, b in zip(summed[kind], work)]
    ring = (cp - 1) * s * rows * KV_BYTES_PER_TOKEN        # every rank's block, cp - 1 hops
    return {"mix": mix, "seq": s, "cp": cp, "rows": rows, "documents_per_row": docs / rows,
            "zigzag_balance_worst_row": max(per_row["zigzag"]),
            "balanced_balance_worst_row": max(per_row["balanced"]),
            "zigzag_balance_rows_summed": work_balance(summed["zigzag"]),
            "balanced_balance_rows_summed": work_balance(summed["balanced"]),
            "zigzag_step_balance_worst_row": max(per_step["zigzag"]),
            "balanced_step_balance_worst_row": max(per_step["balanced"]),
            "ring_kv_bytes_per_layer_forward": ring // rows,
            "needed_kv_bytes_per_layer_forward": (cp - 1) * travelling * KV_BYTES_PER_TOKEN // rows,
            "needed_share": travelling / (s * rows),
            "plan_ms_median": 1e3 * statistics.median(plan_s)}


def step_balance(works) -> float:
    """The ring's figure when every step waits for its slowest rank: sum over steps of the max
    over ranks of the step's pairs, over the mean total per rank (1.0: balanced at every step).
    works[r][i]: rank r's pairs at ring step i."""
    cp = len(works)
    total = sum(sum(w) for w in works) / cp
    return sum(max(w[i] for w in works) for i in range(cp)) / total if total else 1.0


def _gib(x):
    return f"{x / 2**30:.2f}"


def plan_table(seqs, degrees, rows) -> list[dict]:
    out = []
    print(f"{'mix':>24} {'s':>8} {'cp':>3} {'docs':>6} | {'zigzag':>7} {'balanced':>8} "
          f"{'(summed)':>8} {'z/step':>6} {'b/step':>6} | {'ring GiB':>8} {'needed':>7} "
          f"{'share':>6} | {'plan ms':>7}")
    for mix in MIXES:
        for s in seqs:
            for cp in degrees:
                r = plan_row(mix, s, cp, rows)
                out.append(r)
                print(f"{mix:>24} {s:>8} {cp:>3} {r['documents_per_row']:>6.0f} | "
                      f"{r['zigzag_balance_worst_row']:>7.2f} "
                      f"{r['balanced_balance_worst_row']:>8.3f} "
                      f"{r['balanced_balance_rows_summed']:>8.3f} "
                      f"{r['zigzag_step_balance_worst_row']:>6.2f} "
                      f"{r['balanced_step_balance_worst_row']:>6.3f} | "
                      f"{_gib(r['ring_kv_bytes_per_layer_forward']):>8} "
                      f"{_gib(r['needed_kv_bytes_per_layer_forward']):>7} "
                      f"{r['needed_share']:>6.2f} | {r['plan_ms_median']:>7.1f}", flush=True)
    return out


# Transformer Engine's thd layout (--attention-backend te with packed documents) ------------------

TE_COLUMNS = [("mix", "mix"), ("seq", "s"), ("cp", "cp"), ("layout", "our layout"),
              ("te_balance_worst_row", "TE thd max/mean"),
              ("our_balance_worst_row", "our max/mean"), ("moved_share", "tokens moved"),
              ("padding_share", "TE padding")]


def te_row(mix: str, s: int, cp: int, rows: int, kind: str) -> dict:
    """TE's thd layout of `kind`'s tokens: its work balance, the share of the row's tokens the
    all-to-all moves (each way, q k v in and the output out), the padding TE's layout adds."""
    import torch
    from megatron_sp.context_parallel.te_thd import te_places, thd_work
    te, ours, moved, padding = [], [], 0, 0
    for row in range(rows):
        layout = cp_layout(kind, [_bounds(mix_lengths(mix, s, row))], 1, s, cp)
        te_rank, _, _, padded = te_places(layout)
        te.append(work_balance(thd_work(layout)))
        ours.append(layout.balance())
        moved += sum(int((te_rank[layout.positions(r)[0]] != r).sum()) for r in range(cp))
        padding += sum(padded) - s
    return {"mix": mix, "seq": s, "cp": cp, "layout": kind, "te_balance_worst_row": max(te),
            "our_balance_worst_row": max(ours), "moved_share": moved / (s * rows),
            "padding_share": padding / (s * rows)}


def te_table(seqs, degrees, rows) -> list[dict]:
    out = []
    print(f"{'mix':>24} {'s':>8} {'cp':>3} {'layout':>8} | {'TE bal':>6} {'ours':>6} | "
          f"{'moved':>6} {'padding':>7}")
    for mix in MIXES:
        for s in seqs:
            for cp in degrees:
                for kind in ("balanced", "zigzag"):
                    r = te_row(mix, s, cp, rows, kind)
                    out.append(r)
                    print(f"{mix:>24} {s:>8} {cp:>3} {kind:>8} | "
                          f"{r['te_balance_worst_row']:>6.3f} {r['our_balance_worst_row']:>6.3f} "
                          f"| {r['moved_share']:>6.3f} {r['padding_share']:>7.4f}", flush=True)
    return out


# Timed block kernels, per rank and ring step --------------------------------------------------

def rank_step_seconds(plan, n, heads, kv_heads, head_dim, reps, gen):
    """[cp] seconds of this rank's forward + backward block kernels at each ring step (the least
    of `reps`), on random fp32 q, k, v of its n tokens and the held blocks' shapes. CPU time of
    this thread (time.thread_time): what the kernels cost, not the time other jobs on the
    machine took from them."""
    import torch
    from megatron_sp.attention.block_kernels import backward_batch, forward_batch
    b, cp = len(plan.send_index) if plan.send_index is not None else 1, plan.cp
    q = torch.randn(b, n, heads, head_dim, generator=gen)
    dout = torch.randn(b, n, heads, head_dim, generator=gen)
    blocks = []
    for i in range(cp):
        held = (plan.rank - i) % cp
        m = n if plan.send_index is None or i == 0 else plan.block_tokens[held]
        blocks.append([torch.randn(b, m, kv_heads, head_dim, generator=gen) for _ in range(2)])
    scale = head_dim ** -0.5
    best = [float("inf")] * cp
    for _ in range(reps):
        out = torch.zeros(b, n, heads, head_dim)
        lse = torch.full((b, n, heads), float("-inf"))
        times = []
        for i in range(cp):
            start = time.thread_time()
            for batch in plan.steps[i]:
                forward_batch(q, *blocks[i], batch, scale=scale, out=out, lse=lse)
            times.append(time.thread_time() - start)
        dq = torch.zeros_like(q)
        for i in range(cp):
            dk, dv = (torch.zeros_like(t) for t in blocks[i])
            start = time.thread_time()
            for batch in plan.steps[i]:
                backward_batch(q, *blocks[i], out, dout, lse, batch, scale=scale, dq=dq, dk=dk,
                               dv=dv)
            times[i] += time.thread_time() - start
        best = [min(a, t) for a, t in zip(best, times)]
    return best


def kernel_rows(seqs, degrees, mixes, rows, reps, heads=4, kv_heads=2, head_dim=32) -> list[dict]:
    """Per (mix, s, cp, row, layout): every rank's block-kernel seconds per ring step, timed one
    rank after the other in this process (one thread), and the ring time they imply when every
    step waits for its slowest rank (sum over steps of the max over ranks)."""
    import torch
    torch.set_num_threads(1)
    out = []
    print(f"\nblock kernels timed (thread CPU time) per rank and ring step (fp32, one thread, "
          f"h {heads}, kv "
          f"{kv_heads}, d {head_dim}, least of {reps}); ring s = sum over steps of the slowest "
          f"rank; sum/cp = perfect balance")
    print(f"{'mix':>24} {'s':>6} {'cp':>3} {'row':>3} | {'zigzag s':>8} {'balanced s':>10} "
          f"{'speedup':>7} | {'sum/cp z':>8} {'sum/cp b':>8}")
    for mix in mixes:
        for s in seqs:
            for cp in degrees:
                for row in range(rows):
                    bounds = [_bounds(mix_lengths(mix, s, row))]
                    got = {}
                    for kind in ("zigzag", "balanced"):
                        layout = cp_layout(kind, bounds, 1, s, cp)
                        gen = torch.Generator().manual_seed(row)
                        per_rank = [rank_step_seconds(layout_ring_plan(layout, r), s // cp, heads,
                                                      kv_heads, head_dim, reps, gen)
                                    for r in range(cp)]
                        got[kind] = (sum(max(t[i] for t in per_rank) for i in range(cp)),
                                     sum(map(sum, per_rank)) / cp, layout.balance())
                    r = {"mix": mix, "seq": s, "cp": cp, "row": row,
                         "zigzag_ring_s": got["zigzag"][0], "balanced_ring_s": got["balanced"][0],
                         "speedup": got["zigzag"][0] / got["balanced"][0],
                         "zigzag_perfect_s": got["zigzag"][1],
                         "balanced_perfect_s": got["balanced"][1],
                         "zigzag_balance": got["zigzag"][2], "balanced_balance": got["balanced"][2]}
                    out.append(r)
                    print(f"{mix:>24} {s:>6} {cp:>3} {row:>3} | {r['zigzag_ring_s']:>8.2f} "
                          f"{r['balanced_ring_s']:>10.2f} {r['speedup']:>6.2f}x | "
                          f"{r['zigzag_perfect_s']:>8.2f} {r['balanced_perfect_s']:>8.2f}",
                          flush=True)
    return out


# The measured step ------------------------------------------------------------------------------

VOCAB = 1024
MODEL = ["--num-layers", "1", "--hidden-size", "256", "--num-attention-heads", "8",
         "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "512",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--attention-dropout", "0", "--hidden-dropout", "0"]


def write_skewed_corpus(prefix: str, seq: int, rows: int, seed: int = 0) -> int:
    """A .bin/.idx of `rows` rows' worth of skewed documents (module docstring); returns the
    number of documents. Token ids Zipf-distributed, each document ends in eod = VOCAB."""
    from data.indexed_dataset import IndexedDatasetBuilder
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    docs = 0
    for _ in range(rows + 2):
        long = int(rng.uniform(0.4, 0.8) * seq)
        short = _fill(seq - long, [], lambda: rng.lognormal(np.log(256), 1.2))
        at = int(rng.integers(0, len(short) + 1))
        for n in short[:at] + [long] + short[at:]:
            n = max(2, n)
            body = np.minimum(rng.zipf(1.2, n - 1), VOCAB - 1).astype(np.int32)
            builder.add_document(np.append(body, VOCAB), [n])
            docs += 1
    builder.finalize(prefix + ".idx")
    return docs


def launch(prefix: str, seq: int, layout: str, iters: int, save: str) -> dict:
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(29500 + (os.getpid() + seq + len(layout)) % 2000),
            os.path.join(HERE, "bench", "step_cpu_time.py"), save + "_cpu",
            os.path.join(HERE, "pretrain_gpt.py"), *MODEL,
            "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", str(iters),
            "--lr", "1e-4", "--context-parallel-size", "2", "--data-path", prefix,
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--split", "100,0,0",
            "--eval-iters", "0", "--log-interval", "1", "--save", save, "--save-interval", "1000",
            "--distributed-backend", "gloo", "--reset-attention-mask", "--reset-position-ids",
            "--context-parallel-layout", layout, "--seed", "1234"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(args, capture_output=True, text=True, env=env, cwd=HERE)
    if p.returncode != 0:
        raise SystemExit(f"the launch failed ({p.returncode}):\n{p.stdout[-3000:]}\n"
                         f"{p.stderr[-3000:]}")
    steps = [float(x) / 1e3 for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)",
                                                p.stdout)]
    balance = [float(x) for x in re.findall(r"cp work balance: ([0-9.]+)", p.stdout)]
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", p.stdout)]
    ranks = [[json.loads(line) for line in open(f"{save}_cpu.rank{r}.jsonl")]
             for r in range(2)]
    cpu = [max(step["thread_cpu_s"] for step in steps) for steps in zip(*ranks)]
    layout_line = next((line for line in p.stdout.splitlines() if "ring layout" in line), "")
    return {"step_s": steps, "cpu_s": cpu, "cp_work_balance": balance, "lm_loss": losses,
            "layout_line": layout_line.strip()}


def measured_steps(seqs, reps, iters) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq in seqs:
            prefix = os.path.join(tmp, f"skewed_{seq}_text_document")
            docs = write_skewed_corpus(prefix, seq, iters * reps)
            print(f"\nmeasured cp-2 step, s={seq}: corpus {docs} documents; {iters} iterations a "
                  f"launch, the first dropped, {reps} launches per layout, interleaved", flush=True)
            got = {"zigzag": [], "balanced": []}
            for rep in range(reps):
                for layout in got:
                    r = launch(prefix, seq, layout, iters,
                               os.path.join(tmp, f"ck{seq}{layout}{rep}"))
                    got[layout].append(r)
                    print(f"  {layout:>8} rep {rep}: steps "
                          + " ".join(f"{x:.2f}" for x in r["step_s"]) + " s; slowest rank's CPU "
                          + " ".join(f"{x:.2f}" for x in r["cpu_s"]) + " s; cp_work_balance "
                          + " ".join(f"{x:.3f}" for x in r["cp_work_balance"]), flush=True)
            row = {"seq": seq, "iters": iters, "reps": reps, "documents": docs}
            for layout, runs in got.items():
                steps = [x for r in runs for x in r["step_s"][1:]]
                cpu = [x for r in runs for x in r["cpu_s"][1:]]
                row[layout] = {"median_step_s": statistics.median(steps), "steps_s": steps,
                               "median_cpu_s": statistics.median(cpu), "cpu_s": cpu,
                               "cp_work_balance": [x for r in runs for x in r["cp_work_balance"]],
                               "lm_loss": runs[0]["lm_loss"], "layout_line": runs[0]["layout_line"]}
            row["speedup"] = row["zigzag"]["median_step_s"] / row["balanced"]["median_step_s"]
            paired = [z / b for zr, br in zip(got["zigzag"], got["balanced"])
                      for z, b in zip(zr["step_s"][1:], br["step_s"][1:])]   # the same rows
            row["paired_speedup_median"] = statistics.median(paired)
            row["cpu_speedup"] = row["zigzag"]["median_cpu_s"] / row["balanced"]["median_cpu_s"]
            row["paired_cpu_speedup_median"] = statistics.median(
                [z / b for zr, br in zip(got["zigzag"], got["balanced"])
                 for z, b in zip(zr["cpu_s"][1:], br["cpu_s"][1:])])
            same = all(abs(a - b) <= 1e-4 * abs(b) for a, b in
                       zip(row["balanced"]["lm_loss"], row["zigzag"]["lm_loss"]))
            print(f"  median step: zigzag {row['zigzag']['median_step_s']:.2f} s, balanced "
                  f"{row['balanced']['median_step_s']:.2f} s ({row['speedup']:.2f}x; median of "
                  f"the same iterations' ratios {row['paired_speedup_median']:.2f}x)\n"
                  f"  slowest rank's CPU per step: zigzag {row['zigzag']['median_cpu_s']:.2f} s, "
                  f"balanced {row['balanced']['median_cpu_s']:.2f} s ({row['cpu_speedup']:.2f}x; "
                  f"same iterations {row['paired_cpu_speedup_median']:.2f}x)\n"
                  f"  lm loss {'the same (1e-4)' if same else 'DIFFERS'}: "
                  f"{row['zigzag']['lm_loss']} vs {row['balanced']['lm_loss']}")
            out.append(row)
    return out


PLAN_COLUMNS = [("mix", "mix"), ("seq", "s"), ("cp", "cp"), ("documents_per_row", "docs/row"),
                ("zigzag_balance_worst_row", "zigzag max/mean"),
                ("balanced_balance_worst_row", "balanced max/mean"),
                ("balanced_balance_rows_summed", "balanced, rows summed"),
                ("zigzag_step_balance_worst_row", "zigzag per step"),
                ("balanced_step_balance_worst_row", "balanced per step"),
                ("ring_kv_bytes_per_layer_forward", "zigzag ring kv bytes/layer fwd"),
                ("needed_kv_bytes_per_layer_forward", "balanced ring kv bytes/layer fwd"),
                ("needed_share", "balanced/zigzag bytes"), ("plan_ms_median", "plan ms")]
STEP_COLUMNS = [("seq", "s"), ("layout", "layout"), ("median_step_s", "median step s"),
                ("speedup", "vs zigzag"), ("paired_speedup", "vs zigzag, same iterations"),
                ("median_cpu_s", "slowest rank CPU s/step"), ("cpu_speedup", "vs zigzag (CPU)"),
                ("paired_cpu_speedup", "vs zigzag (CPU), same iterations"),
                ("cp_work_balance_median", "cp_work_balance (median)"),
                ("cp_work_balance_max", "cp_work_balance (max)"), ("steps", "steps timed"),
                ("lm_loss_as_zigzag", "lm loss = zigzag's")]


def write_tables(result: dict) -> list[str]:
    """bench/results/context_parallel_layouts_cpu.json (the plan) and, when measured,
    context_parallel_layout_step_cpu.json, in docs/performance.md's schema."""
    from performance_table import write_results
    paths = [write_results(
        "context_parallel_layouts_cpu", "cp_layouts", result["plan"], columns=PLAN_COLUMNS,
        command=result["command"],
        title="Ring layouts for skewed document mixes: zigzag vs balanced (plan, pure computation)",
        notes=["max/mean: the max over ring ranks of the causal (query, key) pairs over their mean "
               "(cp_work_balance), the worst of the rows (rows summed: all rows as one step)",
               "per step: sum over ring steps of the slowest rank's pairs at that step, over "
               "the mean total per rank (what a ring that waits at every step sees), worst row",
               "ring kv bytes: forward, per attention layer, all ranks together, llama-8b's 8 kv "
               "heads x 128 in bf16; zigzag: every rank's whole block cp-1 hops; balanced: only "
               "the travelling keys (a short document held whole stays home)",
               "plan ms: the balanced layout and one rank's ring plan of one row, this CPU"])]
    if result.get("kernels"):
        paths.append(write_results(
            "context_parallel_layout_kernels_cpu", "cp_layouts", result["kernels"],
            command=result["command"],
            title="Ring block kernels timed per rank and step on skewed documents: zigzag vs "
                  "balanced (CPU, one thread)",
            notes=["every rank's forward + backward block kernels (attention/block_kernels.py) "
                   "timed per ring step in CPU time of the thread (time.thread_time: other jobs' "
                   "load does not count), one rank after the other in one process (fp32, one "
                   "thread, 4 heads, 2 kv heads, d 32, the least of 3); ring s: the sum over "
                   "steps of the slowest rank's seconds (a ring whose every step waits for it); "
                   "perfect: the ranks' total over cp; no communication",
                   "balance: cp_work_balance of the row's layout",
                   "the two layouts compute the same pairs, so their perfect columns should agree: "
                   "where they do not, the machine's load (other jobs) moved the timing more than "
                   "the layout does"]))
    if result["measured"]:
        rows = []
        for r in result["measured"]:
            for layout in ("zigzag", "balanced"):
                got = r[layout]
                rows.append({"seq": r["seq"], "layout": layout,
                             "median_step_s": got["median_step_s"],
                             "speedup": r["zigzag"]["median_step_s"] / got["median_step_s"],
                             "paired_speedup": (r["paired_speedup_median"]
                                                if layout == "balanced" else 1.0),
                             "median_cpu_s": got["median_cpu_s"],
                             "cpu_speedup": r["zigzag"]["median_cpu_s"] / got["median_cpu_s"],
                             "paired_cpu_speedup": (r["paired_cpu_speedup_median"]
                                                    if layout == "balanced" else 1.0),
                             "cp_work_balance_median": statistics.median(got["cp_work_balance"]),
                             "cp_work_balance_max": max(got["cp_work_balance"]),
                             "steps": len(got["steps_s"]),
                             "lm_loss_as_zigzag": all(
                                 abs(a - b) <= 1e-4 * abs(b) for a, b in
                                 zip(got["lm_loss"], r["zigzag"]["lm_loss"]))})
        paths.append(write_results(
            "context_parallel_layout_step_cpu", "cp_layouts", rows, columns=STEP_COLUMNS,
            command=result["command"],
            title="Measured cp-2 training step through pretrain_gpt.py on skewed documents: "
                  "--context-parallel-layout zigzag vs balanced",
            notes=["2 gloo ranks on this CPU (one thread each; other jobs share the machine), "
                   "1-layer GQA model (8/2 heads, hidden 256), micro-batch 1, "
                   "--reset-attention-mask --reset-position-ids; rows of long documents (40-80% "
                   "of the row) among lognormal short ones",
                   "median step: pretrain_gpt's elapsed time per iteration, the first iteration "
                   "of each launch dropped, launches of the two layouts interleaved; same "
                   "iterations: the median of zigzag / balanced over the same (launch pair, "
                   "iteration), i.e. the same rows",
                   "slowest rank CPU s/step: per iteration, the larger of the 2 ranks' main-"
                   "thread CPU time over Trainer.train_step (time.thread_time, recorded by "
                   "bench/step_cpu_time.py; one thread per rank), median as above: what each "
                   "rank computed, not the time it waited for its peer nor the time other jobs "
                   "held the cores; on an otherwise idle 2-core machine the step is at least "
                   "this, so it is the figure that does not depend on the machine's load",
                   "lm loss = zigzag's: the logged losses agree to 1e-4 relative (the same "
                   "tokens and the same sum, in another order)",
                   f"this run: load average (1, 5, 15 min) {result['load_average_at_start']} "
                   f"at the start, {result.get('load_average_at_end', '?')} at the end (other "
                   f"jobs on the 2 cores: the wall-time columns depend on it, the CPU ones "
                   f"do not)"]))
    return paths


def write_te_table(rows, command) -> str:
    """bench/results/context_parallel_te_thd_cpu.json."""
    from performance_table import write_results
    return write_results(
            "context_parallel_te_thd_cpu", "cp_layouts", rows, columns=TE_COLUMNS,
            command=command,
            title="Packed documents under Transformer Engine's context parallelism: its thd "
                  "layout against ours (plan, pure computation)",
            notes=["TE balance: max/mean causal (query, key) pairs over the ranks in TE's thd "
                   "layout (every document padded to 2cp chunks, i and 2cp-1-i on rank i), worst "
                   "row; ours: the same figure of our layout (what our ring balances)",
                   "moved: the share of the row's tokens the all-to-all carries from our layout "
                   "to TE's (q, k, v in; the output back the same way); padding: the slots TE's "
                   "layout adds, over the row's tokens",
                   "TE has not run (it installs nowhere here): these are the plan's figures"])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[32768, 131072, 1 << 20])
    p.add_argument("--degrees", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--rows", type=int, default=4, help="rows per (mix, s, cp)")
    p.add_argument("--step", type=int, nargs="*", default=[],
                   help="also measure the cp-2 step through pretrain_gpt.py at these lengths")
    p.add_argument("--reps", type=int, default=2, help="launches per layout (--step)")
    p.add_argument("--iters", type=int, default=4, help="iterations per launch (--step)")
    p.add_argument("--kernels", type=int, nargs="*", default=[],
                   help="also time the block kernels per rank and ring step at these lengths")
    p.add_argument("--kernel-degrees", type=int, nargs="+", default=[2, 4])
    p.add_argument("--kernel-rows", type=int, default=2)
    p.add_argument("--te", type=int, nargs="*", default=None,
                   help="only Transformer Engine's thd layout table, at these lengths "
                        "(default 32768 131072)")
    p.add_argument("--no-save", action="store_true", help="print only")
    p.add_argument("--tables-from", default=None, help=argparse.SUPPRESS)   # re-emit a raw run
    args = p.parse_args()
    sys.path.insert(0, os.path.join(HERE, "bench"))
    if args.tables_from:
        print("\n".join(write_tables(json.load(open(args.tables_from)))))
        return
    command = " ".join(shlex.quote(x) for x in ["python", "bench/cp_layouts.py", *sys.argv[1:]])
    machine = f"{platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"command: {command}\nmachine: {machine}; load average at start {load}")
    if args.te is not None:
        print("TE bal: max/mean causal pairs over the ranks in TE's thd layout (worst of "
              f"{args.rows} rows); ours: our layout's; moved: tokens the all-to-all carries, "
              "over the row; padding: TE's padding slots, over the row\n")
        te = te_table(args.te or [32768, 131072], args.degrees, args.rows)
        if not args.no_save:
            print("\nwritten: " + write_te_table(te, command))
        return
    print(f"balance: max/mean causal pairs over ring ranks (worst of {args.rows} rows; summed: "
          f"the rows together); ring GiB: forward kv bytes per layer, all ranks, as the zigzag "
          f"ring sends them; needed: what the balanced ring sends (the keys another rank "
          f"attends); share: needed / ring\n")
    plan = plan_table(args.seq, args.degrees, args.rows)
    kernels = (kernel_rows(args.kernels, args.kernel_degrees, SKEWED, args.kernel_rows, 3)
               if args.kernels else [])
    steps = measured_steps(args.step, args.reps, args.iters) if args.step else []
    result = {"command": command, "machine": machine, "load_average_at_start": load,
              "plan": plan, "kernels": kernels, "measured": steps}
    result["load_average_at_end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    if not args.no_save:
        print("\nwritten: " + ", ".join(write_tables(result)))


if __name__ == "__main__":
    main()
