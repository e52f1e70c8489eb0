#!/usr/bin/env python
"""Ulysses vs ring vs hybrid, with and without packed documents: bytes, time, memory, work.

Per attention layer (docs/design.md §14).

At context degree c = 2 and 4 on gloo ranks (spawned on this CPU), one causal attention layer
forward + backward on random q, k, v of this rank's tokens, through
megatron_sp.context_parallel.hybrid.hybrid_attention in every mode (same kernels, same layout code):

  ulysses   a = c, r = 1   seq->head all-to-all, attention over the whole sequence, head->seq
  ring      a = 1, r = c   zigzag tokens, kv blocks round the ring (context_parallel.ring)
  hybrid    a = 2, r = 2   (c = 4 only) all-to-all over adjacent pairs, then a ring of 2

for MHA (kv heads = h) and GQA (h/kv = --gqa-group, 4 by default; --attention). Per rank: the
bytes sent (comm_stats counters "sp/all_to_all" and "cp/ring_p2p", every rank the same; asserted
equal to hybrid_comm_bytes, the exact count) and the formula of docs/design.md §14 for the forward,

  §14 forward   (2 + 2/G) N H / (a r)  [all-to-alls, a > 1]  +  2 (r-1) N H / (G a r)  [ring]
                N = b s tokens, H = h d, G = h / kv heads (elements; x4 bytes in fp32)

(exact: the all-to-alls send (a-1)/a of that, and G becomes h / max(kv, a) once kv heads are
replicated; backward: the all-to-alls the same again, the ring (r-1) kv blocks plus r fp32 dk, dv
blocks). Time: median over --reps interleaved repetitions (the order of the modes x documents
rotates every repetition; the first is a warm-up), max over ranks. Last, per (degree, heads,
documents), which mode is cheapest in bytes and in time, and at which sequence length the time
winner changes.

Packed documents (`document_ids=`, the FULL rows' [b, s] ids, as every rank has them): every row
is run three ways (--documents), the kernels computing only the segments the documents leave
(attention/segments.py, planned by plan_ring inside each call, as a model plans once per step):

  none       no document_ids (the rows of earlier versions of this bench)
  1 doc      every row one document (all ids 0): the same pairs as none, through the segment path
  hundreds   documents of random lengths, uniform on [1, 2 s/300 - 1] (mean ~ s/300, so ~300
             documents per row), drawn from a generator seeded by s alone: the same ids on every
             rank and in every mode

Per row, besides bytes (documents add none: still asserted equal to hybrid_comm_bytes) and time:

  peak      per rank, the peak of LIVE TENSOR BYTES allocated during one forward + backward (above
            what was live when it started; measured in the rank process from the CPU allocator's
            alloc/free events under torch.autograd.profiler with profile_memory=True, in separate
            untimed calls after the timed ones, so kernel temporaries, received kv blocks and the
            gradients count; not RSS; blocks older than the call must not be freed in it, as the
            profiler cannot size them: q.grad, k.grad, v.grad are cleared before). The least of
            --peak-reps calls (2; a comm buffer or two may die late, at timing-dependent
            moments); the table shows the max over ranks. The profiled calls are slow (~7x for
            the many small kernels of "hundreds"), so they are not timed
  work      forward block-pair FLOPs per rank = 4 d (h/a) * (query, key) pairs the rank computes,
            summed over its ring steps (RingPlan.work of plan_ring for its ring rank; QK^T and PV,
            2 flops each per pair and head dimension); the table shows the max over ranks and
            max/min (the load balance the documents leave; 1.00 = balanced). The pairs of all
            ranks together are asserted equal to h * sum over documents of L (L+1) / 2.
  /none     time and peak of a document row divided by the same mode's no-document row

(The peak is not memory.accounting.LiveTensorPeak's: that one counts a view of a tensor made before
the call, as the kernels' q[:, q0:q1] of every segment, as its whole storage, and misses kernel
scratch.) JSON (--json): the earlier keys of every row and crossover, plus per row documents,
num_documents (over the b rows; none: b, a row is one document), peak_bytes_max / _min /
_per_rank / _highest_sample (the most of all ranks' profiled calls), forward_flops_max / _min /
_per_rank / _balance (max/min), plan_s_max (one plan_ring call, max over ranks), time_vs_none,
peak_vs_none; per crossover documents.

    python bench/context_parallel.py                  # c 2 4, s 4K 8K, h 8, d 8, 3 reps (~15 min)
    python bench/context_parallel.py --quick          # smoke run, < 60 s (c 2 4, s 1K, GQA, 1 rep)
    python bench/context_parallel.py --documents none # the no-document rows only
    python bench/context_parallel.py --seq 4096 8192 16384 --reps 5   # up to 16K (~1 h here)
    python bench/context_parallel.py --degrees 4 --seq 16384 --heads 16 --reps 7

Which tokens each ring rank holds for skewed document mixes (the row's zigzag against the
balanced layout: balance, bytes, kernels per rank and step, the pretrain_gpt.py step):
bench/cp_layouts.py.

Times on a CPU with fewer cores than ranks include the oversubscription (each rank has one
thread), and whatever else loads the machine (the header prints the load average); they compare
the modes on this machine, not on a GPU cluster.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("KINETO_LOG_LEVEL", "6")   # no profiler start/stop lines (USDT, 5), any rank

import torch  # noqa: E402

from megatron_sp import comm_stats  # noqa: E402
from megatron_sp.attention.segments import document_bounds  # noqa: E402
from megatron_sp.context_parallel import COMM_KIND as RING_KIND  # noqa: E402
from megatron_sp.context_parallel.hybrid import (hybrid_attention, hybrid_comm_bytes,  # noqa: E402
                                                 hybrid_group_ranks)
from megatron_sp.context_parallel.ring import plan_ring  # noqa: E402
from megatron_sp.mesh import group_rank  # noqa: E402
from megatron_sp.testing import run_distributed  # noqa: E402
from megatron_sp.ulysses import COMM_KIND as A2A_KIND  # noqa: E402

MIB = 1024 * 1024
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                            "context_parallel_cpu.json")
DOCUMENTS = ("none", "1 doc", "hundreds")   # the document rows of every (mode, heads, s)
DOCS_PER_ROW = 300                          # "hundreds": mean document length s / 300


def modes(degree: int) -> list[tuple[str, int, int]]:
    """(name, a, r) of the modes compared at this context degree."""
    out = [("ulysses", degree, 1), ("ring", 1, degree)]
    if degree == 4:
        out.append(("hybrid", 2, 2))
    return out


def document_ids(kind: str, batch: int, s: int) -> torch.Tensor | None:
    """The FULL rows' [b, s] int64 document ids of a document kind (DOCUMENTS): None, one
    document per row, or documents of lengths uniform on [1, 2 s/300 - 1] from a generator seeded
    by s alone (the same ids on every rank, in every mode)."""
    if kind == "none":
        return None
    if kind == "1 doc":
        return torch.zeros(batch, s, dtype=torch.int64)
    if kind != "hundreds":
        raise ValueError(f"unknown document kind {kind!r}: one of {DOCUMENTS}")
    gen = torch.Generator().manual_seed(12345 + s)
    high = max(2, round(2 * s / DOCS_PER_ROW))          # lengths 1 .. high - 1, mean high / 2
    rows = []
    for _ in range(batch):
        lengths = torch.randint(1, high, (s,), generator=gen)               # enough for s tokens
        ids = torch.repeat_interleave(torch.arange(s), lengths)[:s]          # [s]
        rows.append(ids)
    return torch.stack(rows)                                                 # [b, s]


def document_pairs(ids: torch.Tensor | None, batch: int, s: int) -> tuple[int, int]:
    """(documents, causal (query, key) pairs of all rows: sum of L (L+1)/2 over documents)."""
    bounds = document_bounds(ids) or [[0, s]] * batch
    lengths = [hi - lo for row in bounds for lo, hi in zip(row, row[1:])]
    return len(lengths), sum(n * (n + 1) // 2 for n in lengths)


def design_forward_elements(batch, s, heads, kv_heads, head_dim, a, r) -> float:
    """docs/design.md §14, forward elements per rank: (2 + 2/G) N H/(a r) for the all-to-alls
    (when a > 1) plus 2 (r-1) N H/(G a r) for the ring, G = h / kv heads."""
    nh, G = batch * s * heads * head_dim, heads / kv_heads
    a2a = (2 + 2 / G) * nh / (a * r) if a > 1 else 0.0
    return a2a + 2 * (r - 1) * nh / (G * a * r)


def _groups(rank, layouts):
    """{(a, r): (ulysses group, ring group)}; every rank creates every group in the same order,
    a group of one rank is None, groups with the same members are made once."""
    import torch.distributed as dist

    made, mine = {}, {}
    for a, r in layouts:
        picked = []
        for groups in hybrid_group_ranks(a, r):
            found = None
            for members in groups:
                key = tuple(members)
                if len(members) > 1 and key not in made:
                    made[key] = dist.new_group(members)
                if rank in members:
                    found = made.get(key)
            picked.append(found)
        mine[(a, r)] = tuple(picked)
    return mine


def peak_live_bytes(fn) -> int:
    """Run fn() under the profiler's memory tracking and return the peak of live tensor bytes
    allocated during it: the running sum of the CPU allocator's alloc (+) and free (-) events,
    in time order. A block allocated before fn() and freed in it is not seen (the profiler
    never learnt its size), so the caller frees what fn() would replace (q.grad, ...) first."""
    from torch.autograd import profiler

    with profiler.profile(profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())                  # stable: ties keep their order
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _run(rank, world, heads_list, seqs, head_dim, batch, reps, kinds, peak_reps):
    """Per (h, kv, s, mode, documents): bytes this rank sent (forward / backward, by counter),
    the median seconds of forward + backward (max over ranks), this rank's peak live tensor
    bytes of one forward + backward (the least of peak_reps profiled calls, and the most), its
    forward (query, key) pairs (plan work) and the plan's seconds."""
    import torch.distributed as dist

    layouts = modes(world)
    groups = _groups(rank, [(a, r) for _, a, r in layouts])
    results = []
    for h, kv in heads_list:
        for s in seqs:
            n = s // world
            gen = torch.Generator().manual_seed(1000 * rank + s + h + kv)
            q = torch.randn(batch, n, h, head_dim, generator=gen).requires_grad_()
            k, v = (torch.randn(batch, n, kv, head_dim, generator=gen).requires_grad_()
                    for _ in range(2))
            dout = torch.randn(batch, n, h, head_dim, generator=gen)
            ids = {kind: document_ids(kind, batch, s) for kind in kinds}
            variants = [(name, a, r, kind) for name, a, r in layouts for kind in kinds]

            def layer(a, r, kind):
                q.grad = k.grad = v.grad = None
                hybrid_attention(q, k, v, *groups[(a, r)], document_ids=ids[kind]).backward(dout)

            times = {v_: [] for v_ in variants}
            for rep in range(reps + 1):          # repetition 0 warms up
                shift = rep % len(variants)
                for name, a, r, kind in variants[shift:] + variants[:shift]:
                    dist.barrier()
                    start = time.perf_counter()
                    layer(a, r, kind)
                    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    if rep:
                        times[(name, a, r, kind)].append(elapsed.item())
            for name, a, r, kind in variants:    # untimed: bytes, peak memory, work
                sent = {}

                def measured():
                    comm_stats.reset()
                    out = hybrid_attention(q, k, v, *groups[(a, r)], document_ids=ids[kind])
                    forward = comm_stats.snapshot()
                    comm_stats.reset()
                    out.backward(dout)
                    backward = comm_stats.snapshot()
                    sent.update(a2a_forward=forward.get(A2A_KIND, 0),
                                ring_forward=forward.get(RING_KIND, 0),
                                a2a_backward=backward.get(A2A_KIND, 0),
                                ring_backward=backward.get(RING_KIND, 0))

                peaks = []
                for _ in range(peak_reps):
                    q.grad = k.grad = v.grad = None   # freed before, not during, the measurement
                    dist.barrier()
                    peaks.append(peak_live_bytes(measured))
                ring_group = groups[(a, r)][1]
                start = time.perf_counter()
                plan = plan_ring(ids[kind], batch, a * n, ring_group, True)
                plan_s = time.perf_counter() - start
                pairs = sum(plan.work)
                results.append({"degree": world, "mode": name, "a": a, "r": r, "heads": h,
                                "kv_heads": kv, "seq": s, "documents": kind, "bytes": dict(sent),
                                "median_s": statistics.median(times[(name, a, r, kind)]),
                                "times_s": times[(name, a, r, kind)],
                                "rank": rank, "ring_rank": group_rank(ring_group),
                                "peak_bytes": min(peaks), "peak_bytes_high": max(peaks),
                                "pairs": pairs, "plan_s": plan_s,
                                "forward_flops": 4 * head_dim * (h // a) * pairs})
    return results


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _heads_label(h, kv):
    return f"MHA {h}/{kv}" if h == kv else f"GQA {h}/{kv}"


def _ratio(x, y) -> float | None:
    return None if not y else x / y


def _fmt_ratio(x, width=5) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width - 1}.2f}x"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--degrees", type=int, nargs="+", default=[2, 4], choices=[2, 4])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--heads", type=int, default=8, help="query heads h")
    p.add_argument("--gqa-group", type=int, default=4, help="GQA: query heads per kv head")
    p.add_argument("--head-dim", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (after one warm-up)")
    p.add_argument("--documents", nargs="+", default=list(DOCUMENTS), choices=DOCUMENTS,
                   help="document rows per (mode, heads, s); 'none' first is the /none baseline")
    p.add_argument("--attention", nargs="+", default=["mha", "gqa"], choices=["mha", "gqa"],
                   help="MHA (kv heads = h) and / or GQA (kv heads = h / --gqa-group)")
    p.add_argument("--peak-reps", type=int, default=2,
                   help="profiled calls per row for the peak memory (the least is reported: "
                        "async send / receive buffers die at timing-dependent moments)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: s 1024, GQA only, 1 rep, 1 peak rep, < 60 s")
    p.add_argument("--json", default=None, help=f"write the rows here (default {DEFAULT_JSON}; "
                                                "--quick writes none unless given)")
    args = p.parse_args()
    if args.quick:
        args.seq, args.reps, args.attention, args.peak_reps = [1024], 1, ["gqa"], 1
    kinds = list(dict.fromkeys(args.documents))
    json_path = args.json if args.json is not None else (None if args.quick else DEFAULT_JSON)
    h, d, b = args.heads, args.head_dim, args.batch
    heads_list = [x for kind, x in (("mha", (h, h)), ("gqa", (h, h // args.gqa_group)))
                  if kind in args.attention]
    command = " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv])
    machine = (f"{platform.node()}: {_cpu_name()}, {os.cpu_count()} cores, "
               f"{platform.system()} {platform.release()}, Python {platform.python_version()}")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"command: {command}\ntorch {torch.__version__}, gloo, fp32 on CPU; machine: {machine}; "
          f"load average at start {load}")
    print(f"One causal attention layer, forward + backward, b={b}, h={h}, d={d}, GQA h/kv = "
          f"{args.gqa_group}; bytes per rank (every rank equal); time: median of {args.reps} "
          f"interleaved repetitions, max over ranks; one thread per rank.")
    for s in args.seq:
        counts = {kind: document_pairs(document_ids(kind, b, s), b, s)[0] for kind in kinds}
        print(f"  s={s}: documents per row " + ", ".join(
            f"{kind} {counts[kind] // b if kind != 'none' else '-'}" for kind in kinds))
    header = (f"{'c':>2} {'mode':>8} {'a x r':>5} {'heads':>9} {'s':>6} {'docs':>8} | "
              f"{'fwd a2a':>8} {'fwd ring':>8} {'fwd MiB':>8} {'§14 fwd':>8} {'meas/§14':>8} | "
              f"{'bwd MiB':>8} {'f+b MiB':>8} {'=exact':>6} | {'median ms':>9} {'vs best':>7} "
              f"{'/none':>5} | {'peak MiB':>8} {'/none':>5} | {'fwd MFLOP':>9} {'max/min':>7}")
    rows = []
    for degree in args.degrees:
        start = time.perf_counter()
        per_rank = run_distributed(_run, degree, heads_list, args.seq, d, b, args.reps, kinds,
                                   args.peak_reps, timeout_s=3600.0, collective_timeout_s=600.0)
        for rank_rows in per_rank[1:]:
            for mine, first in zip(rank_rows, per_rank[0]):
                assert mine["bytes"] == first["bytes"], ("ranks disagree", mine, first)
                assert mine["median_s"] == first["median_s"], ("ranks disagree", mine, first)
        print(f"\n{header}\n{'-' * len(header)}")
        table = []
        for i, row in enumerate(per_rank[0]):
            mine = [rank_rows[i] for rank_rows in per_rank]          # this row on every rank
            a, r, s, hq, kv = row["a"], row["r"], row["seq"], row["heads"], row["kv_heads"]
            sent = row["bytes"]
            exact = hybrid_comm_bytes(b, s, hq, kv, d, a, r)
            assert sent == exact, ("measured bytes differ from hybrid_comm_bytes", row, exact)
            num_docs, doc_pairs = document_pairs(document_ids(row["documents"], b, s), b, s)
            total = sum((hq // a) * x["pairs"] for x in mine)           # (pair, head)s computed
            assert total == hq * doc_pairs, ("plan work differs from the documents' pairs", row,
                                             total, hq * doc_pairs)
            fwd = sent["a2a_forward"] + sent["ring_forward"]
            bwd = sent["a2a_backward"] + sent["ring_backward"]
            design = 4 * design_forward_elements(b, s, hq, kv, d, a, r)
            flops = [x["forward_flops"] for x in mine]
            peaks = [x["peak_bytes"] for x in mine]
            plan_s = max(x["plan_s"] for x in mine)
            high = max(x["peak_bytes_high"] for x in mine)
            for key in ("rank", "ring_rank", "peak_bytes", "peak_bytes_high", "pairs", "plan_s",
                        "forward_flops"):
                row.pop(key)
            row.update(forward_bytes=fwd, backward_bytes=bwd, total_bytes=fwd + bwd,
                       design_forward_bytes=design, exact_equal=True, num_documents=num_docs,
                       peak_bytes_max=max(peaks), peak_bytes_min=min(peaks),
                       peak_bytes_per_rank=peaks, peak_bytes_highest_sample=high,
                       forward_flops_max=max(flops), forward_flops_min=min(flops),
                       forward_flops_per_rank=flops,
                       forward_flops_balance=_ratio(max(flops), min(flops)),
                       plan_s_max=plan_s)
            table.append(row)
        for row in table:
            s, hq, kv, kind = row["seq"], row["heads"], row["kv_heads"], row["documents"]
            same = [x for x in table if (x["seq"], x["heads"], x["kv_heads"], x["documents"])
                    == (s, hq, kv, kind)]
            base = next((x for x in table if (x["seq"], x["heads"], x["kv_heads"], x["mode"],
                                              x["documents"]) == (s, hq, kv, row["mode"], "none")),
                        None)                                  # the same mode, no documents
            row.update(time_vs_none=_ratio(row["median_s"], base and base["median_s"]),
                       peak_vs_none=_ratio(row["peak_bytes_max"],
                                           base and base["peak_bytes_max"]))
            best = min(x["median_s"] for x in same)
            sent, a, r = row["bytes"], row["a"], row["r"]
            fwd, bwd = row["forward_bytes"], row["backward_bytes"]
            design = row["design_forward_bytes"]
            print(f"{degree:>2} {row['mode']:>8} {f'{a}x{r}':>5} {_heads_label(hq, kv):>9} {s:>6} "
                  f"{kind:>8} | {sent['a2a_forward'] / MIB:>8.2f} "
                  f"{sent['ring_forward'] / MIB:>8.2f} {fwd / MIB:>8.2f} {design / MIB:>8.2f} "
                  f"{fwd / design:>8.3f} | {bwd / MIB:>8.2f} "
                  f"{(fwd + bwd) / MIB:>8.2f} {'yes':>6} | {1e3 * row['median_s']:>9.1f} "
                  f"{row['median_s'] / best:>6.2f}x {_fmt_ratio(row['time_vs_none'])} | "
                  f"{row['peak_bytes_max'] / MIB:>8.2f} {_fmt_ratio(row['peak_vs_none'])} | "
                  f"{row['forward_flops_max'] / 1e6:>9.4g} "
                  f"{_fmt_ratio(row['forward_flops_balance'], 7)}")
            rows.append(row)
        print(f"    (c={degree}: {time.perf_counter() - start:.1f} s with spawn)")
    print("\nfwd a2a / fwd ring: counters 'sp/all_to_all' / 'cp/ring_p2p' of one forward; "
          "§14 fwd: the design formula; =exact: measured forward and backward equal "
          "hybrid_comm_bytes (documents too).\n"
          "vs best: against the fastest mode of the same (heads, s, docs); /none: this row over "
          "the same mode's no-document row.\n"
          "peak MiB: max over ranks of the peak live tensor bytes of one forward + backward "
          "(profiler memory events, above the start; the least of --peak-reps calls).\n"
          "fwd MFLOP: max over ranks of 4 d (h/a) (query, key) pairs of the rank's ring plan "
          "(forward); max/min: over ranks (1.00x = balanced). Plan time (inside each call): "
          "plan_s_max in the JSON.")
    print("\nCrossover per (degree, heads, documents): cheapest in bytes (forward + backward, the "
          "same at every s) and in time")
    crossovers = []
    for degree in args.degrees:
        for hq, kv in heads_list:
            for kind in kinds:
                mine = [x for x in rows if (x["degree"], x["heads"], x["kv_heads"], x["documents"])
                        == (degree, hq, kv, kind)]
                s0 = mine[0]["seq"]
                by_bytes = sorted((x for x in mine if x["seq"] == s0),
                                  key=lambda x: x["total_bytes"])
                ranking = " < ".join(
                    f"{x['mode']} ({x['total_bytes'] / by_bytes[0]['total_bytes']:.2f}x)"
                    for x in by_bytes)
                winners = []
                for s in args.seq:
                    at_s = sorted((x for x in mine if x["seq"] == s), key=lambda x: x["median_s"])
                    ratio = at_s[1]["median_s"] / at_s[0]["median_s"]
                    winners.append((s, at_s[0]["mode"], ratio))
                changes = [f"{winners[i][1]} -> {winners[i + 1][1]} between "
                           f"s={winners[i][0]} and {winners[i + 1][0]}"
                           for i in range(len(winners) - 1) if winners[i][1] != winners[i + 1][1]]
                time_text = ", ".join(f"s={s}: {m} ({ratio:.2f}x ahead)"
                                      for s, m, ratio in winners)
                crossed = 'time crossover ' + '; '.join(changes) if changes else 'no time crossover'
                print(f"  c={degree} {_heads_label(hq, kv)} docs {kind}: bytes {ranking}; time "
                      f"{time_text}; {crossed}")
                crossovers.append({"degree": degree, "heads": hq, "kv_heads": kv,
                                   "documents": kind,
                                   "bytes_ranking": [x["mode"] for x in by_bytes],
                                   "time_winner_per_seq": {str(s): m for s, m, _ in winners},
                                   "time_crossovers": changes})
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump({"command": command, "torch": torch.__version__, "machine": machine,
                       "load_average_at_start": load,
                       "batch": b, "heads": h, "head_dim": d, "gqa_group": args.gqa_group,
                       "reps": args.reps, "documents": kinds, "docs_per_row": DOCS_PER_ROW,
                       "peak_reps": args.peak_reps,
                       "peak_memory": "peak live tensor bytes (profiler memory events) of one "
                                      "forward + backward, per rank, above the start",
                       "rows": rows, "crossovers": crossovers}, f, indent=1)
        print(f"\nrows written to {json_path}")


if __name__ == "__main__":
    main()
