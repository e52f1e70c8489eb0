#!/usr/bin/env python
"""The MoE layer (models/moe.py, issue 37) against Hugging Face's Qwen3-MoE block, one rank.

Same weights, same tokens: one forward + backward of models.moe.MoELayer (its torch._grouped_mm
path and its per-expert loop) and of transformers' Qwen3MoeSparseMoeBlock (norm_topk_prob on: our
default routing), fp32 on this CPU (or bf16 with --bf16 where grouped mm takes it). Median of
--reps repetitions after one warm-up; the ratio is HF's time / ours; the outputs' largest
difference is printed beside it. Writes bench/results/moe_cpu.json (the GPU script's row:
python bench/moe.py --bf16 on CUDA, not run here).

--ep: the dispatch of expert parallelism on 4 gloo ranks (spawned here, dp 4, --tokens each): per
ep in 1, 2, 4 one MoE layer's forward + backward, the bytes a rank sends in the alltoall
dispatcher's row all-to-alls (comm_stats "moe/dispatch all_to_all", checked equal to
megatron_sp.moe.dispatch.dispatch_bytes on every rank) and the median time (max over ranks;
4 ranks on this machine's cores: oversubscribed, a comparison of ep sizes here, not a GPU figure).
Writes bench/results/moe_dispatch_cpu.json.

    python bench/moe.py                    # T 4096, H 512, 16 experts, top 4, F 256, 5 reps
    python bench/moe.py --tokens 1024 --reps 3
    python bench/moe.py --ep               # dispatch bytes and time at ep 1 / 2 / 4
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


def _dispatch_rank(rank, world, args):
    """One rank of the --ep job: per ep, (bytes sent per layer fwd + bwd, formula, median s)."""
    from megatron_sp import comm_stats
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models.moe import MoEConfig, MoEMLP
    from megatron_sp.moe.comm import ROWS_KIND
    from megatron_sp.moe.dispatch import dispatch_bytes
    import torch.distributed as dist
    torch.set_num_threads(1)
    mesh = ParallelMesh.from_sizes(dp=world)
    cfg = MoEConfig(num_experts=args.experts, moe_ffn_hidden_size=args.ffn,
                    moe_router_topk=args.topk)
    gen = torch.Generator().manual_seed(100 + rank)           # each rank its own tokens
    x = torch.randn(1, args.tokens, args.hidden, generator=gen)
    out = {}
    for ep in (1, 2, 4):
        torch.manual_seed(0)
        layer = MoEMLP(cfg, args.hidden, expert_groups=mesh.expert_groups(ep) if ep > 1 else None)
        times, sent = [], 0
        for rep in range(args.reps + 1):
            comm_stats.reset()
            dist.barrier()
            start = time.perf_counter()
            layer(x.clone().requires_grad_()).sum().backward()
            dist.barrier()
            if rep:
                times.append(time.perf_counter() - start)
            sent = comm_stats.snapshot().get(ROWS_KIND, 0)
        expected = 0
        if ep > 1:   # every ep rank's routed rows per expert, from the router as the layer ran
            with torch.no_grad():
                _, indices, _ = layer.router(x.reshape(-1, args.hidden))
            counts = torch.bincount(indices.reshape(-1), minlength=args.experts)
            group = mesh.expert_groups(ep).ep_group
            gathered = [torch.empty_like(counts) for _ in range(ep)]
            dist.all_gather(gathered, counts, group=group)
            expected = dispatch_bytes(torch.stack(gathered), mesh.expert_groups(ep).ep_rank,
                                      args.hidden, x.element_size())
        out[ep] = (sent, expected, statistics.median(times))
    return out


def dispatch_rows(args) -> list[dict]:
    """--ep: the dispatch bytes and times at ep 1, 2, 4 on 4 gloo ranks (module docstring)."""
    from megatron_sp.testing import run_distributed
    per_rank = run_distributed(_dispatch_rank, 4, args)
    rows = []
    for ep in (1, 2, 4):
        sent = [r[ep][0] for r in per_rank]
        assert all(r[ep][0] == r[ep][1] for r in per_rank), (ep, per_rank)   # the formula
        rows.append({"ep": ep, "experts_per_rank": args.experts // ep,
                     "bytes_per_layer": statistics.mean(sent), "bytes_max": max(sent),
                     "ms": max(r[ep][2] for r in per_rank) * 1e3})
    base = rows[0]["ms"]
    for r in rows:
        r["time_ratio"] = base / r["ms"]
    return rows


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
    p.add_argument("--ep", action="store_true", help="the expert-parallel dispatch on 4 ranks")
    args = p.parse_args(argv)
    if args.ep:
        return dispatch_main(args)
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
            notes=[shape, "dispatch bytes at ep 2 / 4: bench/moe.py --ep (its own table)"])
        print("wrote", os.path.relpath(path))
    return rows


def dispatch_main(args) -> list[dict]:
    rows = dispatch_rows(args)
    shape = (f"4 gloo ranks (dp 4), T {args.tokens} per rank, H {args.hidden}, E {args.experts}, "
             f"top {args.topk}, F {args.ffn}, fp32, one MoE layer forward + backward")
    print(f"MoE dispatch ({shape}), median of {args.reps}")
    print(f"{'ep':>3s} {'experts/rank':>13s} {'bytes/layer':>12s} {'max':>12s} {'ms':>9s} "
          f"{'ep 1 / ep':>10s}")
    for r in rows:
        print(f"{r['ep']:3d} {r['experts_per_rank']:13d} {r['bytes_per_layer']:12.0f} "
              f"{r['bytes_max']:12d} {r['ms']:9.1f} {r['time_ratio']:10.2f}")
    if not args.no_write:
        from performance_table import write_results
        path = write_results(
            "moe_dispatch_cpu", "moe_dispatch", rows,
            title="Expert parallelism: the alltoall dispatcher's bytes per MoE layer and rank",
            columns=[("ep", "ep"), ("experts_per_rank", "experts / rank"),
                     ("bytes_per_layer", "bytes / layer (mean)"), ("bytes_max", "max"),
                     ("ms", "ms (median, max over ranks)"), ("time_ratio", "ep 1 / ep")],
            notes=[shape, "bytes: the row all-to-alls (forward dispatch + combine, backward "
                   "both again), equal to dispatch_bytes on every rank"])
        print("wrote", os.path.relpath(path))
    return rows


if __name__ == "__main__":
    main()
