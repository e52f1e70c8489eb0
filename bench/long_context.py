#!/usr/bin/env python
"""Activation bytes saved for backward per rank against sequence length, for sp = 1, 2, 4 and each
memory technique on/off (measured with megatron_sp.memory's saved-tensor accounting on gloo ranks, CPU,
fp32), next to the planner's prediction.

    python bench/long_context.py                       # llama-tiny shapes, seq 1K..4K
    python bench/long_context.py --seqs 2048 8192 --layers 2

Columns: MB per rank (activations; weight copies excluded), and pred/measured.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_sp.memory import TECHNIQUES as ALL_TECHNIQUES  # noqa: E402
from megatron_sp.memory import MemoryOptions, measure_saved_bytes  # noqa: E402
from megatron_sp.memory.planner import activation_bytes  # noqa: E402
from megatron_sp.mesh import ParallelMesh  # noqa: E402
from megatron_sp.models import GPTModel, preset  # noqa: E402
from megatron_sp.models.init import init_parameters  # noqa: E402
from megatron_sp.testing import run_distributed  # noqa: E402

# "auto" keeps >= 2048 tokens per tile (one tile, the plain path, at these lengths): fixed counts
# show what tiling and chunking remove
TECHNIQUES = {name: {k: 4 if v == "auto" else v for k, v in ALL_TECHNIQUES[name].items()} for name in (
    "plain", "full recompute", "selective", "tiled mlp", "chunked loss", "offload+full", "all")}


def _measure(rank, world, cfg_kwargs, seqs, sps):
    cfg = preset("llama-tiny", **cfg_kwargs)
    rows = []
    for sp in sps:
        mesh = ParallelMesh.single() if sp == 1 else ParallelMesh.from_sizes(sp=sp)
        if mesh.sp_size == 1 and sp > 1:
            continue
        for seq in seqs:
            for name, kw in TECHNIQUES.items():
                mem = MemoryOptions(**kw)
                model = GPTModel(cfg, mesh if sp > 1 else ParallelMesh.single(), memory=mem)
                init_parameters(model, seed=1)
                g = torch.Generator().manual_seed(0)
                ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)
                rep = measure_saved_bytes(model, ids, ids.roll(1, 1))[1]
                pred = activation_bytes(cfg, seq, 1, sp=sp, memory=mem, device="cpu")
                rows.append((sp, seq, name, rep["device_bytes"], rep["host_bytes"],
                             pred["total"] / max(rep["device_bytes"], 1)))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    args = p.parse_args()
    cfg_kwargs = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                      num_query_groups=4, ffn_hidden_size=4 * args.hidden, vocab_size=8192,
                      max_position_embeddings=max(args.seqs))
    rows = []
    rows += run_distributed(_measure, 1, cfg_kwargs, args.seqs, [1], timeout_s=900)[0]
    for sp in (2, 4):
        rows += run_distributed(_measure, sp, cfg_kwargs, args.seqs, [sp], timeout_s=900)[0]
    print(f"llama-tiny shapes {cfg_kwargs}; fp32 CPU; MB saved for backward per rank (host: offloaded)")
    names = list(TECHNIQUES)
    print(f"{'sp':>3} {'seq':>6} " + " ".join(f"{n:>15}" for n in names) + "   pred/meas range")
    table = {}
    for sp, seq, name, dev, host, ratio in rows:
        table.setdefault((sp, seq), {})[name] = (dev, host, ratio)
    for (sp, seq), row in sorted(table.items()):
        cells = []
        for n in names:
            dev, host, _ = row[n]
            cells.append(f"{dev / 2**20:8.2f}" + (f"+{host / 2**20:5.1f}h" if host else "       "))
        ratios = [r for _, _, r in row.values()]
        print(f"{sp:>3} {seq:>6} " + " ".join(f"{c:>15}" for c in cells)
              + f"   {min(ratios):.3f}-{max(ratios):.3f}")


if __name__ == "__main__":
    main()
