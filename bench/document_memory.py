#!/usr/bin/env python
"""Packed documents under the ring, through pretrain_gpt.py: peak RSS and step time (issue 33).

One training step of a 1-layer GQA model (8 heads, 2 kv heads, hidden 256) at
--context-parallel-size 2 under torchrun (2 gloo ranks on this CPU, one thread each), on a
Megatron .bin/.idx corpus of "real-looking" text: Zipf-distributed token ids in documents of
log-normal length (median ~70 tokens, so hundreds of documents per row, some long ones), each
ending in the NullTokenizer's eod. Per length (--seq), two runs:

    plain       no document flags
    documents   --reset-attention-mask --reset-position-ids --eod-mask-loss

Peak RSS: the largest ru_maxrss among the launch's processes (RUSAGE_CHILDREN of a fresh
process per run: torchrun and its two ranks), MiB. Time: wall time of the launch (start-up,
data indices and the one step included, the same for both flag sets) and pretrain_gpt's own
"elapsed time per iteration". --root runs another checkout (a worktree of an older commit) for
a before/after table (links root/megatron_sp/models and /data to root's folders, so that
PYTHONPATH=root imports that checkout whole, not this one's editable models). Prints a table and the documents/plain ratios; --json appends it.

    python bench/document_memory.py --seq 32768 65536
    python bench/document_memory.py --seq 32768 --root /tmp/before
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

VOCAB = 1024        # small, so that the logits do not hide attention memory
MODEL = ["--num-layers", "1", "--hidden-size", "256", "--num-attention-heads", "8",
         "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "512",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--attention-dropout", "0", "--hidden-dropout", "0"]
DOCS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]

_RUN = """
import resource, subprocess, sys, time
t = time.perf_counter()
p = subprocess.run(sys.argv[1:], capture_output=True, text=True)
wall = time.perf_counter() - t
print(p.stdout[-4000:]); print(p.stderr[-4000:], file=sys.stderr)
print("@@", p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, wall)
"""


def write_corpus(prefix: str, tokens: int, seed: int = 0) -> int:
    """A .bin/.idx corpus of about `tokens` tokens; returns the number of documents."""
    from data.indexed_dataset import IndexedDatasetBuilder
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    total = docs = 0
    while total < tokens:
        n = int(min(8000, max(2, rng.lognormal(np.log(70), 1.0))))
        body = np.minimum(rng.zipf(1.2, n - 1), VOCAB - 1).astype(np.int32)
        builder.add_document(np.append(body, VOCAB), [n])          # eod = VOCAB (NullTokenizer)
        total, docs = total + n, docs + 1
    builder.finalize(prefix + ".idx")
    return docs


def importable(root: str) -> None:
    """Make `root`'s megatron_sp.models / megatron_sp.data importable from PYTHONPATH=root (the
    editable install maps them to THIS checkout's folders): links inside root's megatron_sp."""
    for name in ("models", "data"):
        link = os.path.join(root, "megatron_sp", name)
        if not os.path.exists(link):
            os.symlink(os.path.join("..", name), link)


def launch(root: str, prefix: str, seq: int, documents: bool, save: str) -> dict:
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(29500 + (os.getpid() + seq + documents) % 2000),
            os.path.join(root, "pretrain_gpt.py"), *MODEL,
            "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
            "--lr", "1e-4", "--context-parallel-size", "2", "--data-path", prefix,
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--split", "100,0,0",
            "--eval-iters", "0", "--log-interval", "1", "--save", save, "--save-interval", "100",
            "--distributed-backend", "gloo"] + (DOCS if documents else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    p = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True,
                       env=env, cwd=root)
    tail = p.stdout.strip().splitlines()[-1].split()
    rc, rss_kib, wall = int(tail[1]), int(tail[2]), float(tail[3])
    if rc != 0:
        raise SystemExit(f"the launch failed ({rc}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    step = re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", p.stdout)
    return {"peak_rss_mib": rss_kib / 1024, "wall_s": wall,
            "step_s": float(step[-1]) / 1000 if step else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--root", default=HERE, help="the checkout whose pretrain_gpt.py runs")
    ap.add_argument("--label", default="this checkout", help="the rows' code label")
    ap.add_argument("--no-save", action="store_true", help="print only")
    args = ap.parse_args()
    if os.path.abspath(args.root) != HERE:
        importable(args.root)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "corpus_text_document")
        docs = write_corpus(prefix, 4 * max(args.seq))
        print(f"corpus: {docs} documents, {4 * max(args.seq)} tokens; root {args.root}")
        print(f"{'seq':>7} {'run':>10} {'peak RSS MiB':>13} {'step s':>8} {'launch s':>9}")
        for seq in args.seq:
            got = {}
            for documents in (False, True):
                name = "documents" if documents else "plain"
                got[name] = launch(args.root, prefix, seq, documents,
                                   os.path.join(tmp, f"ckpt_{seq}_{name}"))
                r = got[name]
                step = f"{r['step_s']:.1f}" if r["step_s"] is not None else "-"
                print(f"{seq:>7} {name:>10} {r['peak_rss_mib']:>13.0f} {step:>8} "
                      f"{r['wall_s']:>9.1f}", flush=True)
            ratio = {k: got["documents"][k] / got["plain"][k]
                     for k in ("peak_rss_mib", "wall_s", "step_s") if got["plain"][k]}
            print(f"{seq:>7} {'ratio':>10} {ratio['peak_rss_mib']:>13.2f} "
                  f"{ratio.get('step_s', float('nan')):>8.2f} {ratio['wall_s']:>9.2f}")
            rows.append({"seq": seq, **got, "documents_over_plain": ratio})
    if not args.no_save:
        save(rows, args.label)


def save(rows: list[dict], label: str) -> None:
    """Flat rows under `label` into bench/results/document_memory_cpu.json, other labels kept."""
    sys.path.insert(0, os.path.join(HERE, "bench"))
    from performance_table import RESULTS, write_results
    path = os.path.join(RESULTS, "document_memory_cpu.json")
    kept = [r for r in json.load(open(path))["rows"] if r["code"] != label] \
        if os.path.exists(path) else []
    flat = []
    for row in rows:
        for run in ("plain", "documents"):
            flat.append({"code": label, "seq": row["seq"], "run": run,
                         "peak_rss_mib": round(row[run]["peak_rss_mib"]),
                         "step_s": row[run]["step_s"], "launch_s": round(row[run]["wall_s"], 1)})
        ratio = row["documents_over_plain"]
        flat.append({"code": label, "seq": row["seq"], "run": "documents / plain",
                     "peak_rss_mib": round(ratio["peak_rss_mib"], 2),
                     "step_s": round(ratio["step_s"], 2) if "step_s" in ratio else None,
                     "launch_s": round(ratio["wall_s"], 2)})
    write_results("document_memory_cpu", "document_memory", kept + flat,
                  title="Packed documents under the ring through pretrain_gpt.py (cp 2, 1 layer, "
                        "GQA 8/2, hidden 256, one step)",
                  columns=[("code", "code"), ("seq", "seq"), ("run", "run"),
                           ("peak_rss_mib", "peak RSS MiB (max over processes)"),
                           ("step_s", "step s"), ("launch_s", "launch s")],
                  notes=["documents: --reset-attention-mask --reset-position-ids --eod-mask-loss "
                         "on a corpus of ~70-token documents (hundreds per row); plain: no "
                         "document flags, same corpus",
                         "2 gloo ranks on a 2-core CPU, one thread each; step s: pretrain_gpt's "
                         "elapsed time per iteration (the first and only step)"],
                  command="python bench/document_memory.py --seq 32768 65536 --label ...")


if __name__ == "__main__":
    main()
