"""Bytes sent per attention layer and rank: Ulysses (measured) against the formulas (docs/design.md §4, §8).

Runs UlyssesAttention forward (SDPA local attention, fp32, MHA) on sp gloo ranks for each sp and
sequence length and reads the comm_stats counter "sp/all_to_all" of every rank (they must agree).
Figures are elements per rank (bytes / 4 for fp32), forward only; backward sends the same again.

Formulas printed, with b batch, s sequence, H = h*d hidden of the attention heads on this tp rank:
  Ulysses exact   4 * (sp-1)/sp * b*(s/sp)*H   four all-to-alls (q, k, v, out), each sending
                                               (sp-1)/sp of the local [b, s/sp, h, d] tensor
                                               (with GQA: (2h + 2*max(g, sp)) * d instead of 4H)
  4sH/sp approx   4 * b*s*H/sp                 the "about 4sH/sp" of docs/design.md §4
  Megatron SP     2 * (t-1)/t * b*s*H, t = sp  tensor parallel with sequence sharding over the same
                                               number of ranks: per attention block one all-gather
                                               of the [b, s/t, H] input and one reduce-scatter of
                                               the [b, s, H] output, each sending (t-1)/t * b*s*H
                                               per rank (a whole layer, with the MLP block, twice)
so Megatron SP / Ulysses = sp/2: Ulysses' traffic per rank falls as 1/sp, Megatron's does not.

Second table: measured time per attention layer on gloo, q, k and v in ONE packed all-to-all
(fused, the default) against one all-to-all each (separate), same bytes: the all-to-alls of one
layer's forward and backward alone (exchange), and a whole UlyssesAttention forward + backward over
SDPA (layer); medians of interleaved repetitions, max over ranks.

    python bench/ulysses_comm.py                      # sp 2 4 8, s 2048..16384, h 16, d 8
    python bench/ulysses_comm.py --seq 1024 4096 --sp 2 4 --heads 32 --head-dim 4
    python bench/ulysses_comm.py --time-sp 2 4 --time-seq 4096 --kv-heads 4   # timing, GQA
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_sp import comm_stats
from megatron_sp.attention import SDPAAttention
from megatron_sp.testing import run_distributed
from megatron_sp.ulysses import (COMM_KIND, UlyssesAttention, head_to_seq_all_to_all,
                                 seq_to_head_all_to_all, seq_to_head_qkv_all_to_all)


def _measure(rank, world, seqs, heads, head_dim, batch):
    """Bytes this rank sends in one UlyssesAttention forward, per sequence length."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    attention = UlyssesAttention(SDPAAttention(), group)
    sent = {}
    for s in seqs:
        q, k, v = (torch.randn(batch, s // world, heads, head_dim) for _ in range(3))
        comm_stats.reset()
        with torch.no_grad():
            attention(q, k, v)
        sent[s] = comm_stats.snapshot()[COMM_KIND], comm_stats.calls()[COMM_KIND]
    return sent


def _time_layer(rank, world, s, heads, kv_heads, head_dim, batch, reps):
    """Median seconds (max over ranks) per attention layer: exchange only and whole layer,
    fused and separate, interleaved."""
    import torch.distributed as dist

    torch.manual_seed(rank)
    group = dist.new_group(list(range(world)))
    q = torch.randn(batch, s // world, heads, head_dim, requires_grad=True)
    k, v = (torch.randn(batch, s // world, kv_heads, head_dim, requires_grad=True) for _ in range(2))
    grad = torch.randn(batch, s // world, heads, head_dim)

    def exchange(fused):
        parts = seq_to_head_qkv_all_to_all(q, k, v, group) if fused else \
            [seq_to_head_all_to_all(t, group) for t in (q, k, v)]
        out = head_to_seq_all_to_all(parts[0], group)     # stands in for attention's output
        torch.autograd.backward([out] + list(parts[1:]),
                                [grad] + [torch.ones_like(p) for p in parts[1:]])

    layers = {fused: UlyssesAttention(SDPAAttention(), group, fuse_qkv=fused) for fused in (True, False)}

    def layer(fused):
        layers[fused](q, k, v).backward(grad)

    times = {(what, fused): [] for what in ("exchange", "layer") for fused in (True, False)}
    for rep in range(reps + 1):                           # the first repetition warms up
        for what, fn in (("exchange", exchange), ("layer", layer)):
            for fused in ((True, False) if rep % 2 else (False, True)):
                dist.barrier(group)
                start = time.perf_counter()
                fn(fused)
                elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
                if rep:
                    times[(what, fused)].append(elapsed.item())
    return {key: statistics.median(t) for key, t in times.items()}


def timing_table(args):
    kv = args.kv_heads or args.heads
    print(f"\nMeasured time per attention layer, forward + backward, gloo, fp32, b={args.batch}, "
          f"h={args.heads}, kv heads={kv}, d={args.head_dim}; median of {args.reps} interleaved "
          f"repetitions, max over ranks")
    header = (f"{'sp':>3} {'s':>6} | {'exchange fused ms':>17} {'separate ms':>11} {'sep/fused':>9} | "
              f"{'layer fused ms':>14} {'separate ms':>11} {'sep/fused':>9}")
    print(header + "\n" + "-" * len(header))
    rows = []
    for sp in args.time_sp:
        for s in args.time_seq:
            t = run_distributed(_time_layer, sp, s, args.heads, kv, args.head_dim, args.batch,
                                args.reps)[0]
            ex, lay = (t[("exchange", True)], t[("exchange", False)]), (t[("layer", True)], t[("layer", False)])
            print(f"{sp:>3} {s:>6} | {1e3 * ex[0]:>17.2f} {1e3 * ex[1]:>11.2f} {ex[1] / ex[0]:>8.2f}x | "
                  f"{1e3 * lay[0]:>14.2f} {1e3 * lay[1]:>11.2f} {lay[1] / lay[0]:>8.2f}x", flush=True)
            rows.append({"sp": sp, "seq": s, "exchange_fused_ms": 1e3 * ex[0],
                         "exchange_separate_ms": 1e3 * ex[1], "layer_fused_ms": 1e3 * lay[0],
                         "layer_separate_ms": 1e3 * lay[1]})
    print("exchange: seq->head of q, k, v (one packed all-to-all, or three) and head->seq of the "
          "output, forward and backward (2 vs 4 all-to-alls each way); layer: the same around SDPA.")
    return rows


def formulas(sp: int, s: int, hidden: int, batch: int) -> dict[str, float]:
    """Elements per rank and attention layer, forward (see the module docstring)."""
    return {
        "ulysses": 4 * (sp - 1) / sp * batch * (s / sp) * hidden,
        "design": 4 * batch * s * hidden / sp,
        "megatron_sp": 2 * (sp - 1) / sp * batch * s * hidden,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--kv-heads", type=int, default=None, help="timing: key/value heads (default h)")
    parser.add_argument("--time-sp", type=int, nargs="*", default=[2, 4], help="timing table sp sizes")
    parser.add_argument("--time-seq", type=int, nargs="+", default=[1024])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--no-bytes", action="store_true", help="only the timing table")
    parser.add_argument("--results", default="ulysses_comm_cpu",
                        help="write the rows to bench/results/NAME.json (docs/performance.md's "
                             "schema); '' writes nothing")
    args = parser.parse_args()
    rows = []
    if not args.no_bytes:
        rows += bytes_table(args)
    if args.time_sp:
        rows += timing_table(args)
    if args.results:
        print("wrote " + write_rows(rows, args))


RESULT_COLUMNS = [("sp", "sp"), ("seq", "s"), ("measured_bytes", "measured B"),
                  ("ulysses_elements", "Ulysses exact el"), ("design_elements", "4sH/sp el"),
                  ("megatron_sp_elements", "Megatron SP t=sp el"),
                  ("megatron_over_ulysses", "Meg/Uly"), ("a2a_calls", "a2a calls"),
                  ("exchange_fused_ms", "exchange fused ms"),
                  ("exchange_separate_ms", "exchange separate ms"),
                  ("layer_fused_ms", "layer fused ms"), ("layer_separate_ms", "layer separate ms")]


def write_rows(rows, args) -> str:
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from performance_table import write_results
    kv = args.kv_heads or args.heads
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return write_results(
        args.results, "ulysses_comm", rows, columns=RESULT_COLUMNS,
        title="Ulysses all-to-all bytes and time per attention layer and rank (gloo)",
        notes=[f"b={args.batch}, h={args.heads}, d={args.head_dim}, fp32, MHA, tp=1; bytes: forward, "
               f"every rank equal, equal to the exact formula (asserted)",
               f"times: forward + backward, kv heads {kv}, median of {args.reps} interleaved "
               f"repetitions, max over ranks; fused = q, k, v in one all-to-all; load average "
               f"{load:.1f} at the end (above the core count: times disturbed, bytes exact)"])


def bytes_table(args):
    hidden = args.heads * args.head_dim
    print(f"Forward elements sent per rank and attention layer (fp32 => bytes = 4x); "
          f"b={args.batch}, h={args.heads}, d={args.head_dim}, H={hidden}, MHA, tp=1.")
    header = (f"{'sp':>3} {'s':>6} | {'measured B':>11} {'measured el':>11} | {'Ulysses exact':>13} "
              f"{'4sH/sp':>9} | {'Megatron SP t=sp':>16} {'Meg/Uly':>7} | {'a2a calls':>9}")
    print(header)
    print("-" * len(header))
    rows = []
    for sp in args.sp:
        start = time.perf_counter()
        per_rank = run_distributed(_measure, sp, args.seq, args.heads, args.head_dim, args.batch)
        assert all(r == per_rank[0] for r in per_rank), f"ranks disagree: {per_rank}"
        for s in args.seq:
            measured, calls = per_rank[0][s]
            f = formulas(sp, s, hidden, args.batch)
            assert measured == 4 * f["ulysses"], (sp, s, measured, f)
            print(f"{sp:>3} {s:>6} | {measured:>11,} {measured // 4:>11,} | {f['ulysses']:>13,.0f} "
                  f"{f['design']:>9,.0f} | {f['megatron_sp']:>16,.0f} "
                  f"{f['megatron_sp'] / f['ulysses']:>7.2f} | {calls:>9}")
            rows.append({"sp": sp, "seq": s, "measured_bytes": measured,
                         "ulysses_elements": f["ulysses"], "design_elements": f["design"],
                         "megatron_sp_elements": f["megatron_sp"],
                         "megatron_over_ulysses": f["megatron_sp"] / f["ulysses"],
                         "a2a_calls": calls})
        print(f"    (sp={sp}: {time.perf_counter() - start:.1f} s with spawn)")
    print("Measured = counter 'sp/all_to_all' of every rank (all equal), which equals the Ulysses "
          "exact formula; Megatron SP is a formula (all-gather + reduce-scatter per attention block).")
    return rows


if __name__ == "__main__":
    main()
