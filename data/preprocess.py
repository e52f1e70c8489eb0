"""jsonl -> Megatron .bin/.idx, the core of tools/preprocess_data.py (importable without tools/)."""
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np

from .indexed_dataset import IndexedDatasetBuilder, optimal_dtype
from .tokenizers import build_tokenizer

LINES_PER_TASK = 256
_worker = {}


def _init_worker(tokenizer_args, json_keys, append_eod, path):
    _worker.update(tok=build_tokenizer(*tokenizer_args), keys=json_keys, eod=append_eod, path=path)


def encode_lines(task):
    """(first line number, raw lines) -> (n_bytes, {key: (tokens, per-document lengths)})."""
    first, lines = task
    tok, keys, path = _worker["tok"], _worker["keys"], _worker["path"]
    out = {k: ([], []) for k in keys}
    for n, raw in enumerate(lines, first):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e}); fix or remove that line.") from None
        for key in keys:
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise ValueError(f"{path}:{n}: no string field {key!r}; check --json-keys or fix "
                                 f"that line.")
            ids = tok.tokenize(record[key])
            if ids and _worker["eod"]:
                ids = list(ids) + [tok.eod]
            out[key][0].append(np.asarray(ids, np.int64))
            out[key][1].append(len(ids))
    packed = {k: (np.concatenate(t) if t else np.zeros(0, np.int64), np.asarray(l, np.int64))
              for k, (t, l) in out.items()}
    return sum(len(r) for r in lines), packed


def _tasks(path):
    """Chunks of raw lines (bytes), numbered from 1."""
    with open(path, "rb") as f:
        chunk, first = [], 1
        for n, line in enumerate(f, 1):
            chunk.append(line)
            if len(chunk) == LINES_PER_TASK:
                yield first, chunk
                chunk, first = [], n + 1
        if chunk:
            yield first, chunk


def preprocess(input, output_prefix, tokenizer_type, tokenizer_model=None, json_keys=("text",),
               append_eod=False, workers=1, log_interval=10000, vocab_size=None, log=sys.stderr):
    """Tokenise a jsonl file into {output_prefix}_{key}_document.bin/.idx; returns the prefixes.

    Nothing appears under the final names unless the whole file was processed.
    """
    if not os.path.isfile(input):
        raise ValueError(f"{input}: input file not found; pass --input with a jsonl file.")
    args = (tokenizer_type, tokenizer_model, vocab_size)
    dtype = optimal_dtype(build_tokenizer(*args).vocab_size)
    prefixes = {k: f"{output_prefix}_{k}_document" for k in json_keys}
    builders = {k: IndexedDatasetBuilder(p + ".bin", dtype) for k, p in prefixes.items()}
    init = (args, tuple(json_keys), append_eod, input)
    pool = mp.get_context("fork").Pool(workers, _init_worker, init) if workers > 1 else None
    try:
        if pool is None:
            _init_worker(*init)
            results = map(encode_lines, _tasks(input))
        else:
            results = pool.imap(encode_lines, _tasks(input), chunksize=4)
        _consume(results, builders, log_interval, log)
        for k, b in builders.items():
            b.finalize(prefixes[k] + ".idx")
    except BaseException:
        for b in builders.values():
            b.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
    return prefixes


def _consume(results, builders, log_interval, log):
    """Write encoded chunks in order, reporting documents/s and MB/s."""
    start, docs, nbytes, next_log = time.time(), 0, 0, log_interval
    for size, packed in results:
        nbytes += size
        for key, (tokens, lengths) in packed.items():
            builders[key].add_documents(tokens, lengths)
        docs += len(next(iter(packed.values()))[1])
        if log_interval and docs >= next_log:
            next_log += log_interval
            dt = max(time.time() - start, 1e-9)
            print(f"processed {docs} documents ({docs / dt:.0f} docs/s, {nbytes / dt / 1e6:.2f} MB/s)",
                  file=log, flush=True)
    return docs, nbytes

