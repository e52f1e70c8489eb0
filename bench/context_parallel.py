#!/usr/bin/env python
"""Ulysses vs ring vs the Ulysses x ring hybrid: bytes sent and time per attention layer (docs/design.md §14).

At context degree c = 2 and 4 on gloo ranks (spawned on this CPU), one causal attention layer
forward + backward on random q, k, v of this rank's tokens, through
megatron_sp.context_parallel.hybrid.hybrid_attention in every mode (same kernels, same layout code):

  ulysses   a = c, r = 1   seq->head all-to-all, attention over the whole sequence, head->seq
  ring      a = 1, r = c   zigzag tokens, kv blocks round the ring (context_parallel.ring)
  hybrid    a = 2, r = 2   (c = 4 only) all-to-all over adjacent pairs, then a ring of 2

for MHA (kv heads = h) and GQA (h/kv = --gqa-group, 4 by default). Per rank: the bytes sent
(comm_stats counters "sp/all_to_all" and "cp/ring_p2p", every rank the same; asserted equal to
hybrid_comm_bytes, the exact count) and the formula of docs/design.md §14 for the forward,

  §14 forward   (2 + 2/G) N H / (a r)  [all-to-alls, a > 1]  +  2 (r-1) N H / (G a r)  [ring]
                N = b s tokens, H = h d, G = h / kv heads (elements; x4 bytes in fp32)

(exact: the all-to-alls send (a-1)/a of that, and G becomes h / max(kv, a) once kv heads are
replicated; backward: the all-to-alls the same again, the ring (r-1) kv blocks plus r fp32 dk, dv
blocks). Time: median over --reps interleaved repetitions (the modes' order rotates every
repetition; the first is a warm-up), max over ranks. Last, per (degree, heads), which mode is
cheapest in bytes and in time, and at which sequence length the time winner changes.

    python bench/context_parallel.py                  # c 2 4, s 4K 8K, h 8, d 8, 3 reps (~5 min)
    python bench/context_parallel.py --quick          # smoke run, < 60 s
    python bench/context_parallel.py --seq 4096 8192 16384 --reps 5   # up to 16K (~20 min here)
    python bench/context_parallel.py --degrees 4 --seq 16384 --heads 16 --reps 7

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

import torch  # noqa: E402

from megatron_sp import comm_stats  # noqa: E402
from megatron_sp.context_parallel import COMM_KIND as RING_KIND  # noqa: E402
from megatron_sp.context_parallel.hybrid import (hybrid_attention, hybrid_comm_bytes,  # noqa: E402
                                                 hybrid_group_ranks)
from megatron_sp.testing import run_distributed  # noqa: E402
from megatron_sp.ulysses import COMM_KIND as A2A_KIND  # noqa: E402

MIB = 1024 * 1024
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                            "context_parallel_cpu.json")


def modes(degree: int) -> list[tuple[str, int, int]]:
    """(name, a, r) of the modes compared at this context degree."""
    out = [("ulysses", degree, 1), ("ring", 1, degree)]
    if degree == 4:
        out.append(("hybrid", 2, 2))
    return out


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


def _run(rank, world, heads_list, seqs, head_dim, batch, reps):
    """Per (h, kv, s, mode): bytes this rank sent (forward / backward, by counter) and the median
    seconds of forward + backward (max over ranks)."""
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

            def layer(a, r):
                q.grad = k.grad = v.grad = None
                hybrid_attention(q, k, v, *groups[(a, r)]).backward(dout)

            sent = {}
            for name, a, r in layouts:           # bytes of one forward and one backward
                comm_stats.reset()
                out = hybrid_attention(q, k, v, *groups[(a, r)])
                forward = comm_stats.snapshot()
                comm_stats.reset()
                out.backward(dout)
                backward = comm_stats.snapshot()
                sent[name] = {"a2a_forward": forward.get(A2A_KIND, 0),
                              "ring_forward": forward.get(RING_KIND, 0),
                              "a2a_backward": backward.get(A2A_KIND, 0),
                              "ring_backward": backward.get(RING_KIND, 0)}
            times = {name: [] for name, _, _ in layouts}
            for rep in range(reps + 1):          # repetition 0 warms up
                order = layouts[rep % len(layouts):] + layouts[:rep % len(layouts)]
                for name, a, r in order:
                    dist.barrier()
                    start = time.perf_counter()
                    layer(a, r)
                    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    if rep:
                        times[name].append(elapsed.item())
            for name, a, r in layouts:
                results.append({"degree": world, "mode": name, "a": a, "r": r, "heads": h,
                                "kv_heads": kv, "seq": s, "bytes": sent[name],
                                "median_s": statistics.median(times[name]),
                                "times_s": times[name]})
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--degrees", type=int, nargs="+", default=[2, 4], choices=[2, 4])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--heads", type=int, default=8, help="query heads h")
    p.add_argument("--gqa-group", type=int, default=4, help="GQA: query heads per kv head")
    p.add_argument("--head-dim", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (after one warm-up)")
    p.add_argument("--quick", action="store_true", help="smoke run: s 1024 2048, 2 reps, < 60 s")
    p.add_argument("--json", default=None, help=f"write the rows here (default {DEFAULT_JSON}; "
                                                "--quick writes none unless given)")
    args = p.parse_args()
    if args.quick:
        args.seq, args.reps = [1024, 2048], 2
    json_path = args.json if args.json is not None else (None if args.quick else DEFAULT_JSON)
    h, d, b = args.heads, args.head_dim, args.batch
    heads_list = [(h, h), (h, h // args.gqa_group)]
    command = " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv])
    machine = (f"{platform.node()}: {_cpu_name()}, {os.cpu_count()} cores, "
               f"{platform.system()} {platform.release()}, Python {platform.python_version()}")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"command: {command}\ntorch {torch.__version__}, gloo, fp32 on CPU; machine: {machine}; "
          f"load average at start {load}")
    print(f"One causal attention layer, forward + backward, b={b}, h={h}, d={d}, GQA h/kv = "
          f"{args.gqa_group}; bytes per rank (every rank equal); time: median of {args.reps} "
          f"interleaved repetitions, max over ranks; one thread per rank.")
    header = (f"{'c':>2} {'mode':>8} {'a x r':>5} {'heads':>9} {'s':>6} | {'fwd a2a':>8} "
              f"{'fwd ring':>8} {'fwd MiB':>8} {'§14 fwd':>8} {'meas/§14':>8} | {'bwd MiB':>8} "
              f"{'f+b MiB':>8} {'=exact':>6} | {'median ms':>9} {'vs best':>7}")
    rows = []
    for degree in args.degrees:
        start = time.perf_counter()
        per_rank = run_distributed(_run, degree, heads_list, args.seq, d, b, args.reps,
                                   timeout_s=3600.0, collective_timeout_s=600.0)
        for rank_rows in per_rank[1:]:
            for mine, first in zip(rank_rows, per_rank[0]):
                assert mine["bytes"] == first["bytes"], ("ranks disagree", mine, first)
        print(f"\n{header}\n{'-' * len(header)}")
        for row in per_rank[0]:
            a, r, s, hq, kv = row["a"], row["r"], row["seq"], row["heads"], row["kv_heads"]
            sent = row["bytes"]
            exact = hybrid_comm_bytes(b, s, hq, kv, d, a, r)
            assert sent == exact, ("measured bytes differ from hybrid_comm_bytes", row, exact)
            fwd = sent["a2a_forward"] + sent["ring_forward"]
            bwd = sent["a2a_backward"] + sent["ring_backward"]
            design = 4 * design_forward_elements(b, s, hq, kv, d, a, r)
            same = [x for x in per_rank[0] if (x["seq"], x["heads"], x["kv_heads"]) == (s, hq, kv)]
            best = min(x["median_s"] for x in same)
            row.update(forward_bytes=fwd, backward_bytes=bwd, total_bytes=fwd + bwd,
                       design_forward_bytes=design, exact_equal=True)
            print(f"{degree:>2} {row['mode']:>8} {f'{a}x{r}':>5} {_heads_label(hq, kv):>9} {s:>6} | "
                  f"{sent['a2a_forward'] / MIB:>8.2f} {sent['ring_forward'] / MIB:>8.2f} "
                  f"{fwd / MIB:>8.2f} {design / MIB:>8.2f} {fwd / design:>8.3f} | {bwd / MIB:>8.2f} "
                  f"{(fwd + bwd) / MIB:>8.2f} {'yes':>6} | {1e3 * row['median_s']:>9.1f} "
                  f"{row['median_s'] / best:>6.2f}x")
            rows.append(row)
        print(f"    (c={degree}: {time.perf_counter() - start:.1f} s with spawn)")
    print("\nfwd a2a / fwd ring: counters 'sp/all_to_all' / 'cp/ring_p2p' of one forward; §14 fwd: "
          "the design formula; =exact: measured forward and backward equal hybrid_comm_bytes.")
    print("\nCrossover per (degree, heads): cheapest in bytes (forward + backward, the same at "
          "every s) and in time")
    crossovers = []
    for degree in args.degrees:
        for hq, kv in heads_list:
            mine = [x for x in rows if (x["degree"], x["heads"], x["kv_heads"]) == (degree, hq, kv)]
            s0 = mine[0]["seq"]
            by_bytes = sorted((x for x in mine if x["seq"] == s0), key=lambda x: x["total_bytes"])
            ranking = " < ".join(f"{x['mode']} ({x['total_bytes'] / by_bytes[0]['total_bytes']:.2f}x)"
                                 for x in by_bytes)
            winners = []
            for s in args.seq:
                at_s = sorted((x for x in mine if x["seq"] == s), key=lambda x: x["median_s"])
                ratio = at_s[1]["median_s"] / at_s[0]["median_s"]
                winners.append((s, at_s[0]["mode"], ratio))
            changes = [f"{winners[i][1]} -> {winners[i + 1][1]} between s={winners[i][0]} and "
                       f"{winners[i + 1][0]}" for i in range(len(winners) - 1)
                       if winners[i][1] != winners[i + 1][1]]
            time_text = ", ".join(f"s={s}: {m} ({ratio:.2f}x ahead)" for s, m, ratio in winners)
            print(f"  c={degree} {_heads_label(hq, kv)}: bytes {ranking}; time {time_text}; "
                  f"{'time crossover ' + '; '.join(changes) if changes else 'no time crossover'}")
            crossovers.append({"degree": degree, "heads": hq, "kv_heads": kv,
                               "bytes_ranking": [x["mode"] for x in by_bytes],
                               "time_winner_per_seq": {str(s): m for s, m, _ in winners},
                               "time_crossovers": changes})
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump({"command": command, "torch": torch.__version__, "machine": machine,
                       "load_average_at_start": load,
                       "batch": b, "heads": h, "head_dim": d, "gqa_group": args.gqa_group,
                       "reps": args.reps, "rows": rows, "crossovers": crossovers}, f, indent=1)
        print(f"\nrows written to {json_path}")


if __name__ == "__main__":
    main()
