"""Bytes sent per attention layer and rank: Ulysses (measured) against the formulas (DESIGN 4, 8).

Runs UlyssesAttention forward (SDPA local attention, fp32, MHA) on sp gloo ranks for each sp and
sequence length and reads the comm_stats counter "sp/all_to_all" of every rank (they must agree).
Figures are elements per rank (bytes / 4 for fp32), forward only; backward sends the same again.

Formulas printed, with b batch, s sequence, H = h*d hidden of the attention heads on this tp rank:
  Ulysses exact   4 * (sp-1)/sp * b*(s/sp)*H   four all-to-alls (q, k, v, out), each sending
                                               (sp-1)/sp of the local [b, s/sp, h, d] tensor
                                               (with GQA: (2h + 2*max(g, sp)) * d instead of 4H)
  DESIGN approx   4 * b*s*H/sp                 the "about 4sH/sp" of DESIGN 4
  Megatron SP     2 * (t-1)/t * b*s*H, t = sp  tensor parallel with sequence sharding over the same
                                               number of ranks: per attention block one all-gather
                                               of the [b, s/t, H] input and one reduce-scatter of
                                               the [b, s, H] output, each sending (t-1)/t * b*s*H
                                               per rank (a whole layer, with the MLP block, twice)
so Megatron SP / Ulysses = sp/2: Ulysses' traffic per rank falls as 1/sp, Megatron's does not.

    python bench/ulysses_comm.py                      # sp 2 4 8, s 2048..16384, h 16, d 8
    python bench/ulysses_comm.py --seq 1024 4096 --sp 2 4 --heads 32 --head-dim 4
"""
from __future__ import annotations

import argparse
import time

import torch

from megatron_sp import comm_stats
from megatron_sp.attention import SDPAAttention
from megatron_sp.testing import run_distributed
from megatron_sp.ulysses import COMM_KIND, UlyssesAttention


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
        sent[s] = comm_stats.snapshot()[COMM_KIND]
    return sent


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
    args = parser.parse_args()
    hidden = args.heads * args.head_dim
    print(f"Forward elements sent per rank and attention layer (fp32 => bytes = 4x); "
          f"b={args.batch}, h={args.heads}, d={args.head_dim}, H={hidden}, MHA, tp=1.")
    header = (f"{'sp':>3} {'s':>6} | {'measured B':>11} {'measured el':>11} | {'Ulysses exact':>13} "
              f"{'4sH/sp':>9} | {'Megatron SP t=sp':>16} {'Meg/Uly':>7}")
    print(header)
    print("-" * len(header))
    for sp in args.sp:
        start = time.perf_counter()
        per_rank = run_distributed(_measure, sp, args.seq, args.heads, args.head_dim, args.batch)
        assert all(r == per_rank[0] for r in per_rank), f"ranks disagree: {per_rank}"
        for s in args.seq:
            measured = per_rank[0][s]
            f = formulas(sp, s, hidden, args.batch)
            assert measured == 4 * f["ulysses"], (sp, s, measured, f)
            print(f"{sp:>3} {s:>6} | {measured:>11,} {measured // 4:>11,} | {f['ulysses']:>13,.0f} "
                  f"{f['design']:>9,.0f} | {f['megatron_sp']:>16,.0f} "
                  f"{f['megatron_sp'] / f['ulysses']:>7.2f}")
        print(f"    (sp={sp}: {time.perf_counter() - start:.1f} s with spawn)")
    print("Measured = counter 'sp/all_to_all' of every rank (all equal), which equals the Ulysses "
          "exact formula; Megatron SP is a formula (all-gather + reduce-scatter per attention block).")


if __name__ == "__main__":
    main()
