#!/usr/bin/env python
"""List feasible (tp, sp, pp, dp) layouts with memory settings for a long-context run, best first.

Example: an 8B Llama-style model at 4M tokens on 64 GPUs of 80 GB:

    python tools/plan_parallel.py --model llama-8b --seq-length 4194304 --global-batch-size 1 \
        --num-gpus 64 --gpu-memory-gb 80

Per-rank memory = model state (fp32 master weights 4 + fp32 grads 4 + Adam m, v 8 = 16 bytes/param;
bf16 autocast keeps no second copy of the weights) + activations of one micro-batch (times pp micro-
batches in flight with 1F1B) in bf16 from our implementation's per-op model (megatron_sp.memory.
planner; on CPU in fp32 it matches the measured saved bytes) + a reserve (allocator, workspace).
Communication: bytes one rank sends per step by kind (tp, sp all-to-all, pp, dp gradient all-reduce).
The Korthikanti et al. 16-bit per-layer figure is printed for reference.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sp.memory.planner import (BYTES_PER_PARAM, activation_bytes,  # noqa: E402
                                        korthikanti_layer_bytes, plan)
from megatron_sp.models import GPTConfig, preset  # noqa: E402


def build_config(args) -> GPTConfig:
    fields = {k: v for k, v in dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                   num_attention_heads=args.num_attention_heads,
                                   num_query_groups=args.num_query_groups,
                                   ffn_hidden_size=args.ffn_hidden_size,
                                   vocab_size=args.vocab_size).items() if v is not None}
    fields["max_position_embeddings"] = max(args.seq_length, 2048)
    if args.model:
        return preset(args.model, **fields)
    fields.setdefault("vocab_size", 32000)
    return GPTConfig(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
                     add_bias_linear=False, **fields)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="preset (llama-1b, llama-8b, gpt2-small, ...)")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-attention-heads", type=int)
    p.add_argument("--num-query-groups", type=int)
    p.add_argument("--ffn-hidden-size", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--global-batch-size", type=int, default=1, help="sequences per step")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-gpus", type=int, required=True)
    p.add_argument("--gpu-memory-gb", type=float, default=80.0)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--intra-node-gbps", type=float, default=450.0, help="GB/s per GPU (NVLink)")
    p.add_argument("--inter-node-gbps", type=float, default=50.0, help="GB/s per GPU (IB 400 Gb/s)")
    p.add_argument("--reserve-gb", type=float, default=4.0)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100/H200)")
    p.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOP utilisation")
    p.add_argument("--top", type=int, default=10)
    args = p.parse_args(argv)
    if not args.model and args.num_layers is None:
        p.error("give --model or the model flags (--num-layers --hidden-size --num-attention-heads)")
    cfg = build_config(args)
    plans = plan(cfg, args.seq_length, args.global_batch_size, args.num_gpus, args.gpu_memory_gb,
                 gpus_per_node=args.gpus_per_node, intra_node_gbps=args.intra_node_gbps,
                 inter_node_gbps=args.inter_node_gbps, reserve_gb=args.reserve_gb,
                 micro_batch=args.micro_batch_size, peak_tflops=args.peak_tflops, mfu=args.mfu)
    print(f"model: {cfg.num_parameters() / 1e9:.2f}B parameters, L={cfg.num_layers} H={cfg.hidden_size} "
          f"heads={cfg.num_attention_heads}/{cfg.num_query_groups} F={cfg.ffn_hidden_size} "
          f"V={cfg.vocab_size}; seq {args.seq_length}, global batch {args.global_batch_size}, "
          f"{args.num_gpus} GPUs x {args.gpu_memory_gb:g} GB")
    print(f"model state: {BYTES_PER_PARAM} bytes/param (fp32 weights, fp32 grads, Adam m and v); "
          f"activations bf16 (our per-op model)")
    if not plans:
        print("no feasible layout: more GPUs, more memory, or a shorter sequence.")
        return 1
    print(f"{'#':>3} {'tp':>3} {'sp':>4} {'pp':>3} {'dp':>3}  {'weights':>8} {'activ.':>8} "
          f"{'host':>7} {'total':>7} {'s/step':>7}  {'comm GB/step':>13}  settings")
    for i, pl in enumerate(plans[:args.top]):
        comm = ", ".join(f"{k} {v:.1f}" for k, v in pl.comm_gb.items()) or "-"
        print(f"{i + 1:>3} {pl.tp:>3} {pl.sp:>4} {pl.pp:>3} {pl.dp:>3}  {pl.weights_gb:>7.1f}G "
              f"{pl.activations_gb:>7.1f}G {pl.offloaded_gb:>6.1f}G {pl.total_gb:>6.1f}G {pl.score:>7.1f}  "
              f"{pl.comm_total_gb:>6.1f} ({comm})  {pl.flags()}")
    best = plans[0]
    ours = activation_bytes(cfg, args.seq_length, args.micro_batch_size, tp=best.tp, sp=best.sp,
                            sequence_parallel=best.sequence_parallel, dtype_bytes=2)
    ref = korthikanti_layer_bytes(cfg, args.seq_length, args.micro_batch_size, tp=best.tp, sp=best.sp,
                                  sequence_parallel=best.sequence_parallel)
    print(f"reference, best layout, one layer without recompute: ours {ours['layer'] / 2**30:.2f} GB, "
          f"Korthikanti 16-bit (attention matrix stored) {ref / 2**30:.2f} GB; fused attention drops "
          f"the 5as/H term.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
