#!/usr/bin/env python
"""The MoE layer (models/moe.py, issue 37) against Hugging Face's Qwen3-MoE block, one rank.

Same weights, same tokens: one forward + backward of models.moe.MoELayer (its torch._grouped_mm
path and its per-expert loop) and of transformers' Qwen3MoeSparseMoeBlock (norm_topk_prob on: our
default routing), fp32 on this CPU (or bf16 with --bf16 where grouped mm takes it). Median of
--reps repetitions after one warm-up; the ratio is HF's time / ours; the outputs' largest
difference is printed beside it. Writes bench/results/moe_cpu.json (the GPU script's row:
python bench/moe.py --bf16 on CUDA, not run here).

Not in this table yet: the dispatch bytes per layer at ep 2 / 4 (expert parallelism is not
implemented: every rank holds every expert, and no token is dispatched).

    python bench/moe.py                    # T 4096, H 512, 16 experts, top 4, F 256, 5 reps
    python bench/moe.py --tokens 1024 --reps 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402


def build(args, dtype, device):
    """(HF block, ours with grouped mm, ours with the loop), the same weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    from megatron_sp.models.moe import MoEConfig, MoELayer
    torch.manual_seed(0)
    hf = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(
        hidden_size=args.hidden, moe_intermediate_size=args.ffn, num_experts=args.experts,
        num_experts_per_tok=args.topk, norm_topk_prob=True))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.02)
    cfg = MoEConfig(num_experts=args.experts, moe_ffn_hidden_size=args.ffn,
                    moe_router_topk=args.topk)
    ours = []
    for grouped in (None, False):
        layer = MoELayer(cfg, args.hidden, use_grouped_mm=grouped)
        with torch.no_grad():
            layer.router.weight.copy_(hf.gate.weight)              # [E, H]
            layer.experts.w1.copy_(hf.experts.gate_up_proj)        # [E, 2F, H]
            layer.experts.w2.copy_(hf.experts.down_proj)           # [E, H, F]
        ours.append(layer.to(device, dtype))
    return hf.to(device, dtype), ours[0], ours[1]


def time_step(run, x, dy, reps):
    """Median and min seconds of forward + backward (after one warm-up), and the output."""
    def once():
        xi = x.clone().requires_grad_()
        out = run(xi)
        out.backward(dy)
        return out.detach()
    out = once()
    times = []
    for _ in range(reps):
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        once()
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    hf, grouped, loop = build(args, dtype, device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.tokens, args.hidden, generator=gen).to(device, dtype)
    dy = torch.randn(1, args.tokens, args.hidden, generator=gen).to(device, dtype)
    ref_s, ref_min, ref_out = time_step(hf, x, dy, args.reps)
    rows = [{"impl": "HF Qwen3MoeSparseMoeBlock", "ms": ref_s * 1e3, "min_ms": ref_min * 1e3,
             "ratio": 1.0, "max_abs_diff": 0.0}]
    for name, layer in (("ours, grouped mm", grouped), ("ours, per-expert loop", loop)):
        s, s_min, out = time_step(lambda t, layer=layer: layer(t)[0], x, dy, args.reps)
        rows.append({"impl": name, "ms": s * 1e3, "min_ms": s_min * 1e3, "ratio": ref_s / s,
                     "max_abs_diff": float((out.float() - ref_out.float()).abs().max())})
    shape = (f"T {args.tokens}, H {args.hidden}, E {args.experts}, top {args.topk}, "
             f"F {args.ffn}, {str(dtype).split('.')[-1]}, {device.type}")
    print(f"MoE layer forward + backward ({shape}), median of {args.reps}")
    print(f"{'implementation':28s} {'ms':>9s} {'min ms':>9s} {'HF / ours':>10s} {'max |diff|':>11s}")
    for r in rows:
        print(f"{r['impl']:28s} {r['ms']:9.2f} {r['min_ms']:9.2f} {r['ratio']:10.2f} "
              f"{r['max_abs_diff']:11.2e}")
    if not args.no_write:
        from performance_table import write_results
        for r in rows:
            r.update(tokens=args.tokens, hidden=args.hidden, experts=args.experts,
                     topk=args.topk, ffn=args.ffn)
        name = "moe_cpu" if device.type == "cpu" else "gpu_moe"
        path = write_results(
            name, "moe", rows, title="MoE layer forward + backward against HF's Qwen3-MoE block",
            columns=[("impl", "implementation"), ("tokens", "T"), ("experts", "E"),
                     ("topk", "k"), ("ms", "ms (median)"), ("min_ms", "min ms"),
                     ("ratio", "HF / ours"), ("max_abs_diff", "max |diff|")],
            notes=[shape, "dispatch bytes at ep 2 / 4: not run (no expert parallelism yet)"])
        print("wrote", os.path.relpath(path))
    return rows


if __name__ == "__main__":
    main()
