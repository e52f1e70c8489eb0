"""--context-parallel-layout through pretrain_gpt.py (ranks forked by run_script): on a .bin/.idx of
skewed packed documents (--reset-attention-mask --reset-position-ids), cp 2 balanced (the
default) and cp 2 --context-parallel-layout zigzag reproduce the one-rank losses (1e-5 relative,
every logged iteration); each says its layout once at start-up; the metrics JSONL carries
cp_work_balance every iteration (the log line the same, rounded), 1.02 at most with the
balanced layout, above it with the zigzag on these rows; the one-rank run has none. A
checkpoint saved at iteration 2 under the balanced layout resumes under the zigzag, its third
loss the one-rank run's (the layout is per step, never stored)."""
import json
import os

import numpy as np

from megatron_sp.testing import run_script

VOCAB = 128
SEQ = 256
COMMON = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
          "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "64",
          "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
          "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
          "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
          "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "3",
          "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
          "--split", "100,0,0", "--eval-iters", "0", "--log-interval", "1", "--seed", "7",
          "--distributed-backend", "gloo", "--reset-attention-mask", "--reset-position-ids"]


def write_skewed(prefix: str, rows: int, seed: int) -> None:
    """Rows' worth of documents: one long (45-75% of a row) among short ones (1-24 tokens), each
    ending in eod = VOCAB (NullTokenizer)."""
    from data.indexed_dataset import IndexedDatasetBuilder
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(rows):
        long = int(rng.uniform(0.45, 0.75) * SEQ)
        lengths = [long]
        while sum(lengths) < SEQ + 1:
            lengths.insert(int(rng.integers(0, len(lengths) + 1)), int(rng.integers(2, 25)))
        for n in lengths:
            builder.add_document(np.append(rng.integers(0, VOCAB, n - 1), VOCAB), [n])
    builder.finalize(prefix + ".idx")


def _run(tmp, world, extra, name, data, save=None, iterations=3):
    metrics = os.path.join(tmp, f"{name}.jsonl")
    save = save or ["--save", os.path.join(tmp, name), "--save-interval", "1000"]
    rcs, out = run_script("pretrain_gpt.py", COMMON + ["--data-path", data, "--metrics-jsonl",
                                                       metrics] + save + extra,
                          world=world, timeout_s=300)
    assert rcs == [0] * world, f"{name}: exit {rcs}\n{out[-4000:]}"
    records = [json.loads(line) for line in open(metrics) if '"lm_loss"' in line]
    assert len(records) == iterations, (name, records)
    return out, records


def test_layouts_match_one_rank_and_log_their_balance(tmp_path, seed):
    data = str(tmp_path / "skewed_text_document")
    write_skewed(data, 12, seed)
    _, one = _run(str(tmp_path), 1, [], "one", data)
    assert all("cp_work_balance" not in r for r in one)
    cp = ["--context-parallel-size", "2"]
    runs = {"balanced": _run(str(tmp_path), 2, cp, "balanced", data),
            "zigzag": _run(str(tmp_path), 2, cp + ["--context-parallel-layout", "zigzag"],
                           "zigzag", data)}
    for name, (out, records) in runs.items():
        for a, b in zip(one, records):
            assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-5 * abs(a["lm_loss"]), (name, a, b)
        said = [line for line in out.splitlines() if "> ring layout:" in line]
        assert len(said) == 1 and said[0].split("> ring layout: ")[1].startswith(name), said
        logged = [float(x.split("|")[0]) for x in out.split("cp work balance: ")[1:]]
        assert logged == [round(r["cp_work_balance"], 3) for r in records], (name, logged)
    balanced = [r["cp_work_balance"] for r in runs["balanced"][1]]
    zigzag = [r["cp_work_balance"] for r in runs["zigzag"][1]]
    assert max(balanced) <= 1.02 and min(zigzag) > 1.02, (balanced, zigzag)
    # The layout is per step, never stored: a checkpoint saved under one resumes under the other.
    ckpt = str(tmp_path / "ckpt")
    _run(str(tmp_path), 2, cp + ["--train-iters", "2", "--lr-decay-iters", "3"], "first2", data,
         save=["--save", ckpt, "--save-interval", "2"], iterations=2)
    _, resumed = _run(str(tmp_path), 2, cp + ["--context-parallel-layout", "zigzag"], "resumed",
                      data, save=["--load", ckpt, "--save", ckpt, "--save-interval", "1000"],
                      iterations=1)
    assert resumed[0]["iteration"] == 3
    assert abs(resumed[0]["lm_loss"] - one[2]["lm_loss"]) <= 1e-5 * abs(one[2]["lm_loss"]), (
        resumed, one)
