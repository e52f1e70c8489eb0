"""Megatron-LM's GPT and Llama example scripts run with our pretrain_gpt.py (docs/design.md §10).

The flags of examples/gpt3/train_gpt3_175b_distributed.sh, examples/llama/train_llama3_8b_h100_fp8.sh,
examples/llama/train_llama3_8b_h200_bf16.sh and examples/llama/train_llama3.sh (as those scripts
compose them; model sizes, parallel sizes, iteration and sample counts shrunk; data -> --mock-data;
paths -> tmp) run for 2 iterations on CPU at 1-2 ranks.

Each script runs with every flag as Megatron has it. The FP8 script without Transformer Engine runs
clean through torchao (its start-up line once), or, without torchao either, ends in the
one-sentence refusal naming both (exit != 0, no traceback); the others must run clean: exit 0, no traceback, no "unrecognized arguments", 2 log lines that train_llama3.sh's
regular expressions read (throughput > 0), every start-up line once (none repeating another's
text), the no-op line once, the --context-parallel-size note
(Megatron's default --cp-comm-type p2p: ring attention) once, the "nothing is profiled" note where --profile has Megatron's default steps, checkpoint
metadata without optimizer / RNG state for --no-save-optim / --no-save-rng, and the wandb sentence
once where wandb is not installed.

One-rank equality (losses 1e-5 relative, consumed samples and batch sizes exact):
--rampup-batch-size under --context-parallel-size 2 (ring attention) at 2 ranks against one rank,
and a run resumed from a checkpoint taken mid-ramp against the uninterrupted run (which also writes
the --use-pytorch-profiler trace of iterations 2-3 to --tensorboard-dir).
"""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from megatron_sp.cli import megatron_compat as mc
from megatron_sp.cli.arguments import build_parser
from megatron_sp.testing import free_port, run_script

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "unit"))
from test_megatron_compat import scrape_log  # noqa: E402  (train_llama3.sh's regular expressions)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARSER_FLAGS = set(build_parser()._option_string_actions)
HAS_TE = importlib.util.find_spec("transformer_engine") is not None
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def gpt3_175b(tmp):
    """train_gpt3_175b_distributed.sh; 96 layers x 12288 -> 2 x 64, tp 8 x pp 16 -> pp 2."""
    return 2, [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--rampup-batch-size", "2", "2", "2",
        "--train-iters", "2", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
        "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
        "--lr-decay-iters", "2",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        "--mock-data", "--vocab-file", f"{tmp}/gpt2-vocab.json", "--merge-file",
        f"{tmp}/gpt2-merges.txt", "--split", "949,50,1",
        "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "2",
        "--save", f"{tmp}/ckpt", "--load", f"{tmp}/ckpt", "--eval-iters", "1",
        "--tensorboard-dir", f"{tmp}/tb"]


def _llama3_8b_model(attention_backend):
    return ["--use-mcore-models", "--num-layers", "2", "--hidden-size", "64",
            "--ffn-hidden-size", "160", "--num-attention-heads", "4", "--group-query-attention",
            "--num-query-groups", "2", "--kv-channels", "16", "--seq-length", "32",
            "--max-position-embeddings", "32", "--position-embedding-type", "rope",
            "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
            "--hidden-dropout", "0.0", "--swiglu", "--init-method-std", "0.0134",
            "--attention-backend", attention_backend, "--apply-layernorm-1p",
            "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def _llama3_8b_training():
    return ["--micro-batch-size", "1", "--global-batch-size", "2", "--train-samples", "4",
            "--lr-decay-samples", "4", "--lr-warmup-samples", "2", "--lr", "0.00015",
            "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
            "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
            "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
            "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
            "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def _llama3_8b_mock_data(tmp):
    # The scripts expand "--split '99,1,0'" unquoted: the quotes reach the parser.
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
            "--data-cache-path", f"{tmp}/cache", "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
            "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1"]


def llama3_8b_h100_fp8(tmp):
    """train_llama3_8b_h100_fp8.sh (DTYPE=fp8, mock data); 32 layers x 4096 -> 2 x 64."""
    return 1, (_llama3_8b_model("fused") + _llama3_8b_training()
               + ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
                  "--fp8-amax-compute-algo", "max", "--fp8-param-gather"]
               + ["--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
                  "--sequence-parallel"]
               + _llama3_8b_mock_data(tmp)
               + ["--log-interval", "1", "--eval-iters", "1", "--eval-interval", "2",
                  "--save-interval", "1000", "--log-throughput", "--profile",
                  "--profile-step-start", "1", "--profile-step-end", "2", "--ckpt-format",
                  "torch_dist", "--distributed-timeout-minutes", "60", "--save", f"{tmp}/ckpt",
                  "--load", f"{tmp}/ckpt", "--tensorboard-dir", f"{tmp}/tb"])


def llama3_8b_h200_bf16(tmp):
    """train_llama3_8b_h200_bf16.sh (mock data); CP_SIZE 1 -> 2 on 2 ranks (Megatron's default
    --cp-comm-type p2p: ring attention)."""
    return 2, (_llama3_8b_model("fused") + _llama3_8b_training()
               + ["--tensor-model-parallel-size", "1", "--context-parallel-size", "2",
                  "--sequence-parallel"]
               + _llama3_8b_mock_data(tmp)
               + ["--log-interval", "1", "--save-interval", "1000", "--log-throughput", "--profile",
                  "--profile-step-start", "1", "--profile-step-end", "2", "--ckpt-format",
                  "torch_dist", "--distributed-timeout-minutes", "60", "--save", f"{tmp}/ckpt",
                  "--load", f"{tmp}/ckpt", "--tensorboard-dir", f"{tmp}/tb",
                  "--wandb-project", "megatron-lm-training", "--wandb-exp-name",
                  "llama3x-8b-bf16-tp1", "--wandb-save-dir", f"{tmp}/ckpt/wandb",
                  "--log-params-norm", "--log-num-zeros-in-grad", "--log-timers-to-tensorboard"])


def llama3(tmp):
    """train_llama3.sh with MODEL_SIZE=8 (shrunk), TP=1, BS=2, TOTAL_ITERS=2, ENABLE_PROFILING=1,
    USE_FLASH_ATTN=0 (no flash-attn on CPU), SAVE_CKPT_PATH set with CKPT_FORMAT=torch_dist, no
    DATA_PATH (mock data), OPTIMIZER=adam, FSDP=0, MCORE=1, ROPE_FUSION=0, TE_FP8=0."""
    return 1, (
        ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
         "--context-parallel-size", "1", "--num-layers", "2", "--hidden-size", "64",
         "--ffn-hidden-size", "160", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "131072", "--untie-embeddings-and-output-weights",
         "--position-embedding-type", "rope", "--no-position-embedding", "--swiglu",
         "--disable-bias-linear", "--init-method-std", "0.02", "--attention-dropout", "0.0",
         "--hidden-dropout", "0.0", "--normalization", "RMSNorm", "--micro-batch-size", "1",
         "--global-batch-size", "2", "--train-iters", "2",
         "--no-async-tensor-model-parallel-allreduce", "--bf16", "--no-masked-softmax-fusion",
         "--no-rope-fusion"]
        + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
           "NousResearch/Meta-Llama-3-8B", "--dataloader-type", "cyclic", "--save-interval",
           "200000", "--tensorboard-dir", f"{tmp}/log", "--log-interval", "1", "--eval-interval",
           "320000", "--eval-iters", "10", "--num-workers", "8", "--mock-data"]
        + ["--log-interval", "1", "--log-throughput", "--no-save-optim", "--no-save-rng",
           "--eval-iters", "-1", "--save-interval", "5000", "--eval-interval", "5000",
           "--ckpt-format", "torch_dist", "--save", f"{tmp}/ckpt"]
        + ["--group-query-attention", "--num-query-groups", "2", "--no-gradient-accumulation-fusion",
           "--distributed-backend", "gloo", "--distributed-timeout-minutes", "120",
           "--overlap-grad-reduce", "--rerun-mode", "disabled", "--use-distributed-optimizer",
           "--overlap-param-gather", "--profile", "--use-pytorch-profiler", "--tensorboard-dir",
           f"{tmp}/log", "--use-mcore-models"]
        + ["--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-iters", "320000", "--lr-decay-style",
           "cosine", "--weight-decay", "1.0e-1", "--clip-grad", "1.0", "--optimizer", "adam",
           "--adam-beta1", "0.9", "--adam-beta2", "0.95"])


SCRIPTS = {"train_gpt3_175b_distributed.sh": gpt3_175b,
           "train_llama3_8b_h100_fp8.sh": llama3_8b_h100_fp8,
           "train_llama3_8b_h200_bf16.sh": llama3_8b_h200_bf16,
           "train_llama3.sh": llama3}
# --distributed-backend nccl in train_llama3.sh is gloo here (CPU); the model above has 2 layers.

# train_llama3.sh's other switch values (RECOMPUTE=1, FSDP=1, USE_FLASH_ATTN=1, SEQ_PARALLEL=1,
# CONTI_PARAMS=1, TE_FP8=1, WANDB_API_KEY, LOAD_CKPT_PATH): categorised and parsed, not run.
LLAMA3_SH_SWITCHES = [
    "--recompute-num-layers", "2", "--recompute-granularity", "full", "--recompute-method", "block",
    "--optimizer", "sgd", "--use-torch-fsdp2", "--use-flash-attn", "--sequence-parallel",
    "--use-contiguous-parameters-in-local-ddp", "--transformer-impl=transformer_engine",
    "--fp8-margin=0", "--fp8-format=hybrid", "--fp8-interval=1", "--fp8-amax-history-len=1024",
    "--fp8-amax-compute-algo=max", "--attention-softmax-in-fp32", "--keep_fp8_weight_transpose_cache",
    "--wandb-project=LLama", "--wandb-exp-name=LLama_8B", "--wandb-save-dir", "logs/wandb",
    "--exit-on-missing-checkpoint", "--no-load-optim", "--no-load-rng", "--use-checkpoint-args",
    "--load", "ckpt"]


def _flag_names(argv):
    return [a.split("=")[0] for a in argv if a.startswith("--") and not a[2:3].isdigit()]


def _run(nproc, argv, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.update(WANDB_MODE="offline")       # wandb, where installed, never reaches the network
    if nproc == 1:
        cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py")]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), os.path.join(ROOT, "pretrain_gpt.py")]
    out = subprocess.run(cmd + argv, capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
    return out.returncode, out.stdout + out.stderr


def _files(tmp):
    for name in ("gpt2-vocab.json", "gpt2-merges.txt"):
        (tmp / name).write_text("{}" if name.endswith("json") else "#version: 0.2\n")


def assert_startup_lines_once(out):
    """Every start-up line ("> ..." before the first log line) is said once, and no two of them
    say the same thing under different labels ("> attention backend: X" and "> attention: X")."""
    head = out.split(" iteration ")[0].splitlines()
    lines = [ln for ln in head if ln.startswith("> ")]
    assert lines and len(set(lines)) == len(lines), [ln for ln in lines if lines.count(ln) > 1]
    said = [ln.split(": ", 1)[-1] for ln in lines]
    assert len(set(said)) == len(said), [ln for ln, s in zip(lines, said) if said.count(s) > 1]


def _check_clean_run(name, rc, out, argv, tmp):
    assert rc == 0, f"{name}:\n{out[-4000:]}"
    assert "unrecognized arguments" not in out and "Traceback" not in out, out[-4000:]
    assert_startup_lines_once(out)
    scraped = scrape_log(out)
    assert len(scraped["throughput per GPU"]) == 2 and all(v > 0 for v in scraped["throughput per GPU"])
    assert len(scraped["elapsed time per iteration"]) == 2, out[-3000:]
    noops = [f for f in mc.NOOP if f in argv]
    if noops:
        lines = [ln for ln in out.splitlines() if "accepted as no-ops" in ln]
        assert len(lines) == 1 and all(f in lines[0] for f in noops), lines
    if "--context-parallel-size" in argv and argv[argv.index("--context-parallel-size") + 1] != "1":
        assert out.count("--cp-comm-type p2p: ring attention over") == 1, out[-3000:]
    if "--profile" in argv and "--profile-step-start" not in argv:   # Megatron's 10-12: none here
        assert out.count("nothing is profiled") == 1, out[-3000:]
    if "--no-save-optim" in argv:      # the final save: no optimizer state, no RNG state
        meta = json.load(open(tmp / "ckpt" / "iter_0000002" / "megatron_sp.json"))
        assert meta["has_optimizer"] is False and meta["has_rng"] is ("--no-save-rng" not in argv)
    if "--wandb-project" in argv and importlib.util.find_spec("wandb") is None:
        assert out.count("wandb is not installed") == 1, out[-3000:]


def _expect(name, rc, out, argv, tmp):
    if "--fp8-format" in argv and not HAS_TE and not HAS_TORCHAO:   # one sentence naming both
        error_lines = [ln for ln in out.splitlines() if ln.startswith("error:")]
        assert rc != 0 and len(error_lines) >= 1, out[-3000:]
        assert re.search(r"transformer.?engine", error_lines[0], re.I), error_lines
        assert "torchao" in error_lines[0], error_lines
        assert "Traceback" not in out
    else:
        _check_clean_run(name, rc, out, argv, tmp)
        if "--fp8-format" in argv and not HAS_TE:   # FP8 through torchao, said once
            assert out.count("> --fp8-format hybrid: through torchao") == 1, out[-3000:]


def test_every_flag_of_the_scripts_has_a_category():
    categorised = {row[0] for row in mc.categories()}
    scripts = dict(SCRIPTS, **{"train_llama3.sh switches": lambda tmp: (1, LLAMA3_SH_SWITCHES)})
    for name, script in scripts.items():
        flags = set(_flag_names(script("tmp")[1]))
        missing, unparsed = sorted(flags - categorised), sorted(flags - PARSER_FLAGS)
        assert not missing and not unparsed, f"{name}: {missing} {unparsed}"


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_script_as_megatron_has_it(name, tmp_path):
    nproc, argv = SCRIPTS[name](str(tmp_path))
    _files(tmp_path)
    rc, out = _run(nproc, argv, tmp_path)
    _expect(name, rc, out, argv, tmp_path)


RAMP = ["--mock-data", "--vocab-size", "256", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--position-embedding-type", "rope", "--normalization",
        "RMSNorm", "--swiglu", "--seq-length", "32", "--micro-batch-size", "1",
        "--global-batch-size", "6", "--rampup-batch-size", "2", "2", "8", "--train-samples", "26",
        "--lr-decay-samples", "24", "--lr-warmup-samples", "4", "--lr", "1e-3",
        "--log-interval", "1", "--eval-iters", "0", "--attention-dropout", "0", "--hidden-dropout",
        "0", "--distributed-backend", "gloo", "--save-interval", "2"]


def _records(path):
    return [json.loads(line) for line in open(path) if '"lm_loss"' in line]


def test_rampup_with_context_parallel_and_resume_mid_ramp_match_one_rank(tmp_path):
    """Ramp 2 -> 6 by 2 over 8 samples, 26 samples: batches 2, 2, 4, 6, 6, 6 (Megatron's)."""
    one = RAMP + ["--save", str(tmp_path / "one"), "--metrics-jsonl", str(tmp_path / "one.jsonl"),
                  "--profile", "--use-pytorch-profiler", "--profile-step-start", "2",
                  "--profile-step-end", "3", "--tensorboard-dir", str(tmp_path / "tb")]
    cp = RAMP + ["--context-parallel-size", "2", "--metrics-jsonl", str(tmp_path / "cp.jsonl")]
    resumed = RAMP + ["--load", str(tmp_path / "one"), "--ckpt-step", "2",
                      "--save", str(tmp_path / "two"), "--metrics-jsonl", str(tmp_path / "two.jsonl")]
    # The three runs' ranks forked with the launcher's environment set by hand (run_script: the
    # same computation as under torchrun, without fresh interpreters; every path is absolute).
    rcs, out = run_script("pretrain_gpt.py", one, world=1, WANDB_MODE="offline")
    assert rcs == [0], out[-4000:]
    rcs, out = run_script("pretrain_gpt.py", cp, world=2, WANDB_MODE="offline")
    assert rcs == [0, 0] and "--cp-comm-type p2p: ring attention over 2 ranks" in out, out[-4000:]
    rcs, out = run_script("pretrain_gpt.py", resumed, world=1, WANDB_MODE="offline")
    assert rcs == [0], out[-4000:]
    ref = _records(tmp_path / "one.jsonl")
    traces = [f for _, _, fs in os.walk(tmp_path / "tb") for f in fs if "pt.trace" in f]
    assert len(traces) == 1, "--use-pytorch-profiler wrote no trace to --tensorboard-dir"
    assert [r["global_batch_size"] for r in ref] == [2, 2, 4, 6, 6, 6]
    assert [r["consumed_samples"] for r in ref] == [2, 4, 8, 14, 20, 26]
    for name, records in (("cp", _records(tmp_path / "cp.jsonl")),
                          ("resumed", _records(tmp_path / "two.jsonl"))):
        expect = ref if name == "cp" else ref[2:]
        assert [r["iteration"] for r in records] == [r["iteration"] for r in expect], name
        for a, b in zip(expect, records):
            assert (a["consumed_samples"], a["global_batch_size"]) == \
                (b["consumed_samples"], b["global_batch_size"]), name
            assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-5 * abs(a["lm_loss"]), (name, a, b)
            assert a["lr"] == pytest.approx(b["lr"], rel=1e-12), name
