"""The README's "Your own text" walkthrough, command by command, on a small corpus made here (words
in indented lines, tabs, unicode): train a tokenizer -> preprocess -> train (interrupted by Ctrl-C,
a SIGINT the fault injection sends during iteration 3) -> resume with the same command -> convert
to Hugging Face (model and tokenizer) -> transformers loads both, encodes with sentencepiece's ids
and generates -> back to megatron_sp -> fine-tune with --load --finetune --use-checkpoint-args.
Sizes are shrunk (tiny sequence, a few iterations); the flags are the README's."""
import json
import os
import random
import shlex
import subprocess
import sys

import sentencepiece as spm
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = ("the quick brown fox jumps over a lazy dog while models train on tokens of text in layers of "
         "attention with sequence and tensor parallel ranks").split()


def _run(args, cwd, expect_ok=True, **env):
    return _finish(_start(args, cwd, **env), expect_ok)


def _start(args, cwd, **env):
    """A command started (stdout and stderr apart); _finish waits for it: the steps that do not
    depend on each other overlap (each starts an interpreter that imports torch)."""
    proc = subprocess.Popen([sys.executable] + args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    proc.argv = args
    return proc


def _finish(proc, expect_ok=True):
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    out = subprocess.CompletedProcess(proc.argv, proc.returncode, stdout, stderr)
    if expect_ok:
        assert out.returncode == 0, " ".join(proc.argv) + "\n" + stdout[-2000:] + stderr[-2000:]
    return out


def _corpus(path, seed=0, docs=300):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            lines = [" " * rng.choice((0, 4, 8)) + "\t" * rng.randint(0, 1)
                     + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
                     for _ in range(rng.randint(2, 8))]
            f.write(json.dumps({"text": "\n".join(lines) + " — ünï 日本"}) + "\n")


def _train_records(path):
    return [json.loads(line) for line in open(path) if "lm_loss" in line and "valid" not in line]


def test_readme_own_text_walkthrough(tmp_path):
    d = tmp_path / "mydata"
    d.mkdir()
    _corpus(d / "corpus.jsonl")
    tok = _run([os.path.join(ROOT, "tools", "train_tokenizer.py"), "--input", "mydata/corpus.jsonl",
                "--json-keys", "text", "--vocab-size", "400", "--output-prefix", "mydata/tok"], tmp_path)
    assert (d / "tok.model").is_file() and "tools/preprocess_data.py" in tok.stdout
    _run([os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", "mydata/corpus.jsonl",
          "--output-prefix", "mydata/corpus", "--json-keys", "text", "--append-eod",
          "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "mydata/tok.model",
          "--workers", "2"], tmp_path)
    data = ["--data-path", "mydata/corpus_text_document", "--split", "98,2,0",
            "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "mydata/tok.model"]
    # (checked at the end; it reads nothing the walkthrough writes, so it runs alongside)
    missing = _start([os.path.join(ROOT, "pretrain_gpt.py"), "--load", "runs/none", "--finetune",
                      "--use-checkpoint-args", "--seq-length", "32"] + data, tmp_path)
    train = [os.path.join(ROOT, "pretrain_gpt.py"), "--model", "llama-tiny", "--num-layers", "2",
             "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--train-iters", "4", "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-interval", "2",
             "--eval-iters", "1", "--log-interval", "2", "--save", "runs/mine/checkpoints",
             "--load", "runs/mine/checkpoints", "--save-interval", "2",
             "--metrics-jsonl", "runs/mine/metrics.jsonl"] + data
    ctrl_c = _run(train, tmp_path, expect_ok=False, MEGATRON_SP_INJECT_KILL_AT_ITER="3",
                  MEGATRON_SP_INJECT_SIGNAL="INT")                 # Ctrl-C during iteration 3
    assert ctrl_c.returncode == 130, ctrl_c.stdout[-2000:] + ctrl_c.stderr[-2000:]
    assert ctrl_c.stderr.strip().splitlines()[-1] == (
        "interrupted after iteration 2; the last complete checkpoint is "
        "runs/mine/checkpoints/iter_0000002 (iteration 2); the same command resumes from it: "
        + shlex.join(["python"] + train)), ctrl_c.stderr[-2000:]
    for phase in ("> model built in ", "> dataset indices ready in ", "> first step (iteration 1) "):
        assert phase in ctrl_c.stdout, ctrl_c.stdout[-3000:]
    assert "GPTConfig(" not in ctrl_c.stdout and "| |" not in ctrl_c.stdout
    assert " | ETA: " in ctrl_c.stdout            # the log line of iteration 2 (of 4)
    metrics = tmp_path / "runs" / "mine" / "metrics.jsonl"
    assert [r["iteration"] for r in _train_records(metrics)] == [2]
    _run(train, tmp_path)                                        # the same command resumes
    assert [r["iteration"] for r in _train_records(metrics)] == [2, 4]

    convert = os.path.join(ROOT, "tools", "checkpoint", "convert.py")
    export = _run([convert, "--loader", "megatron_sp", "--saver", "hf", "--load-dir",
                   "runs/mine/checkpoints", "--save-dir", "runs/mine/hf"], tmp_path)
    assert ("> tokenizer: GPTSentencePieceTokenizer mydata/tok.model (recorded in the checkpoint): "
            "bos 1, eos 2, pad 3") in export.stdout, export.stdout
    back = _start([convert, "--loader", "hf", "--saver", "megatron_sp", "--load-dir",
                   "runs/mine/hf", "--save-dir", "runs/ft/base"], tmp_path)   # both only read hf
    _transformers_load_and_generate(tmp_path / "runs" / "mine" / "hf", d / "tok.model")
    back = _finish(back)
    assert "--use-checkpoint-args" in back.stdout and "--num-layers 2" in back.stdout

    finetune = [os.path.join(ROOT, "pretrain_gpt.py"), "--load", "runs/ft/base", "--finetune",
                "--use-checkpoint-args", "--seq-length", "32", "--micro-batch-size", "2",
                "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-4", "--eval-iters", "1",
                "--log-interval", "1", "--save", "runs/ft/checkpoints",
                "--metrics-jsonl", "runs/ft/metrics.jsonl"] + data
    out = _run(finetune + ["--hidden-size", "64"], tmp_path)    # an explicit model flag that differs
    assert "--hidden-size 64 is replaced by the checkpoint's 256" in out.stderr
    assert "(weights only): a converted checkpoint, training starts at iteration 0" in out.stdout
    assert "iteration release" not in out.stdout
    first = _train_records(tmp_path / "runs" / "ft" / "metrics.jsonl")[0]["lm_loss"]
    trained = _train_records(metrics)[-1]["lm_loss"]
    # Fine-tuning starts from the trained weights: its first loss is near the last pretraining loss,
    # far below a fresh model's ln(vocab) (~6).
    assert abs(first - trained) < 0.5, (first, trained)

    missing = _finish(missing, expect_ok=False)
    assert missing.returncode != 0 and "--use-checkpoint-args found no checkpoint" in missing.stderr


def _transformers_load_and_generate(hf_dir, sp_model):
    """transformers loads the export's model and tokenizer: the tokenizer's ids are
    sentencepiece's (newlines, tabs, unicode), bos/eos/pad agree with config.json, the model
    generates, and the files have the user's umask (safetensors alone would write 0600)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    text = "the quick\n        brown\tfox — ünï 日本\n"
    assert tokenizer(text).input_ids == sp.encode(text)
    assert tokenizer.decode(sp.encode(text)) == text
    config = json.load(open(hf_dir / "config.json"))
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == \
        (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 3)
    prompt = tokenizer("the quick", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == prompt.input_ids.shape[1] + 4
    assert isinstance(tokenizer.decode(out[0]), str)
    mask = os.umask(0o022)
    os.umask(mask)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert os.stat(hf_dir / name).st_mode & 0o777 == 0o666 & ~mask, name
