"""Command-line arguments with Megatron-LM's flag names (docs/design.md §10), at the command-line edge.

Users bring their launch scripts: where Megatron has a flag we keep its name and meaning. A flag whose
feature has not landed is refused with a clear message, never silently ignored (see UNSUPPORTED).
"""
from __future__ import annotations

import argparse
import difflib
import sys

from megatron_sp.errors import ConfigError, UsageError


def _bool_flag(parser, name, help):
    parser.add_argument(name, action="store_true", help=help)


def build_parser() -> argparse.ArgumentParser:
    p = MegatronArgumentParser(description="Pretrain a GPT model with megatron_sp.",
                               allow_abbrev=False, formatter_class=_HelpWithDefaults,
                               usage=USAGE, add_help=False)
    p.add_argument("-h", "--help", action=_Help, help="the main flags, by group")
    p.add_argument("--help-all", action=_Help, dest="help", help="also Megatron-LM's variant, schedule and "
                   "compatibility flags (mapped, no-op, refused)")
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, help="preset: gpt2-tiny, gpt2-small, gpt2-medium, "
                   "llama-tiny, llama-1b, llama-8b, llama3.1-8b, llama3.2-1b, llama3-70b, "
                   "qwen3-0.6b, qwen3-4b, qwen3-8b, qwen2.5-7b, mistral-7b (flags below override "
                   "its fields)")
    m.add_argument("--num-layers", type=int, help="transformer layers")
    m.add_argument("--hidden-size", type=int, help="hidden size H")
    m.add_argument("--ffn-hidden-size", type=int,
                   help="MLP hidden size (default 4H, or Megatron's SwiGLU rule)")
    m.add_argument("--num-attention-heads", type=int, help="query heads")
    _bool_flag(m, "--group-query-attention", "use grouped-query attention (--num-query-groups)")
    m.add_argument("--num-query-groups", type=int, help="key/value heads (GQA)")
    m.add_argument("--kv-channels", type=int, help="head dimension (default H / heads)")
    m.add_argument("--seq-length", type=int, default=None, help="tokens per sample")
    m.add_argument("--max-position-embeddings", type=int,
                   help="positions of the learned embedding (defaults to --seq-length)")
    m.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "yarn"],
                   help="learned absolute positions, RoPE or YaRN-scaled RoPE")
    m.add_argument("--rotary-base", type=float, help="RoPE base theta")
    m.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], help="LayerNorm or RMSNorm")
    m.add_argument("--norm-epsilon", type=float, help="epsilon of the norms")
    _bool_flag(m, "--swiglu", "SwiGLU MLP")
    _bool_flag(m, "--openai-gelu", "tanh-approximated GeLU (GPT-2)")
    _bool_flag(m, "--disable-bias-linear", "no biases in linear layers")
    _bool_flag(m, "--add-qkv-bias", "bias in the QKV projection even with --disable-bias-linear")
    _bool_flag(m, "--untie-embeddings-and-output-weights", "separate output layer")
    m.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this times tp")
    m.add_argument("--vocab-size", type=int, help="vocabulary of the NullTokenizer")
    m.add_argument("--attention-dropout", type=float,
                   help="dropout on attention probabilities (Megatron's 0.1 without --model)")
    m.add_argument("--hidden-dropout", type=float,
                   help="dropout on the residual branches (Megatron's 0.1 without --model)")
    m.add_argument("--init-method-std", type=float,
                   help="standard deviation of the normal initialisation")
    # Model families (models/families.py), Megatron-LM's names.
    _bool_flag(m, "--qk-layernorm", "normalise every query and key head over head_dim (Qwen3)")
    _bool_flag(m, "--use-rope-scaling", "Llama-3.1 RoPE frequency scaling (low/high frequency "
               "factors 1/4, original context 8192)")
    m.add_argument("--rope-scaling-factor", type=float, help="Llama-3.1 RoPE scaling factor (8)")
    m.add_argument("--yarn-rotary-scaling-factor", type=float, help="YaRN factor")
    m.add_argument("--yarn-original-max-position-embeddings", type=int,
                   help="YaRN: the context before extension (default --max-position-embeddings)")
    m.add_argument("--yarn-beta-fast", type=float, help="YaRN beta_fast (32)")
    m.add_argument("--yarn-beta-slow", type=float, help="YaRN beta_slow (1)")
    m.add_argument("--yarn-mscale", type=float, help="YaRN mscale (1)")
    m.add_argument("--yarn-mscale-all-dim", type=float, help="YaRN mscale_all_dim (0)")
    # Mixture of experts (models/moe.py), Megatron-LM's names; one rank holds all the experts.
    # Model flags too (--use-checkpoint-args restores them), listed under --help-all.
    moe = p.add_argument_group(MOE_GROUP)
    moe.add_argument("--num-experts", type=int, help="experts of each mixture-of-experts layer "
                   "(default: a dense model)")
    moe.add_argument("--moe-ffn-hidden-size", type=int, help="hidden size of each expert's SwiGLU "
                   "MLP (default --ffn-hidden-size)")
    moe.add_argument("--moe-router-topk", type=int, help="experts per token (Megatron's default 2)")
    moe.add_argument("--moe-token-dispatcher-type", default=None,
                     help="alltoall or allgather: tokens permuted locally, then (ep > 1) sent to "
                          "their experts' ranks by all-to-all")
    moe.add_argument("--moe-router-dtype", default=None,
                     help="fp32 only: the router always runs in fp32")
    moe.add_argument("--moe-layer-freq", default=None, help="experts in every k-th layer (1: all), "
                   "or a 0/1 list per layer such as \"([1]*3+[0]*1)*3\" (Megatron's)")
    moe.add_argument("--moe-shared-expert-intermediate-size", type=int, help="hidden size of the "
                   "shared expert every token also goes through")
    _bool_flag(moe, "--moe-shared-expert-gate", "the shared expert's output scaled by a per-token "
               "sigmoid gate (Qwen2-MoE)")
    _bool_flag(moe, "--moe-router-pre-softmax", "softmax over all experts before the top-k")
    moe.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"],
                   help="router scores (default softmax)")
    moe.add_argument("--moe-router-topk-scaling-factor", type=float, help="routing weights of the "
                   "top-k times this")
    moe.add_argument("--moe-aux-loss-coeff", type=float, help="weight of the load-balancing loss "
                   "(default 0)")
    moe.add_argument("--moe-z-loss-coeff", type=float, help="weight of the router z-loss")
    moe.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "none"],
                   help="load-balancing loss over the micro-batch (aux_loss, default) or per "
                        "sequence (seq_aux_loss), or none")
    moe.add_argument("--moe-expert-capacity-factor", type=float, help="each expert takes at most "
                   "this x its even share of the tokens, the others are dropped (default: none "
                   "dropped)")
    _bool_flag(moe, "--moe-pad-expert-input-to-capacity", "with --moe-expert-capacity-factor: every expert's input padded to its capacity (static shapes)")

    t = p.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=int, default=1,
                   help="samples per micro-batch per data-parallel rank")
    t.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step over all data-parallel ranks (default: "
                        "--micro-batch-size x dp)")
    t.add_argument("--train-iters", type=int, default=None,
                   help="optimizer steps to train (default 100 when --train-samples is not given)")
    t.add_argument("--train-samples", type=int, default=None,
                   help="samples to train, instead of --train-iters")
    t.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    t.add_argument("--min-lr", type=float, default=0.0,
                   help="learning rate at the end of the decay")
    t.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up steps")
    t.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of --lr-decay-iters")
    t.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   help="learning-rate decay after warm-up")
    t.add_argument("--lr-decay-iters", type=int, default=None,
                   help="steps of the decay, warm-up included (default --train-iters)")
    t.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="WSD: steps of the final linear decay")
    t.add_argument("--weight-decay", type=float, default=0.01,
                   help="AdamW decoupled weight decay (not on norms and biases)")
    t.add_argument("--clip-grad", type=float, default=1.0,
                   help="clip the global gradient norm to this (0: no clipping)")
    t.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    t.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2")
    t.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    _bool_flag(t, "--bf16", "bf16 mixed precision (fp32 master weights)")
    _bool_flag(t, "--fp16", "fp16 mixed precision (fp32 master weights) with Megatron's loss "
               "scaling (--loss-scale, --initial-loss-scale, ...)")
    t.add_argument("--seed", type=int, default=1234,
                   help="seed of initialisation, data order and dropout")
    t.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="activation recompute: full layers or the attention core (selective)")
    t.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="full recompute: uniform groups or the first N layers (block)")
    t.add_argument("--recompute-num-layers", type=int, default=None,
                   help="full+uniform: layers per checkpointed group; full+block: layers of each "
                        "stage recomputed (default 1)")
    t.add_argument("--mlp-tiles", default="1",
                   help="run the MLP over N sequence tiles recomputed in backward (or 'auto': "
                        "ceil(ffn width / hidden), none under 2048 tokens), so the [s, ffn] "
                        "intermediate never exists whole")
    t.add_argument("--loss-chunks", default="1",
                   help="output layer + cross entropy over N sequence chunks recomputed in backward "
                        "(or 'auto': ceil(vocab / hidden), none under 2048 tokens), so the "
                        "[s, vocab] logits never exist whole")
    _bool_flag(t, "--offload-activations", "keep saved activations of the transformer layers (with "
               "full recompute: the checkpointed layer inputs) in pinned host memory until backward")
    t.add_argument("--offload-pool-gb", type=float, default=None,
                   help="GiB of the exact pinned host pool for --offload-activations on CUDA "
                        "(default: the planner's count for this rank with full recompute and no "
                        "pipeline; 0: torch's pinned buffers, rounded up to powers of two)")
    _bool_flag(t, "--report-memory", "print activation bytes saved for backward per rank and layer, "
               "peak device memory and the model-state bytes per rank (parameters, gradients, "
               "optimizer state on device and on host), with the log line")
    t.add_argument("--attention-backend", default="auto",
                   choices=["auto", "flash", "fused", "unfused", "local", "te", "sdpa", "flex",
                            "flash-attn"],
                   help="Megatron's auto, flash (flash-attn; SDPA when it is not installed), fused "
                        "(TE; SDPA without it), unfused (two matmuls: short sequences), local "
                        "(SDPA); ours te and flash-attn (refused when not installed), sdpa, flex "
                        "(FlexAttention: trains on CUDA)")
    _bool_flag(t, "--torch-compile", "compile every transformer layer with torch.compile, one "
               "graph per layer as torchtitan compiles its blocks (ours; Megatron-LM has none)")
    t.add_argument("--torch-compile-backend", default="inductor",
                   choices=["inductor", "aot_eager", "eager"],
                   help="torch.compile backend of --torch-compile: inductor, aot_eager (no code "
                        "generation), eager (Dynamo only)")
    t.add_argument("--grad-bucket-size-mb", type=float, default=25.0,
                   help="size of the gradient buckets reduced during backward")
    t.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU")

    d = p.add_argument_group("data")
    d.add_argument("--data-path", nargs="*", default=None,
                   help="dataset prefixes, optionally weighted: [w1] prefix1 [w2 prefix2 ...]")
    d.add_argument("--split", default="969,30,1",
                   help="train,valid,test proportions of the documents, separated by commas or "
                        "slashes (Megatron's)")
    d.add_argument("--data-cache-path", default=None,
                   help="folder of the cached sample indices (default: next to the data)")
    d.add_argument("--tokenizer-type", default=None,
                   choices=["SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                            "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer"],
                   help="the tokenizer the data was preprocessed with")
    d.add_argument("--tokenizer-model", default=None,
                   help="its model file (.model) or Hugging Face folder")
    d.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    d.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    _bool_flag(d, "--trust-remote-code", "HuggingFaceTokenizer: allow a tokenizer folder whose "
               "config has auto_map to run its own Python code (never asked; refused without it)")
    _bool_flag(d, "--reset-position-ids", "positions restart after each end-of-document token")
    _bool_flag(d, "--reset-attention-mask", "attention never crosses an end-of-document token")
    _bool_flag(d, "--eod-mask-loss", "no loss on end-of-document tokens")
    _bool_flag(d, "--mock-data", "synthetic random tokens (tests and benchmarks)")
    d.add_argument("--cache-dir", default=None, help="where the embedded default corpus is built")

    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1,
                     help="tensor-parallel ranks (tp)")
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                     help="pipeline stages (pp)")
    par.add_argument("--sequence-parallel-size", type=int, default=1,
                     help="Ulysses sequence-parallel degree")
    par.add_argument("--ulysses-head-chunks", type=int, default=1, metavar="N",
                     help="run Ulysses' all-to-alls and the attention (a ring's too) over N groups "
                          "of heads in turn, each recomputed in backward, so the exchange buffers "
                          "and q, k, v, out of one chunk are live at a time (UPipe); N must fit "
                          "the heads per sp rank (refused with the choices otherwise)")
    par.add_argument("--context-parallel-size", type=int, default=1,
                     help="Megatron's context parallelism: ranks one sequence is split over, "
                          "how chosen by --cp-comm-type")
    par.add_argument("--cp-comm-type", choices=["p2p", "a2a", "a2a+p2p", "allgather"],
                     default="p2p", help="p2p: ring attention over zigzag chunks (not capped by the "
                     "heads); a2a: Ulysses (as --sequence-parallel-size); a2a+p2p: Ulysses inside "
                     "x ring across, sizes from --hierarchical-context-parallel-sizes")
    par.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None,
                     metavar="N", help="a2a+p2p: A R, the Ulysses (adjacent ranks) and ring "
                     "degrees, A x R = --context-parallel-size")
    par.add_argument("--context-parallel-layout", choices=["balanced", "zigzag"],
                     default="balanced", help="ring ranks' tokens with packed documents: "
                     "balanced (equal causal work) or zigzag (row chunks r, 2cp-1-r)")
    _bool_flag(par, "--sequence-parallel", "Megatron sequence sharding inside tensor parallelism")
    par.add_argument("--expert-model-parallel-size", type=int, default=1,
                     help="expert-parallel ranks: each MoE layer's experts split over ep "
                          "consecutive ranks of a stage (tp ranks first), tokens by all-to-all")
    par.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                     help="tensor-parallel ranks of the experts: tp (unset: tp, as Megatron-LM; "
                          "experts split over tp, tokens all-gathered around them) or 1 (whole "
                          "experts, each tp rank routes its own tokens); tp > 1 needs "
                          "--sequence-parallel")
    par.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                     help="interleaved 1F1B: layers per virtual stage")
    par.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                     help="layers of the first pipeline stage (uneven stages)")
    par.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                     help="layers of the last pipeline stage (uneven stages)")
    par.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                     help="nccl or gloo (default: nccl on GPU, gloo on CPU)")
    par.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                     help="a collective gives up (and the run stops) after this long")

    sh = p.add_argument_group("sharded model state over dp x sp (docs/design.md §11)")
    _bool_flag(sh, "--use-distributed-optimizer", "ZeRO-1/2: shard the Adam state (and fp32 master "
               "weights of 16-bit parameters) over the dp x sp ranks; gradients reduce-scattered, "
               "updated parameters all-gathered")
    _bool_flag(sh, "--use-torch-fsdp2", "ZeRO-3 with torch's FSDP2: parameters, gradients and "
               "optimizer state sharded over the dp x sp ranks, one FSDP unit per transformer "
               "layer (all-gathered just before use, next layer prefetched), gradients "
               "reduce-scattered; with --bf16 the gathered parameters and the gradients on the "
               "wire are bf16 and the sharded master weights fp32")
    _bool_flag(sh, "--optimizer-cpu-offload", "keep the sharded state in (pinned) host memory and "
               "step the optimizer there: with --use-distributed-optimizer the master rows, their "
               "gradients and the Adam state; with --use-torch-fsdp2 the sharded parameters, "
               "gradients and optimizer state (CPUOffloadPolicy), the device holding only the "
               "layers in flight")
    _bool_flag(sh, "--overlap-grad-reduce", "overlap the gradient reduction with backward (always "
               "on: buckets are launched from the gradient hooks of the last backward pass)")
    _bool_flag(sh, "--overlap-param-gather", "distributed optimizer: launch the all-gathers of all "
               "buckets at once after the step (FSDP2 always prefetches the next layer's)")

    c = p.add_argument_group("checkpointing and exit")
    c.add_argument("--save", default=None, help="checkpoint folder to save to")
    c.add_argument("--load", default=None, help="checkpoint folder to resume or start from")
    c.add_argument("--save-interval", type=int, default=None, help="save every N iterations")
    _bool_flag(c, "--no-load-optim", "do not load optimizer state")
    _bool_flag(c, "--no-load-rng", "do not load RNG state")
    _bool_flag(c, "--finetune", "load weights only, reset iteration")
    _bool_flag(c, "--use-checkpoint-args", "take the model flags from the --load checkpoint's stored "
               "config (explicit model flags that differ are replaced, with a warning)")
    _bool_flag(c, "--exit-signal-handler", "save and exit on SIGTERM/SIGUSR1")
    c.add_argument("--exit-interval", type=int, default=None, help="save and exit at iteration N")
    c.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and exit after this much wall time")
    _bool_flag(c, "--async-save", "write checkpoints in the background (published at the next save)")
    c.add_argument("--ckpt-step", type=int, default=None,
                   help="load this iteration of --load instead of the newest (Megatron's)")
    _bool_flag(c, "--no-verify-checkpoint", "do not check checkpoint files against the "
               "checksums recorded at save before loading them")
    _bool_flag(c, "--override-opt_param-scheduler", "on resume, use the learning-rate schedule of "
               "the command line even where it differs from the checkpoint's (Megatron's)")
    _bool_flag(c, "--use-checkpoint-opt_param-scheduler", "on resume, use the checkpoint's "
               "learning-rate schedule instead of the command line's (Megatron's)")
    _bool_flag(c, "--force-unlock", "take the --save lock even when its record names another host "
               "(the operator is sure that run is gone; docs/checkpoints.md)")
    _bool_flag(c, "--overwrite-save", "start a new run into a --save that holds another run's "
               "checkpoints (without it such a run is refused; --load <save> resumes instead)")
    _bool_flag(c, "--skip-free-space-check", "start even when --save has less free space than one "
               "checkpoint")

    _add_megatron_math_args(p, m)

    lg = p.add_argument_group("logging")
    lg.add_argument("--log-interval", type=int, default=10,
                    help="print the log line every N iterations")
    lg.add_argument("--eval-interval", type=int, default=1000, help="evaluate every N iterations")
    lg.add_argument("--eval-iters", type=int, default=10, help="batches per evaluation")
    lg.add_argument("--tensorboard-dir", default=None, help="write TensorBoard scalars here")
    lg.add_argument("--metrics-jsonl", default=None,
                    help="write one JSON object per logged iteration here")
    _bool_flag(lg, "--debug", "print the Python traceback with an error message (also "
               "MEGATRON_SP_DEBUG=1); without it a user error is one line")
    lg.add_argument("--nonfinite-loss", choices=["skip", "stop"], default="stop",
                    help="a NaN/inf loss or gradient norm: stop the run with the iteration (default, "
                    "like Megatron's NaN check) or skip that optimizer step and count it in the log")
    lg.add_argument("--max-skipped-steps", type=int, default=10,
                    help="with --nonfinite-loss skip: stop the run (it diverged) after this many "
                    "optimizer steps in a row were skipped; nothing is saved from the first one")
    _add_megatron_honoured(p)
    from megatron_sp.cli import megatron_compat
    megatron_compat.add_arguments(p)
    return p


USAGE = ("%(prog)s [--model PRESET] [--data-path PREFIX ...] [flags]   (no flags: the embedded "
         "default run)")
# Groups that --help leaves to --help-all: Megatron-LM's variants and compatibility flags.
MOE_GROUP = "mixture of experts"
HELP_ALL_ONLY = (MOE_GROUP, "Megatron-LM precision, optimizer and model variants",
                 "Megatron-LM schedule, data, checkpoint and logging flags",
                 "Megatron-LM compatibility (mapped, no-op and refused flags)")


class MegatronArgumentParser(argparse.ArgumentParser):
    """argparse with a short usage line, --help by group (Megatron-LM's variant and compatibility
    flags behind --help-all) and a mistyped flag answered with the flag it was probably meant to
    be: "error: unrecognized argument --seq-len; did you mean --seq-length?" (exit status 2)."""

    def format_help(self, full: bool = False) -> str:
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        formatter.add_text(self.description)
        hidden = 0
        for group in self._action_groups:
            if not full and group.title in HELP_ALL_ONLY:
                hidden += len(group._group_actions)
                continue
            formatter.start_section(group.title)
            formatter.add_text(group.description)
            formatter.add_arguments(group._group_actions)
            formatter.end_section()
        if hidden:
            formatter.add_text(f"--help-all: {hidden} more flags (mixture of experts, "
                               f"Megatron-LM's precision, schedule and model variants, and its "
                               f"flags mapped, ignored or refused here).")
        return formatter.format_help()

    def error(self, message: str):
        """One short usage line and one `error:` line; an unknown flag names its nearest match.
        Launched on several ranks, said once (megatron_sp.reporting.report)."""
        from megatron_sp.cli.startup_checks import launcher_world_size
        if launcher_world_size() > 1:
            raise UsageError(self._explain(message), usage=self.format_usage())
        self.print_usage(sys.stderr)
        self.exit(2, f"error: {self._explain(message)}\n")

    def _explain(self, message: str) -> str:
        if not message.startswith("unrecognized arguments: "):
            return message if message.endswith(".") else message + "."
        unknown = [a for a in message[len("unrecognized arguments: "):].split() if a.startswith("-")]
        if not unknown:
            return message + "."
        flags = [f for f in self._option_string_actions if f.startswith("--")]
        said = []
        for arg in unknown:
            flag = arg.split("=")[0]
            near = difflib.get_close_matches(flag, flags, n=1, cutoff=0.6)
            said.append(f"{flag}; did you mean {near[0]}?" if near else f"{flag}")
        head = "unrecognized argument" + ("s " if len(unknown) > 1 else " ")
        return head + ", ".join(said) + ("" if said[-1].endswith("?") else
                                         " (python pretrain_gpt.py --help lists the flags).")


class _Help(argparse.Action):
    """-h/--help: the main groups; --help-all: every flag."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser._print_message(parser.format_help(full=option_string == "--help-all"), sys.stdout)
        parser.exit()


class _HelpWithDefaults(argparse.HelpFormatter):
    """--help shows each flag's default where it has one (not for switches and unset values), one
    line per flag where it fits, short metavars (N, X, S)."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=38, width=100)

    def _get_default_metavar_for_optional(self, action):
        return {int: "N", float: "X"}.get(action.type, "S")

    def _get_help_string(self, action):
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if (not unset and action.option_strings
                and "%(default)" not in text and "default" not in text):
            text += " (default: %(default)s)"
        return text


def _add_megatron_math_args(p, model_group) -> None:
    """Megatron-LM flags that change the math (docs/design.md §10), with Megatron's names and defaults.

    The two that change the model's function go to the model group, so that --use-checkpoint-args
    takes them from a checkpoint's stored config like every other model flag.
    """
    g = p.add_argument_group("Megatron-LM precision, optimizer and model variants")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="--fp16: a static loss scale (default: dynamic loss scaling)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32,
                   help="--fp16: the dynamic loss scale's start (2**32)")
    g.add_argument("--min-loss-scale", type=float, default=1.0,
                   help="--fp16: the dynamic loss scale's floor (1)")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="--fp16: steps without overflow before the scale doubles (1000)")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="--fp16: overflows in a row before the scale halves (2)")
    _bool_flag(model_group, "--apply-layernorm-1p", "norm weights stored zero-centred (gamma - 1, "
               "initialised to 0) and applied as 1 + w")
    model_group.add_argument("--rotary-percent", type=float, default=1.0,
                             help="RoPE on the first int(head_dim * percent) dimensions only (1.0)")
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="no learned position embedding (with --position-embedding-type rope, "
                        "already the case)")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="peak learning rate of the embedding and output layer weights")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="their minimum learning rate (default --min-lr)")
    _bool_flag(g, "--calculate-per-token-loss", "the loss is the sum of per-token losses over the "
               "global batch's token count (always the case here)")
    _bool_flag(g, "--grad-reduce-in-bf16", "reduce gradients over dp x sp in bf16 on the wire "
               "(accumulated in fp32)")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                   help="adam (AdamW) or sgd")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="--optimizer sgd momentum (0.9)")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="local: these layers; transformer_engine: Transformer Engine's fused "
                        "attention (runs as local, said at start-up, when it is not installed)")
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None,
                   help="FP8 through Transformer Engine's fp8_autocast (installed, with "
                        "--transformer-impl transformer_engine), else through torchao in the "
                        "projection and MLP linears")
    g.add_argument("--fp8-recipe", default=None,
                   help="tensorwise | delayed | blockwise | mxfp8 (Megatron-LM's) or rowwise | "
                        "rowwise_with_gw_hp (torchao's); default: delayed under Transformer "
                        "Engine, tensorwise through torchao")
    g.add_argument("--fp8-margin", type=int, default=0,
                   help="FP8 scaling margin (Transformer Engine)")
    g.add_argument("--fp8-interval", type=int, default=1,
                   help="deprecated by Transformer Engine 1.8 (passed to older versions)")
    g.add_argument("--fp8-amax-history-len", type=int, default=1,
                   help="FP8 amax history length (Transformer Engine)")
    g.add_argument("--fp8-amax-compute-algo", choices=["most_recent", "max"], default="most_recent",
                   help="FP8 amax from the history's most recent or max value")
    _bool_flag(g, "--fp8-param-gather", "build the Transformer Engine modules' weights in FP8 "
               "(fp8_model_init)")


def _add_megatron_honoured(p) -> None:
    """Flags of Megatron-LM's example scripts honoured with Megatron's meaning."""
    g = p.add_argument_group("Megatron-LM schedule, data, checkpoint and logging flags")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCR", "SAMPLES"), help="the global batch grows from START "
                   "by INCR over SAMPLES samples (Megatron's ramp-up)")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="decay length in samples (with --train-samples)")
    g.add_argument("--lr-warmup-samples", type=int, default=0,
                   help="warm-up length in samples (with --train-samples)")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="WSD final decay in samples (with --train-samples)")
    g.add_argument("--num-workers", type=int, default=0, help="data loader worker processes")
    g.add_argument("--dataloader-type", choices=["single", "cyclic"], default="single",
                   help="single: one pass in order; cyclic: epochs repeat, each shuffled")
    _bool_flag(g, "--no-save-optim", "checkpoints without optimizer state")
    _bool_flag(g, "--no-save-rng", "checkpoints without RNG state")
    _bool_flag(g, "--exit-on-missing-checkpoint", "stop when --load holds no checkpoint")
    g.add_argument("--ckpt-format", default=None, help="torch_dist (ours: DCP); others refused")
    _bool_flag(g, "--log-throughput", "TFLOP/s per GPU in the log line (always printed here)")
    _bool_flag(g, "--log-params-norm", "the parameters' global L2 norm in the log line")
    _bool_flag(g, "--log-num-zeros-in-grad", "the number of zero gradient entries in the log line")
    _bool_flag(g, "--log-timers-to-tensorboard", "timings to TensorBoard (they always go there)")
    _bool_flag(g, "--profile", "profile iterations --profile-step-start to --profile-step-end")
    g.add_argument("--profile-step-start", type=int, default=10, help="first profiled iteration")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="iteration after the last profiled one")
    _bool_flag(g, "--use-pytorch-profiler", "--profile writes a torch.profiler trace to "
               "--tensorboard-dir (else it marks the nsys capture range on CUDA)")
    g.add_argument("--wandb-project", default=None, help="Weights & Biases project (needs wandb)")
    g.add_argument("--wandb-exp-name", default=None, help="Weights & Biases run name")
    g.add_argument("--wandb-save-dir", default=None, help="Weights & Biases folder")


# Flags whose feature has not landed yet: refused with the reason instead of ignored.
# Each entry: (attribute, predicate on its value, message).
UNSUPPORTED = []


def validate(args) -> None:
    """The command line's own rules: Megatron-LM's flags mapped to ours (their start-up notes in
    args.megatron_notes), flags refused outright, and the rules about which flags were given. The
    sections of megatron_sp.config check everything else when the JobConfig is built."""
    from megatron_sp.cli import megatron_compat
    args.megatron_notes = megatron_compat.apply(args)   # said once at start-up by rank 0
    for attr, bad, message in UNSUPPORTED:
        if bad(getattr(args, attr)):
            raise ConfigError(message)
    if args.train_iters is not None and args.train_samples is not None:
        raise ConfigError("give --train-iters or --train-samples, not both (as Megatron-LM).")
    from megatron_sp.training.fp8 import resolve_backend   # after megatron_compat's TE mapping
    args.fp8_backend, notes = resolve_backend(
        args.fp8_format, args.fp8_recipe, args.transformer_impl, args.fp8_param_gather,
        args.fp8_amax_history_len, args.fp8_amax_compute_algo)
    args.megatron_notes += notes


def parse_args(argv=None):
    """The parsed command line (the namespace stays at the edge: megatron_sp.cli.build turns it
    into the JobConfig the library takes)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from megatron_sp.cli.flag_checks import offload_pool_notes, refuse_non_finite
    refuse_non_finite(parser, args)        # every float flag: inf / nan refused, naming it
    validate(args)
    args.megatron_notes += offload_pool_notes(args)
    return args
