"""pretrain_gpt.py on a small corpus with the default --split 969,30,1 (its test split holds no
document and is never read, so it must not stop the run) whose token ids exceed the training
vocabulary: the first micro-batch stops the run with one line naming the data, split and sample."""
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_out_of_vocabulary_batch_stops_with_one_line(tmp_path):
    rng = np.random.default_rng(7)
    with open(tmp_path / "c.jsonl", "w") as f:
        for _ in range(200):
            f.write(json.dumps({"text": " ".join(map(str, rng.integers(0, 1500, 40)))}) + "\n")
    prefix = str(tmp_path / "c")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input",
                    str(tmp_path / "c.jsonl"), "--output-prefix", prefix, "--tokenizer-type",
                    "NullTokenizer", "--vocab-size", "2000", "--append-eod"],
                   check=True, capture_output=True, timeout=120)
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--model", "gpt2-tiny",
           "--data-path", prefix + "_text_document", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", "1000", "--seq-length", "32", "--micro-batch-size", "2",
           "--global-batch-size", "2", "--train-iters", "2", "--lr-warmup-iters", "0",
           "--eval-iters", "1", "--eval-interval", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.startswith(f"error: sample 0 of the train split of {prefix}"
                                 f"_text_document (from document ")
    assert "outside the vocabulary of 1001 ids" in out.stderr
