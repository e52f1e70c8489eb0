"""The README's "Your own text" walkthrough, command by command, on a small corpus made here:
train a tokenizer -> preprocess -> train (interrupted by --exit-interval) -> resume with the same
command -> convert to Hugging Face and back -> fine-tune with --load --finetune --use-checkpoint-args.
Sizes are shrunk (tiny sequence, a few iterations); the flags are the README's."""
import json
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = ("the quick brown fox jumps over a lazy dog while models train on tokens of text in layers of "
         "attention with sequence and tensor parallel ranks").split()


def _run(args, cwd, expect_ok=True):
    out = subprocess.run([sys.executable] + args, capture_output=True, text=True, timeout=300,
                         cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if expect_ok:
        assert out.returncode == 0, " ".join(args) + "\n" + out.stdout[-2000:] + out.stderr[-2000:]
    return out


def _corpus(path, seed=0, docs=300):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 100)))
            f.write(json.dumps({"text": text}) + "\n")


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
    train = [os.path.join(ROOT, "pretrain_gpt.py"), "--model", "llama-tiny", "--num-layers", "2",
             "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--train-iters", "4", "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-interval", "2",
             "--eval-iters", "1", "--log-interval", "1", "--save", "runs/mine/checkpoints",
             "--load", "runs/mine/checkpoints", "--save-interval", "2",
             "--metrics-jsonl", "runs/mine/metrics.jsonl"] + data
    _run(train + ["--exit-interval", "2"], tmp_path)           # a pre-empted run
    metrics = tmp_path / "runs" / "mine" / "metrics.jsonl"
    assert [r["iteration"] for r in _train_records(metrics)] == [1, 2]
    _run(train, tmp_path)                                        # the same command resumes
    assert [r["iteration"] for r in _train_records(metrics)] == [1, 2, 3, 4]

    convert = os.path.join(ROOT, "tools", "checkpoint", "convert.py")
    _run([convert, "--loader", "megatron_sp", "--saver", "hf", "--load-dir", "runs/mine/checkpoints",
          "--save-dir", "runs/mine/hf"], tmp_path)
    back = _run([convert, "--loader", "hf", "--saver", "megatron_sp", "--load-dir", "runs/mine/hf",
                 "--save-dir", "runs/ft/base"], tmp_path)
    assert "--use-checkpoint-args" in back.stdout and "--num-layers 2" in back.stdout

    finetune = [os.path.join(ROOT, "pretrain_gpt.py"), "--load", "runs/ft/base", "--finetune",
                "--use-checkpoint-args", "--seq-length", "32", "--micro-batch-size", "2",
                "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-4", "--eval-iters", "1",
                "--log-interval", "1", "--save", "runs/ft/checkpoints",
                "--metrics-jsonl", "runs/ft/metrics.jsonl"] + data
    out = _run(finetune + ["--hidden-size", "64"], tmp_path)    # an explicit model flag that differs
    assert "--hidden-size 64 is replaced by the checkpoint's 256" in out.stderr
    first = _train_records(tmp_path / "runs" / "ft" / "metrics.jsonl")[0]["lm_loss"]
    trained = _train_records(metrics)[-1]["lm_loss"]
    # Fine-tuning starts from the trained weights: its first loss is near the last pretraining loss,
    # far below a fresh model's ln(vocab) (~6).
    assert abs(first - trained) < 0.5, (first, trained)

    missing = _run(finetune[:1] + ["--load", "runs/none", "--finetune", "--use-checkpoint-args",
                                   "--seq-length", "32"] + data, tmp_path, expect_ok=False)
    assert missing.returncode != 0 and "--use-checkpoint-args found no checkpoint" in missing.stderr
