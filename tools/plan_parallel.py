#!/usr/bin/env python3
"""List feasible (tp, sp, pp, dp) layouts, with the model-state sharding and memory settings that
fit, best first, each with the pretrain_gpt.py flags that run it.

    python3 tools/plan_parallel.py --model llama-8b --seq-length 4194304 --num-gpus 64
    python3 tools/plan_parallel.py --model llama-8b --num-gpus 8 --max-seq      # longest sequence
    python3 tools/plan_parallel.py --model llama-8b --seq-length 524288 --num-gpus 1 --json
    python3 tools/plan_parallel.py --model llama3-70b --num-gpus 256 --max-seq --no-ring
    python3 tools/plan_parallel.py --model qwen3-30b-a3b --seq-length 32768 --num-gpus 64 \
        --global-batch-size 64                        # mixture of experts: ep chosen per layout

Layouts include a ring of context parallelism (cp > 1, docs/design.md §14): the ring alone
(--context-parallel-size N --cp-comm-type p2p) or around Ulysses (--cp-comm-type a2a+p2p
--hierarchical-context-parallel-sizes SP CP), so that one sequence can use more ranks than the
head rules allow Ulysses sp; --no-ring plans with tp, Ulysses sp, pp and dp only. The table has a
cp column when a listed plan has a ring.

Mixture-of-experts models (a --model preset with experts: qwen3-30b-a3b, qwen1.5-moe-a2.7b,
mixtral-8x7b): the header gives the total and the active parameters (k of the E experts per
token); each layout also tries every expert-parallel size ep (a divisor of the experts that
divides the stage's dp x cp x sp x tp ranks; --expert-model-parallel-size N fixes it), keeping
its fastest, and the table has an ep column when a listed plan has ep > 1. tp > 1 comes with
--sequence-parallel (each tp rank routes its own tokens) and --expert-tensor-parallel-size 1
(whole experts on each tp rank, ep folded over tp too: the layout the planner models; the
experts split over tp are not planned yet). Per rank E/ep whole experts, their
state sharded over the edp group (dp x cp x sp x tp / ep ranks), the rest over dp x sp x cp;
comm adds the dispatcher's all-to-alls (uniform routing) and the experts' gradients over edp.

Per-rank device memory = model state on device + activations + reserve:
  model state   docs/design.md §11, per --sharding mode: none 16 bytes/param (fp32 weights, grads, Adam m, v);
                distributed-optimizer 8 + 8/n; fsdp 16/n + the FSDP2 units in flight (bf16 params and
                grads); --optimizer-cpu-offload moves the sharded optimizer state to host (n = dp x sp,
                x cp with a ring; a MoE model's experts over their edp group instead).
  activations   the peak of one step from our implementation's per-op model (megatron_sp.memory.
                planner, equal to the measured saved bytes on CPU in fp32 and under bf16 autocast):
                what the forward keeps + the larger of the output layer's and one layer's backward.
                bf16 matmul inputs; residual stream and norms fp32 under autocast, bf16 under FSDP2.
                MoE layers: the router, the routed rows and the experts' SwiGLU (in the tokens'
                dtype: fp32 under autocast), the combine and the shared expert, per our MoE layer.
                With a ring: b*s/(sp*cp) tokens per rank, + the ring's kv blocks and fp32 dk, dv in
                flight in one layer's backward (planner.ring_buffer_bytes). The attention kernel
                assumed is printed under the table (planner.attention_kernel): SDPA without a
                ring or documents, else the block kernels (FlashAttention-2 varlen in bf16 on
                CUDA), whose GQA buffers the backward counts.
  documents     --reset-attention-mask: packed documents as segments, never a mask (no s^2 term);
                their one cost is the plans' int64 token indices (planner.plan_index_bytes).
  reserve       --reserve-gb (CUDA context, NCCL and cuBLAS workspaces) + --fragmentation x the rest
                (the caching allocator's split blocks).
Host memory per node: offloaded optimizer state and activations of the node's ranks, pinned buffers
rounded up to powers of two, within 90% of --host-memory-gb.
s/step: model FLOPs at --mfu of --peak-tflops x technique cost + communication at the given
bandwidths, not overlapped (a pessimistic ranking figure, not a prediction); the ring's point-to-point
bytes at NVLink speed inside a node, the network's once the ring leaves it. With a ring and packed
documents the attention FLOPs run at the ring's slowest rank's work (planner/cp_balance.py):
--cp-work-balance X states that figure, --document-lengths-lognormal MEDIAN SIGMA has it estimated
for each cp under --context-parallel-layout (balanced, or zigzag: the whole row cut in 2cp chunks,
slow on skewed mixes); neither assumes balance. A line under the table gives the figures.
--json splits s/step into compute_s and comm_s. tok/s: global batch x seq / s/step, the whole
job's. MFU: the step's model FLOPs by Megatron-LM's num_floating_point_operations (docs/design.md
§9, forward and backward, recompute not counted; a MoE model's on its active parameters,
Megatron-LM's MoE formula) / (s/step x GPUs x --peak-tflops): the assumed --mfu less what
recompute, the pipeline bubble and communication cost. --fp8-format (torchao, as pretrain_gpt.py): the projections' and dense MLP's
FLOPs at --fp8-peak-tflops, the rest at --peak-tflops, MFU against the FP8 peak (as the training
loop's); their weights' bf16 copies leave the state and their casts' transients join the step peak
(planner/fp8.py); the plans carry --fp8-format and --fp8-recipe. --max-seq --max-step-seconds S:
the longest sequence whose fastest plan's s/step is at most S; the output says what binds it
(device memory, host memory or the step time).

Each plan's flags are the whole plan for pretrain_gpt.py (add data, schedule and checkpoint flags,
and launch it on --num-gpus processes: dp is what tp x sp x cp x pp leaves of them): the model
(--model and the fields given here; without a preset the architecture assumed: RMSNorm, SwiGLU,
RoPE, no biases, no dropout), --seq-length, --max-position-embeddings, --micro-batch-size,
--global-batch-size, --bf16, the layout, the model-state sharding and every memory technique with
its count. A search that runs longer than --progress-interval seconds says how far it is on stderr
(by default every 5 s when stderr is a terminal); stdout keeps only the table or the JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sp.memory.planner import (Hardware, SearchProgress, Workload,  # noqa: E402
                                        activation_bytes, korthikanti_layer_bytes,
                                        binding_limit, max_feasible_seq, plan)
from megatron_sp.memory.planner.cp_balance import lognormal_lengths  # noqa: E402
from megatron_sp.models import GPTConfig, preset  # noqa: E402

WIDTH = 120


def _header(cp_column: bool, ep_column: bool = False) -> tuple[str, str]:
    """The table's two header lines, aligned with format_row's columns."""
    dims = ("tp", "sp") + (("cp",) if cp_column else ()) + ("pp", "dp") + \
        (("ep",) if ep_column else ())
    lead = f"{'#':>3}" + "".join(f"{d:>4}" for d in dims) + f"  {'sharding':<15}"
    return (lead + f"{'state GB':^13}{'activ. GB':^13}{'reserve':>7}{'total':>7}{'host/node':>11}"
                   f"{'s/step':>8}{'comm GB':>9}{'tok/s':>6}{'MFU':>6}",
            " " * len(lead) + f"{'device':>7}{'host':>6}{'device':>7}{'host':>6}{'GB':>7}{'GB':>7}"
                              f"{'GB':>11}{'':>8}{'':>9}{'':>6}{'%':>6}")


HEADER, HEADER_CP = _header(False), _header(True)   # HEADER_CP: a cp column, when a plan has a ring
# The model fields this tool takes, passed on to pretrain_gpt.py under the same flag names.
MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "ffn_hidden_size", "vocab_size")
# What build_config assumes without a preset, in pretrain_gpt.py's flags (its own defaults without
# --model are Megatron-LM's: LayerNorm, GeLU, learned positions, biases, 0.1 dropout).
CUSTOM_MODEL_FLAGS = ("--normalization RMSNorm", "--swiglu", "--position-embedding-type rope",
                      "--disable-bias-linear", "--attention-dropout 0", "--hidden-dropout 0")
DEFAULT_PROGRESS_S = 5.0


def build_config(args, seq: int) -> GPTConfig:
    fields = {k: v for k, v in dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                   num_attention_heads=args.num_attention_heads,
                                   num_query_groups=args.num_query_groups,
                                   ffn_hidden_size=args.ffn_hidden_size,
                                   vocab_size=args.vocab_size).items() if v is not None}
    fields["max_position_embeddings"] = max(seq, 2048)
    if args.model:
        return preset(args.model, **fields)
    fields.setdefault("vocab_size", 32000)
    return GPTConfig(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
                     add_bias_linear=False, **fields)


def _head_chunks(value: str):
    """--ulysses-head-chunks: "auto" or a positive integer."""
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"a positive integer or auto, got {value!r}")
    return int(value)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="preset (llama-1b, llama-8b, llama3-70b, gpt2-small, ...)")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-attention-heads", type=int)
    p.add_argument("--num-query-groups", type=int)
    p.add_argument("--ffn-hidden-size", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--seq-length", type=int, help="tokens per sequence (not with --max-seq)")
    p.add_argument("--max-seq", action="store_true",
                   help="find the longest feasible sequence (a multiple of lcm(1024, GPUs)) instead")
    p.add_argument("--max-step-seconds", type=float, default=None, metavar="S",
                   help="with --max-seq: the longest sequence whose fastest plan's estimated step "
                        "(s/step) takes at most S seconds")
    p.add_argument("--no-ring", dest="ring", action="store_false",
                   help="no ring of context parallelism (cp = 1): tp, Ulysses sp, pp, dp only")
    p.add_argument("--global-batch-size", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="(default 1)")
    p.add_argument("--reset-attention-mask", action="store_true",
                   help="packed documents (pretrain_gpt.py's flag): attention as segments, whose "
                        "one memory term is the plans' index tensors")
    p.add_argument("--context-parallel-layout", choices=["balanced", "zigzag"], default="balanced",
                   help="the ring's layout of packed documents (pretrain_gpt.py's flag; default "
                        "balanced)")
    docs = p.add_mutually_exclusive_group()
    docs.add_argument("--document-lengths-lognormal", nargs=2, type=float, default=None,
                      metavar=("MEDIAN", "SIGMA"),
                      help="with --reset-attention-mask: the documents' lengths in tokens are "
                           "lognormal (median, sigma of the log); each ring's step time counts "
                           "its slowest rank's attention work, estimated for that mix and layout")
    docs.add_argument("--cp-work-balance", type=float, default=None, metavar="X",
                      help="with --reset-attention-mask: each ring's slowest rank has X (>= 1) "
                           "times the mean attention work (e.g. a run's logged cp work balance)")
    p.add_argument("--ulysses-head-chunks", default="auto", metavar="N|auto", type=_head_chunks,
                   help="Ulysses head chunks the plans may use (pretrain_gpt.py's flag): auto "
                        "(default) the smallest count that fits when nothing cheaper does; N "
                        "only that count; 1 never")
    p.add_argument("--expert-model-parallel-size", type=int, default=None, metavar="N",
                   help="a mixture-of-experts model's expert-parallel size (pretrain_gpt.py's "
                        "flag): fix it to N, a divisor of the experts (default: each layout's fastest)")
    p.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None,
                   help="plan FP8 training through torchao (pretrain_gpt.py's flag): the "
                        "projections and dense MLP in FP8, their weights' bf16 copies gone, their "
                        "casts' transients in the peak, their FLOPs at --fp8-peak-tflops")
    p.add_argument("--fp8-recipe", default="tensorwise",
                   choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"],
                   help="torchao's recipe with --fp8-format (default tensorwise)")
    p.add_argument("--num-gpus", type=int, required=True)
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="per GPU (default 80)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="(default 8)")
    p.add_argument("--host-memory-gb", type=float, default=2048.0,
                   help="host memory per node (default 2048, a DGX H100)")
    p.add_argument("--sharding", default="auto",
                   choices=["none", "distributed-optimizer", "fsdp", "auto"],
                   help="model-state sharding over dp x sp: none, --use-distributed-optimizer, "
                        "--use-torch-fsdp2, or auto (each layout's fastest that fits; default)")
    p.add_argument("--optimizer-cpu-offload", action=argparse.BooleanOptionalAction, default=None,
                   help="force (or with --no-optimizer-cpu-offload forbid) the optimizer state on "
                        "host; default: the planner may choose it")
    p.add_argument("--intra-node-gbps", type=float, default=450.0, help="GB/s per GPU (NVLink; default 450)")
    p.add_argument("--inter-node-gbps", type=float, default=50.0, help="GB/s per GPU (IB 400 Gb/s; default 50)")
    p.add_argument("--pcie-gbps", type=float, default=25.0, help="GB/s host<->GPU per GPU (default 25)")
    p.add_argument("--reserve-gb", type=float, default=4.0,
                   help="fixed device reserve: CUDA context, NCCL, cuBLAS workspaces (default 4)")
    p.add_argument("--fragmentation", type=float, default=0.10,
                   help="allocator fragmentation, a fraction of the modelled bytes (default 0.10)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100/H200; default 989)")
    p.add_argument("--fp8-peak-tflops", type=float, default=1979.0,
                   help="FP8 dense peak, with --fp8-format (H100/H200; default 1979)")
    p.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOP utilisation (default 0.4)")
    p.add_argument("--top", type=int, default=10, help="plans to print (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--progress-interval", type=float, default=None, metavar="SECONDS",
                   help="a progress line on stderr every SECONDS of the search (0: after every "
                        f"layout; negative: none; default {DEFAULT_PROGRESS_S:g} when stderr is a "
                        "terminal, else none)")
    args = p.parse_args(argv)
    if not args.model and args.num_layers is None:
        p.error("give --model or the model flags (--num-layers --hidden-size --num-attention-heads)")
    if args.max_seq == (args.seq_length is not None):
        p.error("give either --seq-length or --max-seq")
    if args.max_step_seconds is not None and not args.max_step_seconds > 0:
        p.error(f"--max-step-seconds must be a positive number of seconds, got "
                f"{args.max_step_seconds:g}")
    if args.max_step_seconds is not None and not args.max_seq:
        p.error("--max-step-seconds bounds --max-seq's search: give --max-seq")
    if args.expert_model_parallel_size is not None and args.expert_model_parallel_size < 1:
        p.error(f"--expert-model-parallel-size must be a positive integer, got "
                f"{args.expert_model_parallel_size}")
    if args.fp8_format and args.ulysses_head_chunks not in ("auto", 1):
        p.error("--fp8-format with --ulysses-head-chunks > 1: the FP8 linears refuse head "
                "chunks; leave one of the two out")
    if args.sharding == "none" and args.optimizer_cpu_offload:
        p.error("--optimizer-cpu-offload needs a sharded mode: use --sharding "
                "distributed-optimizer, fsdp or auto")
    problem = number_problem(args) or document_problem(args)
    if problem:
        p.error(problem)
    return args


def document_problem(args) -> str | None:
    """What is wrong with the packed documents' flags, as one sentence naming the flag; else
    None."""
    lognormal, balance = args.document_lengths_lognormal, args.cp_work_balance
    given = "--document-lengths-lognormal" if lognormal is not None else \
        "--cp-work-balance" if balance is not None else None
    if given and not args.reset_attention_mask:
        return f"{given} describes packed documents: give --reset-attention-mask too"
    if lognormal is not None:
        median, sigma = lognormal
        if not (math.isfinite(median) and median >= 1 and math.isfinite(sigma) and sigma >= 0):
            return (f"--document-lengths-lognormal MEDIAN SIGMA needs a median of at least 1 "
                    f"token and a finite sigma >= 0, got {median:g} {sigma:g}")
    if balance is not None and not (math.isfinite(balance) and balance >= 1):
        return (f"--cp-work-balance is the slowest ring rank's work over the mean, a finite "
                f"number >= 1, got {balance:g}")
    return None


POSITIVE_INTS = ("num_gpus", "global_batch_size", "micro_batch_size", "seq_length",
                 "gpus_per_node", "top", "num_layers", "hidden_size", "num_attention_heads",
                 "num_query_groups", "ffn_hidden_size", "vocab_size")
POSITIVE_FLOATS = ("gpu_memory_gb", "host_memory_gb", "intra_node_gbps", "inter_node_gbps",
                   "pcie_gbps", "peak_tflops", "fp8_peak_tflops")


def number_problem(args) -> str | None:
    """The first numeric flag out of its range, as one sentence naming it (argparse accepts 0,
    negative sizes, nan and inf), or a global batch no micro-batch split can hold; else None."""
    flag = lambda name: "--" + name.replace("_", "-")     # noqa: E731
    for name in POSITIVE_INTS:
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"{flag(name)} must be a positive integer, got {value}"
    for name in POSITIVE_FLOATS:
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            return f"{flag(name)} must be a positive finite number, got {value:g}"
    if not (math.isfinite(args.mfu) and 0 < args.mfu <= 1):
        return f"--mfu is a fraction of the peak in (0, 1], got {args.mfu:g}"
    if not (math.isfinite(args.reserve_gb) and args.reserve_gb >= 0):
        return f"--reserve-gb must be a finite number of GB >= 0, got {args.reserve_gb:g}"
    if not (math.isfinite(args.fragmentation) and 0 <= args.fragmentation < 1):
        return f"--fragmentation is a fraction in [0, 1), got {args.fragmentation:g}"
    if args.reserve_gb >= args.gpu_memory_gb:
        return (f"--reserve-gb {args.reserve_gb:g} leaves nothing of --gpu-memory-gb "
                f"{args.gpu_memory_gb:g}: give the GPU's memory, or a smaller reserve")
    if args.progress_interval is not None and math.isnan(args.progress_interval):
        return "--progress-interval must be a number of seconds (negative: none), got nan"
    if args.global_batch_size % args.micro_batch_size:
        return (f"--global-batch-size {args.global_batch_size} is not a multiple of "
                f"--micro-batch-size {args.micro_batch_size}: no layout can split it into "
                f"micro-batches; give a multiple of {args.micro_batch_size} x the data-parallel "
                f"size (e.g. --global-batch-size "
                f"{args.micro_batch_size * -(-args.global_batch_size // args.micro_batch_size)})")
    return None


def hardware(args) -> Hardware:
    """The machine the flags describe."""
    return Hardware(num_gpus=args.num_gpus, gpu_mem_gb=args.gpu_memory_gb,
                    gpus_per_node=args.gpus_per_node, host_memory_gb=args.host_memory_gb,
                    reserve_gb=args.reserve_gb, fragmentation=args.fragmentation,
                    intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps,
                    pcie_gbps=args.pcie_gbps, peak_tflops=args.peak_tflops,
                    fp8_peak_tflops=args.fp8_peak_tflops, mfu=args.mfu)


def workload(args, seq: int) -> Workload:
    """The job the flags describe, at sequence length seq."""
    chunks = args.ulysses_head_chunks
    lognormal = args.document_lengths_lognormal
    return Workload(seq=seq, global_batch=args.global_batch_size, micro_batch=args.micro_batch_size,
                    documents=args.reset_attention_mask,
                    head_chunks=chunks, expert_parallel_size=args.expert_model_parallel_size,
                    fp8_format=args.fp8_format, fp8_recipe=args.fp8_recipe,
                    context_parallel_layout=args.context_parallel_layout,
                    document_lengths=lognormal_lengths(*lognormal) if lognormal else None,
                    cp_work_balance=args.cp_work_balance)


def search(args) -> dict:
    """The sharding modes and layouts (with or without a ring) the planner may choose from."""
    return dict(sharding=args.sharding, cpu_offload=args.optimizer_cpu_offload, ring=args.ring)


def rate(x: float) -> str:
    """A rate in at most 5 characters: 3 significant digits, k and M for thousands and millions."""
    if x <= 0:
        return "0"
    x = float(f"{x:.3g}")
    for scale, unit in ((1e6, "M"), (1e3, "k")):
        if x >= scale:
            v = x / scale
            return (f"{v:.3g}" if v < 1000 else f"{v:.0f}") + unit
    return f"{x:.3g}" if x >= 1 else f"{x:.2g}" if x >= 0.01 else f"{x:.0e}"


def short(x: float) -> str:
    """One decimal below 10,000, none above."""
    return f"{x:.1f}" if x < 1e4 else f"{x:.0f}"


def format_row(i: int, pl, cp_column: bool = False, ep_column: bool = False) -> str:
    comm = pl.comm_total_gb
    cp = f" {pl.cp:>3}" if cp_column else ""
    ep = f" {pl.ep:>3}" if ep_column else ""
    return (f"{i:>3} {pl.tp:>3} {pl.sp:>3}{cp} {pl.pp:>3} {pl.dp:>3}{ep}  {pl.sharding_label:<15}"
            f"{pl.state_device_gb:>7.1f}{pl.state_host_gb:>6.1f}{pl.activations_gb:>7.1f}"
            f"{pl.activations_host_gb:>6.1f}{pl.reserve_gb:>7.1f}{pl.total_gb:>7.1f}"
            f"{pl.host_node_gb:>11.0f}{short(pl.step_s):>8}{short(comm):>9}"
            f"{rate(pl.tokens_per_s):>6}{100 * pl.mfu:>6.1f}")


def model_flags(args) -> list[str]:
    """The model the plans are for, in pretrain_gpt.py's flags: --model and the fields given here
    that override it; without a preset also the architecture build_config assumes."""
    parts = [f"--model {args.model}"] if args.model else []
    parts += [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in MODEL_FIELDS
              if getattr(args, name) is not None]
    return parts + ([] if args.model else list(CUSTOM_MODEL_FLAGS))


def run_flags(pl, model=()) -> list[str]:
    """Everything pretrain_gpt.py needs to run plan pl: the model flags, then the plan's own."""
    return [*model, *pl.flag_list()]


def plan_dict(pl, model=()) -> dict:
    """pl for --json: its numbers, and under "flags" the whole line (run_flags)."""
    return {**pl.to_dict(), "flags": " ".join(run_flags(pl, model))}


def format_flags(pl, model=()) -> str:
    """The plan's flags (run_flags), indented, wrapped at WIDTH between flags (never inside a
    flag's value)."""
    lines, line = [], "     "
    for flag in run_flags(pl, model):
        if len(line) + 1 + len(flag) > WIDTH:
            lines.append(line)
            line = "       "
        line += " " + flag
    return "\n".join(lines + [line])


def model_line(cfg) -> str:
    """The model in one line: its parameters (a MoE model's total and active: k of its E experts of
    moe_ffn_hidden_size per token, + the shared expert's) and shape."""
    if cfg.num_experts is None:
        return (f"model: {cfg.num_parameters() / 1e9:.2f}B parameters, L={cfg.num_layers} "
                f"H={cfg.hidden_size} heads={cfg.num_attention_heads}/{cfg.num_query_groups} "
                f"F={cfg.ffn_hidden_size} V={cfg.vocab_size}")
    shared = cfg.moe_shared_expert_intermediate_size
    return (f"model: {cfg.num_parameters() / 1e9:.2f}B parameters, "
            f"{cfg.num_active_parameters() / 1e9:.2f}B active (top-{cfg.moe_router_topk} of {cfg.num_experts} experts of "
            f"F={cfg.moe_ffn_hidden_size}{f' + shared {shared}' if shared else ''}), "
            f"L={cfg.num_layers} H={cfg.hidden_size} heads={cfg.num_attention_heads}/"
            f"{cfg.num_query_groups} V={cfg.vocab_size}")


def describe(cfg, args, seq) -> list[str]:
    return [model_line(cfg),
            f"run: seq {seq}, global batch {args.global_batch_size}, {args.num_gpus} GPUs x "
            f"{args.gpu_memory_gb:g} GB ({args.gpus_per_node} per node, host {args.host_memory_gb:g} GB "
            f"per node), sharding {args.sharding}"
            + (", packed documents" if args.reset_attention_mask else ""),
            f"reserve: {args.reserve_gb:g} GB + {args.fragmentation:.0%} fragmentation; activations bf16 "
            f"(residual fp32 under autocast, bf16 under fsdp2; fused RMSNorm)"]


KERNEL_LABEL = "attention kernel: "


def kernel_lines(plans) -> list[str]:
    """The attention kernel the listed plans assume (Plan.attention_kernel): one line, or one per
    kind in the plans' order where they differ (plans with a ring and without), within WIDTH."""
    kinds = dict.fromkeys(pl.attention_kernel for pl in plans if pl.attention_kernel)
    lines = []
    for i, kind in enumerate(kinds):
        lines += textwrap.wrap(kind, WIDTH, break_on_hyphens=False,
                               initial_indent=KERNEL_LABEL if i == 0 else " " * len(KERNEL_LABEL),
                               subsequent_indent=" " * (len(KERNEL_LABEL) + 2))
    return lines


def cost_lines(args) -> list[str]:
    """What the cost columns mean, for the table's foot, within WIDTH."""
    return textwrap.wrap(
        f"cost: s/step = model FLOPs at {args.mfu:.0%} of {args.peak_tflops:g} TFLOP/s"
        + (f" (the FP8 linears' at {args.fp8_peak_tflops:g}; MFU against it)"
           if getattr(args, "fp8_format", None) else "") + ", x recompute "
        f"and pipeline bubble, + communication, not overlapped (--json: compute_s + comm_s); "
        f"tok/s = global batch x seq / s/step, the whole job's; MFU = model FLOPs (Megatron-LM's "
        f"formula) / (s/step x GPUs x peak).", WIDTH)


def print_table(plans, top: int, model=()) -> None:
    """The first `top` plans, each row followed by its flags: a cp column when one of them has a
    ring, an ep column when one has expert parallelism."""
    cp_column = any(pl.cp > 1 for pl in plans[:top])
    ep_column = any(pl.ep > 1 for pl in plans[:top])
    print(*_header(cp_column, ep_column), sep="\n")
    for i, pl in enumerate(plans[:top]):
        print(format_row(i + 1, pl, cp_column, ep_column))
        print(format_flags(pl, model))
    print(*kernel_lines(plans[:top]), sep="\n")
    print(*balance_lines(plans[:top]), sep="\n")


def balance_lines(plans) -> list[str]:
    """The slowest ring rank's attention work over the mean that the listed plans with a ring and
    packed documents assume (Plan.cp_work_balance), per cp: one line, or none."""
    rings = {pl.cp: pl for pl in plans if pl.cp > 1 and pl.documents}
    if not rings:
        return []
    layout = next(iter(rings.values())).context_parallel_layout
    return [f"ring ({layout} layout): attention at the slowest rank's work, cp work balance "
            + ", ".join(f"{rings[cp].cp_work_balance:.3f} at cp {cp}" for cp in sorted(rings))]


class ProgressLine(SearchProgress):
    """A line on `stream` (stderr) at most every `interval` seconds of a search, none before the
    first interval has passed: layouts and (under --max-seq) sequence lengths tried, the best so
    far (the fastest plan's s/step, or the longest length that fits), seconds elapsed."""

    def __init__(self, interval: float, max_seq: bool = False, stream=None, clock=time.monotonic):
        self.interval, self.max_seq, self.clock = interval, max_seq, clock
        self.stream = stream or sys.stderr
        self.start = self.last = clock()
        self.layouts = self.fits = self.lengths = self.longest = 0
        self.best_s = None

    def layout(self, fit) -> None:
        self.layouts += 1
        if fit is not None:
            self.fits += 1
            self.best_s = fit.score if self.best_s is None else min(self.best_s, fit.score)
        self._tick()

    def length(self, seq: int, fits: bool) -> None:
        self.lengths += 1
        self.longest = max(self.longest, seq) if fits else self.longest
        self._tick()

    def _tick(self) -> None:
        now = self.clock()
        if now - self.last >= self.interval:
            self.last = now
            print(self.line(now - self.start), file=self.stream, flush=True)

    def line(self, elapsed: float) -> str:
        """The progress line after `elapsed` seconds."""
        if self.max_seq:
            best = (f"longest that fits so far {self.longest} tokens" if self.longest
                    else "none fits yet")
            done = f"{self.lengths} sequence lengths ({best}), {self.layouts} layouts tried"
        else:
            best = f", best {self.best_s:.2f} s/step" if self.best_s is not None else ""
            done = f"{self.layouts} layouts tried, {self.fits} fit{best}"
        return f"plan_parallel: {done}, {elapsed:.0f} s"


def progress_line(args) -> SearchProgress:
    """The search's progress reporter: a ProgressLine every --progress-interval seconds (by
    default DEFAULT_PROGRESS_S when stderr is a terminal), else one that says nothing."""
    interval = args.progress_interval
    if interval is None and sys.stderr.isatty():
        interval = DEFAULT_PROGRESS_S
    if interval is None or interval < 0:
        return SearchProgress()
    return ProgressLine(interval, max_seq=args.max_seq)


def main(argv=None):
    args = parse_args(argv)
    progress = progress_line(args)
    model = model_flags(args)
    try:
        if args.max_seq:
            return max_seq_main(args, progress, model)
        seq = args.seq_length
        cfg = build_config(args, seq)
        plans = plan(cfg, workload(args, seq), hardware(args), **search(args), progress=progress)
    except ValueError as err:
        raise SystemExit(f"error: {err}")
    if args.json:
        print(json.dumps({"model": args.model, "parameters": cfg.num_parameters(),
                          "active_parameters": (cfg.num_parameters() if cfg.num_experts is None
                                                else cfg.num_active_parameters()),
                          "seq_length": seq,
                          "num_gpus": args.num_gpus,
                          "plans": [plan_dict(p, model) for p in plans[:args.top]],
                          **({} if plans else {"no_layout": no_layout_sentence(cfg, args, seq)})},
                         indent=1))
        return 0 if plans else 1
    print(*describe(cfg, args, seq), sep="\n")
    if not plans:
        print(no_layout_sentence(cfg, args, seq))
        return 1
    print_table(plans, args.top, model)
    print(*cost_lines(args), sep="\n")
    print(reference_line(cfg, args, seq, plans[0]))
    return 0


def no_layout_sentence(cfg, args, seq: int) -> str:
    """Why no layout fits: the global batch when layouts fit once every data-parallel size can
    split it (global batch = micro-batch x GPUs), else memory (the usual advice)."""
    micro, gpus = args.micro_batch_size, args.num_gpus
    roomy = dataclasses.replace(workload(args, seq), global_batch=micro * gpus)
    fits = plan(cfg, roomy, hardware(args), **search(args))
    if not fits:
        return "no feasible layout: more GPUs, more memory, a sharding mode, or a shorter sequence."
    dp = sorted({p.dp for p in fits})
    batch = math.lcm(args.global_batch_size, micro * fits[0].dp)
    return (f"no feasible layout for --global-batch-size {args.global_batch_size}: the layouts "
            f"that fit {gpus} GPUs have a data-parallel size ({', '.join(f'dp {d}' for d in dp)}) "
            f"that does not divide its {args.global_batch_size // micro} micro-batch(es) of "
            f"{micro}; give --global-batch-size {batch} (a multiple of --micro-batch-size x dp).")


def reference_line(cfg, args, seq: int, best) -> str:
    """One layer of the best layout without recompute, all bf16: ours against Korthikanti et al.'s
    (a dense layer's formula: for a MoE model ours alone, its largest layer)."""
    ours = activation_bytes(cfg, seq, args.micro_batch_size, tp=best.tp, sp=best.sp,
                            sequence_parallel=best.sequence_parallel, dtype_bytes=2, cp=best.cp,
                            ep=best.ep)
    head = (f"reference, best layout, one layer without recompute (all bf16): ours "
            f"{ours['layer'] / 2**30:.2f} GB")
    if cfg.num_experts is not None:
        return textwrap.fill(head + " (a MoE layer; Korthikanti et al.'s formula is for dense "
                                    "layers).", WIDTH)
    ref = korthikanti_layer_bytes(cfg, seq, args.micro_batch_size, tp=best.tp,
                                  sp=best.sp * best.cp, sequence_parallel=best.sequence_parallel)
    return textwrap.fill(head + f", Korthikanti et al. {ref / 2**30:.2f} GB (stores the attention "
                                f"matrix, which fused attention drops).", WIDTH)


HOST_LIMIT = "host memory (the offloaded state and activations of a node's ranks)"


def limit(args, seq: int, progress: SearchProgress | None = None) -> tuple[str, str]:
    """What stops the next longer sequence (planner.binding_limit: device memory, host memory
    (it would fit with ample host memory), under --max-step-seconds the step time (it fits, but
    its fastest plan's step takes longer), or the search limit), and a sentence with the figures
    that show it."""
    why, nxt = binding_limit(lambda s: build_config(args, s), hardware(args),
                             workload(args, seq=0), seq, **search(args), progress=progress,
                             max_step_s=args.max_step_seconds)
    if why == "step time":
        return why, (f"step time: {nxt.seq_length} tokens fit, but their fastest plan takes "
                     f"{nxt.step_s:.6g} s/step > {args.max_step_seconds:g}")
    return why, HOST_LIMIT if why == "host memory" else why


def max_seq_main(args, progress: SearchProgress | None = None, model=()) -> int:
    """--max-seq: the longest sequence that fits (under --max-step-seconds, whose fastest plan's
    step also fits that bound), what limits it, and its best plan."""
    bound = args.max_step_seconds
    seq, best = max_feasible_seq(lambda s: build_config(args, s), hardware(args),
                                 workload(args, seq=0), **search(args), progress=progress,
                                 max_step_s=bound)
    if args.json:
        print(json.dumps({"model": args.model, "num_gpus": args.num_gpus, "max_seq": seq,
                          "max_step_seconds": bound,
                          **dict(zip(("limited_by", "limit"),
                                     limit(args, seq, progress) if best else (None, None))),
                          "plan": plan_dict(best, model) if best else None}, indent=1))
        return 0 if best else 1
    cfg = build_config(args, max(seq, 1024))
    print(*describe(cfg, args, "longest feasible")[0:1], sep="\n")
    within = f" within {bound:g} s/step" if bound is not None else ""
    if best is None:
        print(f"no sequence fits {args.num_gpus} GPUs x {args.gpu_memory_gb:g} GB{within}.")
        return 1
    print(f"longest feasible sequence on {args.num_gpus} GPUs x {args.gpu_memory_gb:g} GB{within}: "
          f"{seq} tokens ({seq / 2**20:.2f}M)")
    print(f"limited by {limit(args, seq, progress)[1]}")
    print_table([best], 1, model)
    print(*cost_lines(args), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
