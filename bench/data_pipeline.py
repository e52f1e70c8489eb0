"""Data pipeline benchmark: ours vs megatron-core, side by side (a few minutes on 2 cores).

python bench/data_pipeline.py [--runs 3] [--mb 8]
Rows: preprocessing MB/s with 1 and 2 workers (in a fresh interpreter, as the tool runs); random
item reads/s of IndexedDataset; GPT index build time at 1M and 10M samples (megatron-core with its
compiled helper); blending indices for 3 and 50 datasets at 1M samples.
Ours and megatron-core's runs alternate and each row reports medians, so load from other work on
the machine hits both sides alike.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

warnings.filterwarnings("ignore")
from megatron_sp.data import IndexedDataset, IndexedDatasetBuilder, preprocess, train_sentencepiece  # noqa: E402
from megatron_sp.data.blended_dataset import build_blending_indices  # noqa: E402
from megatron_sp.data.gpt_dataset import build_gpt_indices  # noqa: E402

try:
    from megatron.core.datasets import gpt_dataset as mc_gpt, helpers as mc_helpers
    from megatron.core.datasets.indexed_dataset import IndexedDataset as McIndexedDataset
except ImportError:
    mc_gpt = None


def median_time(fn, runs):
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def paired_times(ours, theirs, runs):
    """Median seconds of ours and theirs, run alternately (a load spike hits both alike)."""
    a, b = [], []
    for _ in range(runs):
        for fn, out in ((ours, a), (theirs, b)):
            if fn is None:
                continue
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return statistics.median(a), (statistics.median(b) if b else None)


def row(name, ours, theirs, unit, higher_is_better):
    if theirs is None:
        print(f"{name:<40} {ours:>12.3f} {'-':>12}  {unit}")
        return
    ratio = ours / theirs if higher_is_better else theirs / ours
    print(f"{name:<40} {ours:>12.3f} {theirs:>12.3f}  {unit:<10} x{ratio:.2f}")


PREPROCESS_RUNS = """
import json, os, resource, sys, time
from megatron_sp.data import preprocess
path, model, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
cpu = lambda who: sum(resource.getrusage(who)[:2])
times, main_cpu, worker_cpu = {1: [], 2: []}, {1: [], 2: []}, {1: [], 2: []}
for _ in range(runs):                   # 1 and 2 workers alternate: load hits both alike
    for workers in (1, 2):
        t, m, c = time.perf_counter(), cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
        preprocess(path, path + f".w{workers}", "SentencePieceTokenizer", model, append_eod=True,
                   workers=workers, log_interval=0)
        times[workers].append(time.perf_counter() - t)
        main_cpu[workers].append(cpu(resource.RUSAGE_SELF) - m)
        worker_cpu[workers].append(cpu(resource.RUSAGE_CHILDREN) - c)
print(json.dumps({"torch_loaded": "torch" in sys.modules, "wall": times, "main": main_cpu,
                  "workers": worker_cpu}))
"""


def bench_preprocess(d, mb, runs):
    """MB/s with 1 and 2 workers, in a fresh interpreter as tools/preprocess_data.py runs (this
    process has torch loaded by megatron-core, which preprocessing itself never imports)."""
    rng = np.random.default_rng(0)
    words = np.array(open(__file__).read().split())
    path, size = os.path.join(d, "bench.jsonl"), 0
    with open(path, "w") as f:
        while size < mb * 1e6:
            line = json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(50, 400))))})
            f.write(line + "\n")
            size += len(line) + 1
    model = train_sentencepiece([" ".join(rng.choice(words, 200)) for _ in range(2000)],
                                os.path.join(d, "sp"), 1000)
    out = subprocess.run([sys.executable, "-c", PREPROCESS_RUNS, path, model, str(runs)],
                         capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    med = {k: {w: statistics.median(res[k][str(w)]) for w in (1, 2)}
           for k in ("wall", "main", "workers")}
    rates = {w: size / med["wall"][w] / 1e6 for w in (1, 2)}
    for workers in (1, 2):
        row(f"preprocess MB/s, {workers} worker(s)", rates[workers], None, "MB/s", True)
    print(f"{'preprocess MB/s, 2 workers / 1 worker':<40} {rates[2] / rates[1]:>12.2f}"
          f"{'':>14}(torch loaded there: {res['torch_loaded']})")
    # CPU seconds, which machine load does not inflate as it does wall time: with two free cores
    # the 2-worker run (the main process and one pool worker, both tokenizing) cannot beat
    # max(all its CPU / 2, the main process's CPU, the pool worker's CPU).
    one, main, workers = med["main"][1], med["main"][2], med["workers"][2]
    print(f"{'preprocess CPU s: 1 worker | 2: main, pool':<40} {one:>12.3f} {main:>12.3f}"
          f"  {workers:.3f}")
    bound = one / max((main + workers) / 2, main, workers)
    print(f"{'preprocess 2/1 bound from CPU, 2 cores':<40} {bound:>12.2f}")


def bench_reads(d, runs, n_docs=200_000, n_reads=200_000):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 1000, n_docs)
    b = IndexedDatasetBuilder(os.path.join(d, "r.bin"), np.uint16)
    b.add_documents(rng.integers(0, 60000, int(lengths.sum())), lengths)
    b.finalize(os.path.join(d, "r.idx"))
    ours = IndexedDataset(os.path.join(d, "r"))
    idx = rng.integers(0, n_docs, n_reads).tolist()
    theirs = McIndexedDataset(os.path.join(d, "r")) if mc_gpt is not None else None
    t_ours, t_mc = paired_times(lambda: [ours[i] for i in idx],
                                (lambda: [theirs[i] for i in idx]) if theirs else None, runs)
    row("random item reads/s (x1000)", n_reads / t_ours / 1e3,
        n_reads / t_mc / 1e3 if t_mc else None, "k/s", True)


def mc_build(lengths, documents, num_samples, seq, seed):
    """megatron-core's own index pipeline (its functions and compiled helper)."""
    tokens = int(lengths[documents].sum())
    epochs = mc_gpt.GPTDataset._get_num_epochs(
        type("C", (), {"num_samples": num_samples,
                       "config": type("X", (), {"sequence_length": seq,
                                                "add_extra_token_to_sequence": True})})(), tokens)
    sans = ((epochs - 1) * tokens - 1) // seq
    separate = epochs > 1 and num_samples - sans < int(0.8 * ((tokens - 1) // seq))
    rs = np.random.RandomState(seed)
    doc = mc_gpt._build_document_index(documents, epochs, rs, separate)
    sample = mc_helpers.build_sample_idx(lengths, doc, seq, epochs, tokens, True, True)
    mc_gpt._build_shuffle_index(sans if separate else sample.shape[0] - 1,
                                sample.shape[0] - 1, rs)


def bench_gpt_index(runs):
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 2000, 100_000).astype(np.int32)    # ~100M tokens per epoch
    documents = np.arange(len(lengths), dtype=np.int32)
    for num_samples in (1_000_000, 10_000_000):
        seq = 1024
        ours, theirs = paired_times(
            lambda: build_gpt_indices(lengths, documents, num_samples, seq, 1),
            (lambda: mc_build(lengths, documents, num_samples, seq, 1)) if mc_gpt else None, runs)
        row(f"GPT index build, {num_samples // 1_000_000}M samples (s)", ours, theirs, "s", False)


def bench_blend(runs, size=1_000_000):
    """Blending indices for 3 datasets (0.5, 0.3, 0.2) and 50 (seeded weights in [0.05, 1.05])."""
    for n, w in ((3, np.array([0.5, 0.3, 0.2])),
                 (50, np.random.default_rng(50).random(50) + 0.05)):
        w = w / w.sum()

        def mc():
            mc_helpers.build_blending_indices(np.zeros(size, np.int16), np.zeros(size, np.int64),
                                              w, n, size, False)
        ours, theirs = paired_times(lambda: build_blending_indices(w.tolist(), size),
                                    mc if mc_gpt is not None else None, max(runs, 7))
        row(f"blending indices, {n} datasets, 1M (s)", ours, theirs, "s", False)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--mb", type=float, default=8, help="size of the preprocessing corpus")
    p.add_argument("--only", nargs="+", choices=["preprocess", "reads", "gpt", "blend"],
                   default=["preprocess", "reads", "gpt", "blend"], help="rows to run")
    args = p.parse_args()
    print(f"{'':<40} {'ours':>12} {'mcore':>12}  unit       ratio (>1: ours faster)")
    with tempfile.TemporaryDirectory() as d:
        if "preprocess" in args.only:
            bench_preprocess(d, args.mb, args.runs)
        if "reads" in args.only:
            bench_reads(d, args.runs)
    if "gpt" in args.only:
        bench_gpt_index(args.runs)
    if "blend" in args.only:
        bench_blend(args.runs)


if __name__ == "__main__":
    main()
