"""CLI smoke test of the embedded default: `python pretrain_gpt.py` with no data and no model builds
the stdlib-docs corpus, trains a sentencepiece tokenizer, preprocesses to .bin/.idx, trains, saves a
checkpoint and a metrics file (shortened here with --train-iters and a shorter sequence); the
corpus build is timed and the first step's line gives the run's ETA, long before the first log
line."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(660)     # builds the corpus and tokenizer first; the run itself has 600 s
def test_embedded_default_runs_end_to_end(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    save = tmp_path / "ckpt"
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--cache-dir", str(tmp_path / "cache"),
           "--train-iters", "12", "--seq-length", "64", "--log-interval", "4", "--eval-interval", "12",
           "--lr-warmup-iters", "2", "--save", str(save), "--metrics-jsonl", str(metrics)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "embedded default finished" in out.stdout
    # what a user waits for is timed: the corpus build, then an ETA right after the first step
    assert out.stdout.startswith("> the embedded default builds its corpus and tokenizer from "
                                 "the stdlib's docs (once), then trains 12 iterations of a tiny "
                                 "GPT: about "), out.stdout[:3000]     # an estimate before anything
    assert "> embedded default corpus built in " in out.stdout, out.stdout[-3000:]
    assert "; at that pace the other 11 iterations take about " in out.stdout, out.stdout[-3000:]
    assert out.stdout.index("> first step (iteration 1)") < out.stdout.index(" iteration        4/")
    cache = tmp_path / "cache"
    assert list(cache.glob("*_text_document.bin")) and list(cache.glob("*_text_document.idx"))
    assert list(cache.glob("*.model"))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if "lm_loss" in r]
    assert [r["iteration"] for r in train] == [4, 8, 12]
    losses = np.array([r["lm_loss"] for r in train])
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]        # the loss falls
    assert any("valid_lm_loss" in r for r in records)
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "12"
    assert (save / "iter_0000012").is_dir()

    # Re-running the finished default says so and trains nothing: metrics and checkpoint untouched.
    # Another --train-iters with that run folder is refused, naming the folder, never trained over.
    # (Both decide from the checkpoint before anything is built, locked or written: run together.)
    before = metrics.read_text()
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=tmp_path)
             for c in (cmd, cmd + ["--train-iters", "3"])]              # (last wins)
    outs = [p.communicate(timeout=600) for p in procs]
    again, other = (subprocess.CompletedProcess(p.args, p.returncode, *o)
                    for p, o in zip(procs, outs))
    assert again.returncode == 0, again.stderr[-2000:]
    assert "already finished" in again.stderr and "building the embedded default corpus" not in again.stdout
    assert other.returncode != 0 and "holds an embedded-default run of 12 iterations" in other.stderr
    assert metrics.read_text() == before
