"""The first hour, second round (issue 29): every start-up mistake is one sentence before any
expensive work, a mistyped flag names the flag it meant, --help is short and grouped, the log line
ends with an ETA (Megatron's fields untouched), Ctrl-C names the checkpoint that survived and the
command that resumes, and convert.py names a tokenizer it cannot export.

In-process (load_job / parse_args / main(argv)) where the sentence is the same as the program
prints it (run_main prints "error: " + the UserError's message, exit status 1; argparse exits 2);
one subprocess checks that the preset typo really is the first and only line, exit status 1.
"""
import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

from megatron_sp.cli.arguments import parse_args
from megatron_sp.cli.progress import interrupted_message
from megatron_sp.errors import ConfigError, DataError
from megatron_sp.training.metrics import StepClock, format_duration, format_log_line

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _module(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pretrain = _module("pretrain_gpt_round2", "pretrain_gpt.py")
convert = _module("convert_round2", os.path.join("tools", "checkpoint", "convert.py"))


@pytest.fixture
def one_process(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)


def _data(tmp_path, prefix="corpus_text_document", tokenizer=None):
    """--data-path and tokenizer flags of a preprocessed prefix (empty files: nothing reads them
    before the checks under test)."""
    for ext in (".bin", ".idx"):
        (tmp_path / (prefix + ext)).write_bytes(b"")
    model = tmp_path / "tok.model"
    model.write_bytes(b"")
    return ["--data-path", str(tmp_path / prefix), "--tokenizer-type", "GPTSentencePieceTokenizer",
            "--tokenizer-model", str(tokenizer or model)]


def _refused(argv, error=ConfigError):
    with pytest.raises(error) as err:
        pretrain.load_job(argv)
    message = f"error: {err.value}"
    assert "\n" not in message and message.endswith((".", "?", "`.")), message
    return message


def test_start_up_mistakes_before_any_expensive_work(tmp_path, one_process):
    base = ["--model", "llama-tiny", "--seq-length", "32"]
    # A mistyped preset is the first complaint, even with --seq-length missing.
    assert _refused(["--model", "llama-tny"]) == \
        "error: unknown model preset 'llama-tny'; did you mean 'llama-tiny'?"
    assert _refused(["--model", "qwen3-4"]) == \
        "error: unknown model preset 'qwen3-4'; did you mean 'qwen3-4b'?"
    data = _data(tmp_path)
    missing = str(tmp_path / "nothing")
    assert _refused(base + ["--data-path", missing] + data[2:], DataError) == (
        f"error: --data-path {missing}: {missing}.bin and {missing}.idx do not exist; make them "
        f"with tools/preprocess_data.py --output-prefix PREFIX (it writes "
        f"PREFIX_text_document.bin/.idx) and pass that prefix.")
    no_suffix = str(tmp_path / "corpus")          # the --output-prefix, not the written prefix
    assert _refused(base + ["--data-path", no_suffix] + data[2:], DataError) == (
        f"error: --data-path {no_suffix}: no {no_suffix}.bin, but {no_suffix}_text_document.bin "
        f"exists: pass --data-path {no_suffix}_text_document (tools/preprocess_data.py adds "
        f"_text_document to its --output-prefix).")
    tok = str(tmp_path / "tk.model")
    assert _refused(base + _data(tmp_path, tokenizer=tok), DataError) == (
        f"error: --tokenizer-type GPTSentencePieceTokenizer needs --tokenizer-model with a "
        f"sentencepiece .model file, got {tok!r}, which does not exist; tools/train_tokenizer.py "
        f"writes one (PREFIX.model).")
    # The schedule: one sentence at the edge, not the scheduler's ValueError.
    assert _refused(base + data + ["--train-iters", "5", "--lr-warmup-iters", "20"]) == (
        "error: --lr-warmup-iters 20 is longer than the learning-rate decay, --lr-decay-iters 5 "
        "(which defaults to --train-iters); lower --lr-warmup-iters or raise --lr-decay-iters.")
    assert _refused(base + data + ["--train-iters", "50", "--lr-decay-iters", "10",
                                   "--lr-warmup-iters", "20"]).endswith(
        "--lr-decay-iters 10; lower --lr-warmup-iters or raise --lr-decay-iters.")
    # A layout for two processes started as one: the torchrun command that runs it.
    argv = ["--mock-data", "--seq-length", "32", "--model", "llama-tiny",
            "--tensor-model-parallel-size", "2"]
    assert _refused(argv) == (
        "error: world size 1 is not divisible by tp*sp*pp = 2 (tp=2, sp=1, pp=1): choose sizes "
        "whose product divides the number of ranks; this is one process: run it with `torchrun "
        "--nproc-per-node 2 pretrain_gpt.py --mock-data --seq-length 32 --model llama-tiny "
        "--tensor-model-parallel-size 2`.")
    job, _ = pretrain.load_job(base + data + ["--train-iters", "5", "--lr-warmup-iters", "5"])
    assert job.training.lr_warmup_iters == 5          # warm-up == decay is fine
    # No preset and an incomplete shape: one sentence, not GPTConfig's TypeError after start-up.
    assert _refused(["--mock-data", "--seq-length", "32", "--hidden-size", "64",
                     "--num-attention-heads", "4"]) == (
        "error: the model has no --num-layers: without --model (a preset such as llama-tiny or "
        "llama-8b) --num-layers, --hidden-size and --num-attention-heads are all needed; give "
        "them, or name a preset with --model.")
    pretrain.load_job(["--mock-data", "--seq-length", "32", "--num-layers", "2", "--hidden-size",
                       "64", "--num-attention-heads", "4"])            # all three: fine


def test_the_preset_typo_is_the_only_line_and_exit_1(one_process):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--model",
                          "llama-tny"], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "MEGATRON_SP_DEBUG"})
    assert out.returncode == 1 and out.stdout == "", out.stdout + out.stderr
    assert out.stderr == "error: unknown model preset 'llama-tny'; did you mean 'llama-tiny'?\n"


@pytest.mark.parametrize("typo,meant", [("--seq-len", "--seq-length"),
                                        ("--tensor-parallel-size", "--tensor-model-parallel-size")])
def test_a_mistyped_flag_names_the_flag_and_the_short_usage(typo, meant, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", "llama-tiny", typo, "2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("usage: ") and len(err[0]) < 120, err
    assert err[1] == f"error: unrecognized argument {typo}; did you mean {meant}?"


def test_help_is_grouped_and_short_and_help_all_has_the_rest(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    short = capsys.readouterr().out
    with pytest.raises(SystemExit):
        parse_args(["--help-all"])
    full = capsys.readouterr().out
    assert len(short.splitlines()) < 260 < len(full.splitlines()), (len(short.splitlines()),
                                                                   len(full.splitlines()))
    assert len(short.splitlines()[0]) < 120              # a one-line usage
    for group in ("model:", "training:", "data:", "parallelism:", "checkpointing and exit:"):
        assert "\n" + group in short
    assert "Megatron-LM compatibility" not in short and "--use-mcore-models" not in short
    assert "--help-all:" in short
    assert "Megatron-LM compatibility" in full and "--use-mcore-models" in full


def test_log_line_ends_with_an_eta_and_keeps_megatrons_fields():
    clock = StepClock(window=5)
    for seconds in (30.0, 1.0, 2.0, 1.5, 1.0, 2.0):    # the slow first step leaves the window
        clock.add(seconds)
    assert clock.eta(100) == 100 * 1.5                   # remaining x median
    record = {"iteration": 20, "consumed_samples": 160, "ms_per_iter": 500.0,
              "tflops_per_gpu": 0.01, "lr": 1e-3, "global_batch_size": 8, "lm_loss": 5.0,
              "grad_norm": 1.0, "tokens_per_sec": 100.0, "eta_s": clock.eta(180)}
    line = format_log_line(record, 200, "saved for backward (MB/rank): 1.00")
    fields = [f.strip() for f in line.split(" | ")]
    assert fields[1].startswith("consumed samples") and fields[-1] == "ETA: 4m30s |"
    assert fields[-2] == "saved for backward (MB/rank): 1.00" and "| |" not in line
    assert [format_duration(s) for s in (4.2, 65, 3725)] == ["4s", "1m05s", "1h02m05s"]


def test_ctrl_c_names_the_last_checkpoint_and_the_command(tmp_path, one_process, monkeypatch):
    save = tmp_path / "ck"

    def job(load):
        return types.SimpleNamespace(checkpoint=types.SimpleNamespace(save=str(save), load=load))
    assert interrupted_message(job(str(save)), 3, ["--save", str(save)]) == (
        f"after iteration 3; no checkpoint was completed under --save {save} yet, so the same "
        f"command starts again from scratch.")
    (save / "iter_0000002").mkdir(parents=True)
    (save / "iter_0000002" / "megatron_sp.json").write_text(json.dumps({"iteration": 2}))
    (save / "iter_0000002" / ".metadata").write_bytes(b"")
    (save / "latest_checkpointed_iteration.txt").write_text("2")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    message = interrupted_message(job(str(save)), 3, ["--save", str(save), "--load", str(save)])
    assert message == (f"after iteration 3; the last complete checkpoint is {save}/iter_0000002 "
                       f"(iteration 2); the same command resumes from it: python pretrain_gpt.py "
                       f"--save {save} --load {save}")
    assert "--load" in interrupted_message(job(None), 3, ["--save", str(save)]).split(
        "resume from it with --load")[1]


def test_convert_names_a_tokenizer_it_cannot_export(tmp_path, capsys):
    """--tokenizer-model that does not exist, or is not a sentencepiece model: one sentence."""
    from megatron_sp import checkpointing
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models import GPTConfig, GPTModel
    config = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64,
                       normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
                       add_bias_linear=False, max_position_embeddings=64)
    checkpointing.save_checkpoint(str(tmp_path / "ck"), checkpointing.RELEASE,
                                  [GPTModel(config, ParallelMesh.single())], ParallelMesh.single(),
                                  config=config)
    argv = ["--loader", "megatron_sp", "--saver", "hf", "--load-dir", str(tmp_path / "ck"),
            "--save-dir", str(tmp_path / "hf")]
    missing = str(tmp_path / "tok.model")
    with pytest.raises(SystemExit) as exit_:
        convert.main(argv + ["--tokenizer-model", missing])
    assert exit_.value.code == (f"error: the tokenizer {missing} (--tokenizer-model) does not "
                                f"exist; run from the folder the training ran in or pass "
                                f"--tokenizer-model PATH.")
    (tmp_path / "tok.model").write_bytes(b"\xff\x00 not a model")
    with pytest.raises(SystemExit) as exit_:
        convert.main(argv + ["--tokenizer-model", missing])
    assert exit_.value.code == (f"error: the tokenizer {missing} (--tokenizer-model): {missing} "
                                f"is not a sentencepiece .model file; pass a sentencepiece .model "
                                f"or a Hugging Face tokenizer folder.")
    convert.main(argv)         # a converted checkpoint records no tokenizer: said, model exported
    out = capsys.readouterr().out
    assert "> no tokenizer exported: the checkpoint records none (a converted checkpoint)" in out
    mode = 0o666 & ~_umask()
    for name in ("model.safetensors", "config.json"):
        assert os.stat(tmp_path / "hf" / name).st_mode & 0o777 == mode, name   # not 0600


def _umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_the_embedded_default_says_how_long_before_it_starts():
    """The line before the corpus and the model: the idle figure, scaled by the load average."""
    from megatron_sp.cli.progress import embedded_estimate
    idle = embedded_estimate(100, corpus_cached=False, cores=2, load=0.0)
    assert idle == ("> the embedded default builds its corpus and tokenizer from the stdlib's docs "
                    "(once), then trains 100 iterations of a tiny GPT: about 1m10s on 2 idle "
                    "cores (the first step's line gives a measured ETA) ...")
    busy = embedded_estimate(100, corpus_cached=True, cores=2, load=5.0)
    assert busy == ("> the embedded default trains 100 iterations of a tiny GPT: about 50s on 2 "
                    "idle cores; this machine's load average is 5.0 on 2 cores, so expect about "
                    "2m30s (the first step's line gives a measured ETA) ...")
    assert "load average" in embedded_estimate(10, True)  or "idle cores (" in \
        embedded_estimate(10, True)                      # this machine's figures: one of the two
