"""Megatron-LM launch scripts run unchanged (docs/design.md §10): every flag of its GPT and Llama examples.

Each flag of examples/gpt3/train_gpt3_175b_distributed.sh, examples/llama/train_llama3_8b_h100_fp8.sh,
examples/llama/train_llama3_8b_h200_bf16.sh and examples/llama/train_llama3.sh is one of

- honoured: our parser has it, with Megatron's meaning;
- mapped:   it runs as our equivalent, said once at start-up;
- no-op:    it only switches a Megatron implementation detail with no meaning here; accepted with
            Megatron's arity and listed once at start-up in one line;
- refused:  one sentence why and what to use instead.

The tables below are data; the functions after them (parser flags, start-up notes, the README table)
only read them. `python -m megatron_sp.cli.megatron_compat --markdown` prints the README table.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from megatron_sp.errors import ConfigError

# --- data ----------------------------------------------------------------------------------------

# Flags of the four scripts that our parser has with Megatron's meaning.
HONOURED = (
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
    "--group-query-attention", "--num-query-groups", "--kv-channels", "--seq-length",
    "--max-position-embeddings", "--position-embedding-type", "--rotary-base", "--normalization",
    "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--attention-dropout", "--hidden-dropout", "--init-method-std", "--attention-backend",
    "--micro-batch-size", "--global-batch-size", "--rampup-batch-size", "--train-iters",
    "--train-samples", "--lr", "--min-lr", "--lr-decay-style", "--lr-decay-iters",
    "--lr-warmup-fraction", "--lr-decay-samples", "--lr-warmup-samples", "--weight-decay",
    "--clip-grad", "--adam-beta1", "--adam-beta2", "--bf16", "--recompute-granularity",
    "--recompute-method", "--recompute-num-layers", "--exit-duration-in-mins",
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--sequence-parallel",
    "--context-parallel-size", "--cp-comm-type", "--hierarchical-context-parallel-sizes",
    "--distributed-backend", "--distributed-timeout-minutes",
    "--data-path", "--split", "--data-cache-path", "--mock-data", "--tokenizer-type",
    "--tokenizer-model", "--vocab-size", "--vocab-file", "--merge-file", "--num-workers",
    "--dataloader-type",
    "--save", "--load", "--save-interval", "--no-save-optim", "--no-save-rng", "--no-load-optim",
    "--no-load-rng", "--use-checkpoint-args", "--exit-on-missing-checkpoint", "--ckpt-format",
    "--log-interval", "--eval-interval", "--eval-iters", "--tensorboard-dir", "--log-throughput",
    "--log-params-norm", "--log-num-zeros-in-grad", "--log-timers-to-tensorboard", "--profile",
    "--profile-step-start", "--profile-step-end", "--use-pytorch-profiler", "--wandb-project",
    "--wandb-exp-name", "--wandb-save-dir",
    "--fp16", "--rotary-percent", "--apply-layernorm-1p", "--no-position-embedding",
    "--decoupled-lr", "--decoupled-min-lr", "--calculate-per-token-loss", "--grad-reduce-in-bf16",
    "--optimizer", "--transformer-impl", "--fp8-format", "--fp8-recipe", "--fp8-amax-history-len",
    "--fp8-amax-compute-algo", "--fp8-margin", "--fp8-interval", "--fp8-param-gather",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--use-torch-fsdp2",
    "--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk", "--moe-layer-freq",
    "--moe-shared-expert-intermediate-size", "--moe-shared-expert-gate", "--moe-router-pre-softmax",
    "--moe-router-score-function", "--moe-router-topk-scaling-factor", "--moe-aux-loss-coeff",
    "--moe-z-loss-coeff", "--moe-router-load-balancing-type", "--moe-expert-capacity-factor",
    "--moe-pad-expert-input-to-capacity", "--moe-router-dtype", "--moe-token-dispatcher-type",
    "--expert-model-parallel-size",
    "--expert-tensor-parallel-size",
)

# What an honoured flag does here, where that needs saying (the README table shows it).
HONOURED_NOTES = {
    "--context-parallel-size": "ranks one sequence is split over; how: --cp-comm-type",
    "--cp-comm-type": "p2p (default): ring attention over zigzag chunks; a2a: Ulysses; a2a+p2p: "
                      "Ulysses inside x ring across (--hierarchical-context-parallel-sizes); "
                      "allgather refused",
    "--hierarchical-context-parallel-sizes": "a2a+p2p: A Ulysses ranks x R ring ranks, A x R = "
                                             "--context-parallel-size",
    "--attention-backend": "auto, unfused; flash (sdpa without flash-attn), fused -> te (sdpa "
                           "without Transformer Engine), local -> sdpa; our te, flash-attn "
                           "(refused when not installed), sdpa, flex accepted",
    "--ckpt-format": "torch_dist (ours: torch.distributed.checkpoint); other formats refused",
    "--rampup-batch-size": "Megatron's ramp; consumed samples, data order and resume follow it",
    "--lr-decay-samples": "with --train-samples; the schedule counts samples",
    "--lr-warmup-samples": "with --train-samples; the schedule counts samples",
    "--num-workers": "torch DataLoader worker processes",
    "--dataloader-type": "single; cyclic: epochs repeat, each a seeded permutation",
    "--log-throughput": "throughput per GPU is always in the log line",
    "--log-timers-to-tensorboard": "timings always go to TensorBoard",
    "--profile": "nsys capture range on CUDA; torch.profiler with --use-pytorch-profiler",
    "--use-pytorch-profiler": "trace in --tensorboard-dir",
    "--wandb-project": "through wandb when installed, one sentence when not",
    "--eval-iters": "-1 (train_llama3.sh): no evaluation",
    "--fp16": "fp16 autocast over fp32 weights with Megatron's dynamic loss scaling (--loss-scale, "
              "--initial-loss-scale, --min-loss-scale, --loss-scale-window, --hysteresis)",
    "--rotary-percent": "RoPE on the first int(head_dim x percent) channels of each head",
    "--apply-layernorm-1p": "norm weights stored as w - 1 (zero-centred), applied as 1 + w",
    "--no-position-embedding": "no learned position embedding (RoPE has none already)",
    "--decoupled-lr": "peak learning rate of the embedding and output layer",
    "--decoupled-min-lr": "their minimum learning rate",
    "--calculate-per-token-loss": "our normalisation already: summed token losses / tokens of the "
                                  "global batch",
    "--grad-reduce-in-bf16": "gradients reduced over dp x sp in bf16, accumulated in fp32",
    "--optimizer": "adam (AdamW) or sgd (momentum --sgd-momentum)",
    "--transformer-impl": "local; transformer_engine: Transformer Engine's fused attention, "
                          "mapped to local (said at start-up) when Transformer Engine is not "
                          "installed",
    "--fp8-format": "Transformer Engine's fp8_autocast (installed, --transformer-impl "
                    "transformer_engine), else torchao in the qkv, out-proj, fc1, fc2 linears; "
                    "refused in one sentence naming both when neither is installed",
    "--fp8-recipe": "delayed (Transformer Engine); tensorwise (torchao's default), rowwise, "
                    "rowwise_with_gw_hp (torchao); the others refused in one sentence",
    "--fp8-amax-history-len": "Transformer Engine's DelayedScaling recipe (torchao's current "
                              "scaling: no effect, said at start-up)",
    "--fp8-amax-compute-algo": "Transformer Engine's DelayedScaling recipe (torchao's current "
                               "scaling: no effect, said at start-up)",
    "--fp8-margin": "scales divided by 2^margin (DelayedScaling; torchao's recipes too)",
    "--fp8-interval": "Transformer Engine's DelayedScaling recipe (before TE 1.8, as Megatron)",
    "--fp8-param-gather": "the model is built inside Transformer Engine's fp8_model_init "
                          "(torchao: weights gathered in high precision, said at start-up)",
    "--use-distributed-optimizer": "Adam state and fp32 master weights sharded over dp x sp "
                                   "(ZeRO-1/2)",
    "--overlap-grad-reduce": "gradient buckets reduced from the backward pass's hooks (always)",
    "--overlap-param-gather": "distributed optimizer: every bucket's all-gather launched after the "
                              "step (FSDP2 prefetches the next layer's)",
    "--use-torch-fsdp2": "parameters, gradients and optimizer state sharded over dp x sp by FSDP2",
    "--num-experts": "SwiGLU experts (models/moe.py); one rank holds all of them, or E/ep with "
                     "--expert-model-parallel-size; tp > 1 needs --sequence-parallel",
    "--moe-layer-freq": "an integer k, or Megatron's 0/1 list expression (read with ast, not "
                        "evaluated)",
    "--moe-aux-loss-coeff": "averaged over micro-batches and dp replicas as Megatron; the "
                            "load balancing loss in the log line",
    "--moe-z-loss-coeff": "the z loss in the log line",
    "--moe-shared-expert-gate": "Megatron-core's moe_shared_expert_gate: the shared expert's "
                                "output times a per-token sigmoid gate (Qwen2-MoE)",
    "--moe-expert-capacity-factor": "tokens over capacity dropped (capacity of each rank's "
                                    "tokens, before dispatch); not with --moe-token-"
                                    "dispatcher-type allgather (as Megatron)",
    "--moe-pad-expert-input-to-capacity": "every expert's input padded to its capacity with "
                                          "zero rows (needs --moe-expert-capacity-factor)",
    "--moe-router-dtype": "fp32 (the router always runs in fp32); others refused",
    "--moe-token-dispatcher-type": "alltoall, allgather: tokens are permuted locally, then (with "
                                   "--expert-model-parallel-size > 1) all-to-all to their "
                                   "experts' ranks",
    "--expert-model-parallel-size": "experts split over ep ranks of a stage's dp x cp x sp x tp "
                                    "(tp ranks first), alltoall dispatch; checkpoints resume "
                                    "across ep sizes; the distributed optimizer and FSDP2 "
                                    "shard the experts' state over edp",
    "--expert-tensor-parallel-size": "tp (unset: tp, as Megatron): experts split over tp, "
                                     "tokens all-gathered around them, ep over dp x cp x sp; or "
                                     "1: whole experts, each tp rank routes its own tokens, ep "
                                     "folded over tp (tp > 1 needs --sequence-parallel); other "
                                     "sizes refused",
}

# Mapped: flag -> (number of values, our equivalent in words). `apply` sets our arguments.
MAPPED = {
    "--use-flash-attn": (0, "selects flash-attn (sdpa, said at start-up, when flash-attn is not "
                            "installed)"),
}

# No-op: flag -> (number of values, why it has no meaning here).
NOOP = {
    "--use-mcore-models": (0, "there is one model implementation"),
    "--no-masked-softmax-fusion": (0, "no fused masked-softmax kernel; attention goes through the backend"),
    "--no-gradient-accumulation-fusion": (0, "gradients accumulate in fp32 .grad as usual"),
    "--no-async-tensor-model-parallel-allreduce": (0, "tensor-parallel all-reduces are synchronous"),
    "--no-rope-fusion": (0, "RoPE is applied in PyTorch, unfused"),
    "--cross-entropy-loss-fusion": (0, "the vocab-parallel cross entropy is one PyTorch function"),
    "--manual-gc": (0, "Python's garbage collector runs as usual"),
    "--empty-unused-memory-level": (1, "the caching allocator is left alone"),
    "--rerun-mode": (1, "no rerun state machine; non-finite losses follow --nonfinite-loss"),
    "--no-create-attention-mask-in-dataloader": (0, "no mask is ever materialised: causal attention "
                                                    "in the kernel"),
    "--no-mmap-bin-files": (0, ".bin files are always memory-mapped"),
    "--tiktoken-pattern": (1, "no tiktoken tokenizer; HuggingFace / SentencePiece / GPT-2 BPE are"),
    "--use-contiguous-parameters-in-local-ddp": (0, "gradient buckets are flat buffers already"),
    "--attention-softmax-in-fp32": (0, "softmax already accumulates in fp32 in every backend"),
    "--keep_fp8_weight_transpose_cache": (0, "a Transformer Engine FSDP cache detail"),
    "--moe-grouped-gemm": (0, "the experts run as one grouped GEMM (torch._grouped_mm) wherever "
                              "it runs, as a loop over the experts elsewhere"),
}

# Refused: flag -> (number of values, one sentence: why and what to use).
REFUSED: dict = {}

# Megatron's --attention-backend values onto ours (te, sdpa stay accepted as aliases). The rule
# for a missing package: Megatron's names (fused, flash, and --use-flash-attn) fall back to SDPA
# with one start-up note, as Megatron's scripts expect to run anywhere; our names (te,
# flash-attn) ask for the package itself and are refused in one sentence when it is missing.
ATTENTION_BACKENDS = {"auto": "auto", "flash": "flash", "fused": "te", "unfused": "unfused",
                      "local": "sdpa", "te": "te", "sdpa": "sdpa", "flex": "flex",
                      "flash-attn": "flash"}
ATTENTION_NOTES = {"fused": "Transformer Engine's fused attention (te)",
                   "fused-no-te": "PyTorch's fused scaled_dot_product_attention kernels (sdpa): "
                                  "Transformer Engine is not installed",
                   "flash-no-flash-attn": "PyTorch's scaled_dot_product_attention (sdpa, whose "
                                          "CUDA path has a flash kernel): flash-attn is not "
                                          "installed",
                   "local": "PyTorch scaled_dot_product_attention (sdpa)"}

# --transformer-impl transformer_engine without Transformer Engine (Megatron's default value).
TRANSFORMER_IMPL_NOTE = "runs with the local implementation: Transformer Engine is not installed"

# --moe-token-dispatcher-type alltoall / allgather: what happens instead of the dispatch.
DISPATCHER_NOTE = ("the tokens are permuted locally, then (with --expert-model-parallel-size > 1) "
                   "sent to their experts' ranks by all-to-all")

# --ckpt-format: ours is torch.distributed.checkpoint, the family of Megatron's torch_dist.
CKPT_FORMATS = ("torch_dist",)


# --- parser ---------------------------------------------------------------------------------------

def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The mapped, no-op and refused flags, with Megatron's arity (flags already there are kept)."""
    known = set(parser._option_string_actions)
    group = parser.add_argument_group("Megatron-LM compatibility (mapped, no-op and refused flags)")
    for table, kind in ((MAPPED, "mapped"), (NOOP, "no-op"), (REFUSED, "refused")):
        for flag, (arity, note) in table.items():
            if flag in known:
                continue
            if arity == 0:
                group.add_argument(flag, action="store_true", help=f"{kind}: {note}")
            else:
                group.add_argument(flag, default=None, help=f"{kind}: {note}")


def _has_te() -> bool:
    from megatron_sp.training.fp8 import transformer_engine_installed
    return transformer_engine_installed()


def _has_flash_attn() -> bool:
    try:
        importlib.import_module("flash_attn")
    except (ImportError, OSError):      # absent, or a build whose CUDA libraries do not load
        return False
    return True


def _given(args, flag: str) -> bool:
    value = getattr(args, _dest(flag), None)
    return value is not None and value is not False


def apply(args) -> list[str]:
    """Refuse, map and collect the Megatron-only flags of `args`; returns the start-up notes.

    Raises ConfigError (one sentence) for a refused flag or a --ckpt-format we do not write.
    """
    for flag, (_, sentence) in REFUSED.items():
        if _given(args, flag):
            raise ConfigError(f"{flag}: {sentence}")
    if getattr(args, "ckpt_format", None) not in (None,) + CKPT_FORMATS:
        raise ConfigError(f"--ckpt-format {args.ckpt_format} is not written here: checkpoints "
                          f"are torch.distributed.checkpoint folders, the family of Megatron's "
                          f"torch_dist; pass --ckpt-format torch_dist or leave the flag out.")
    notes = []
    if getattr(args, "transformer_impl", "local") == "transformer_engine" and not _has_te():
        args.transformer_impl = "local"     # --fp8-format without TE is still refused (validate)
        notes.append(f"> --transformer-impl transformer_engine {TRANSFORMER_IMPL_NOTE}")
    flag = f"--attention-backend {args.attention_backend}"
    if getattr(args, "use_flash_attn", False):
        args.attention_backend, flag = "flash", "--use-flash-attn"
    backend = args.attention_backend
    mapped = ATTENTION_BACKENDS[backend]
    if backend == "fused" and not _has_te():
        backend, mapped = "fused-no-te", "sdpa"
    if backend == "flash" and not _has_flash_attn():
        backend, mapped = "flash-no-flash-attn", "sdpa"
    if backend in ATTENTION_NOTES:
        notes.append(f"> {flag} runs as {ATTENTION_NOTES[backend]}")
    elif flag == "--use-flash-attn":
        notes.append("> --use-flash-attn selects flash-attn (--attention-backend flash)")
    args.attention_backend = mapped
    dispatcher = getattr(args, "moe_token_dispatcher_type", None)
    if dispatcher in ("alltoall", "allgather"):     # other values: ModelFlags' sentence
        notes.append(f"> --moe-token-dispatcher-type {dispatcher}: {DISPATCHER_NOTE}")
    noops = [flag for flag in NOOP if _given(args, flag)]
    if noops:
        notes.append("> accepted as no-ops (Megatron implementation details): " + ", ".join(noops))
    return notes


# --- the README table -----------------------------------------------------------------------------

def categories() -> list[tuple[str, str, str]]:
    """(flag, category, note) for every flag of the four example scripts and the refused ones."""
    rows = [(flag, "honoured", HONOURED_NOTES.get(flag, "")) for flag in HONOURED]
    rows += [(flag, "mapped", note) for flag, (_, note) in MAPPED.items()]
    rows += [(flag, "no-op", note) for flag, (_, note) in NOOP.items()]
    rows += [(flag, "refused", note) for flag, (_, note) in REFUSED.items()]
    return rows


def markdown_table() -> str:
    order = {"honoured": 0, "mapped": 1, "no-op": 2, "refused": 3}
    lines = ["| Megatron-LM flag | here | note |", "|---|---|---|"]
    for flag, kind, note in sorted(categories(), key=lambda r: (order[r[1]], r[0])):
        lines.append(f"| `{flag}` | {kind} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the README's flag table")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown_table())
    else:
        for flag, kind, note in categories():
            print(f"{flag:45s} {kind:9s} {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
