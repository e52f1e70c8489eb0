"""Packed-document attention on CPU: the blockwise path against full-mask SDPA (docs/design.md §5).

One attention call, forward + backward, fp32, b = 1, packed documents of random lengths (mean
--doc-mean tokens): full-mask SDPA (the [b, 1, s, s] bool mask that --reset-attention-mask built
before the blockwise path, CPU flash kernel with a mask) against blockwise_attention (block pairs
no document crosses skipped, the rest merged through the lse; what SDPA runs past MASK_TOKENS).
Per row: time (median of --reps), bytes saved for backward (the saved-tensor accountant,
storages counted once) plus the mask, and the largest single tensor (elements). FlexAttention has
no CPU backward and its eager CPU forward evaluates the mask densely, so it has no CPU row.

    python bench/document_attention.py                        # s 8192 16384, h 4, g 2, d 32
    python bench/document_attention.py --seq 4096 --reps 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from performance_table import write_results  # noqa: E402

from megatron_sp.attention.documents import document_causal_mask  # noqa: E402
from megatron_sp.attention.blockwise import (DEFAULT_BLOCK, blockwise_attention,  # noqa: E402
                                             blockwise_plan)
from megatron_sp.memory.accounting import SavedTensorAccountant  # noqa: E402


class _Largest(SavedTensorAccountant):
    largest = 0

    def _pack(self, t):
        self.largest = max(self.largest, t.numel())
        return super()._pack(t)


def full_mask(q, k, v, ids):
    mask = document_causal_mask(ids)                          # [b, 1, s, s] bool
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2), mask.numel() * mask.element_size()


def blockwise(q, k, v, ids):
    return blockwise_attention(q, k, v, causal=True, document_ids=ids), 0


def block_pairs(s, ids):
    """(query-key pairs the blockwise path's segments compute, % of the causal triangle's)."""
    b = ids.shape[0]
    work = sum(batch.work(b) for batch, _ in blockwise_plan(ids, s, DEFAULT_BLOCK, True))
    return work, f"{100 * work / (b * s * (s + 1) // 2):.1f}%"


def measure(fn, q, k, v, ids, dout, reps):
    times, saved = [], None
    for _ in range(reps):
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        acct = _Largest()
        t0 = time.perf_counter()
        with acct.recording():
            out, mask_bytes = fn(*qkv, ids)
        out.backward(dout)
        times.append(time.perf_counter() - t0)
        saved = (acct.report()["device_bytes"], mask_bytes, acct.largest)
    return statistics.median(times), saved


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--doc-mean", type=int, default=1024)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--out", default="document_attention_cpu")
    args = p.parse_args(argv)
    rows = []
    for s in args.seq:
        gen = torch.Generator().manual_seed(s)
        q, k, v, dout = (torch.randn(1, s, n, args.head_dim, generator=gen)
                         for n in (args.heads, args.kv_heads, args.kv_heads, args.heads))
        ids = (torch.rand(1, s, generator=gen) < 1 / args.doc_mean).long().cumsum(1)
        docs = int(ids[0, -1]) + 1
        run, triangle = block_pairs(s, ids)
        for name, fn in (("full-mask sdpa", full_mask), ("blockwise", blockwise)):
            median, (saved, mask, largest) = measure(fn, q, k, v, ids, dout, args.reps)
            rows.append({"attention": name, "seq": s, "documents": docs,
                         "heads": args.heads, "kv_heads": args.kv_heads,
                         "head_dim": args.head_dim, "fwd_bwd_s": round(median, 3),
                         "saved_mib": round(saved / 2**20, 1), "mask_mib": round(mask / 2**20, 1),
                         "largest_saved_elems": largest, "s_x_s": s * s,
                         "block_pairs": f"{run} ({triangle})" if fn is blockwise else "all"})
            print(rows[-1], flush=True)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    path = write_results(
        args.out, "document_attention", rows,
        title="Packed-document attention, CPU: blockwise vs full-mask SDPA (forward + backward)",
        columns=[("attention", "attention"), ("seq", "seq"), ("documents", "documents"),
                 ("fwd_bwd_s", "fwd+bwd (s)"), ("saved_mib", "saved for backward (MiB)"),
                 ("mask_mib", "s x s mask (MiB)"), ("largest_saved_elems", "largest saved tensor"),
                 ("s_x_s", "s x s"), ("block_pairs", "query-key pairs computed")],
        notes=[f"fp32, b 1, h {args.heads}, g {args.kv_heads}, d {args.head_dim}, documents of "
               f"mean length {args.doc_mean}, blockwise block {DEFAULT_BLOCK}, median of "
               f"{args.reps}; load average at the end {load} (a shared machine: times are rough)"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
