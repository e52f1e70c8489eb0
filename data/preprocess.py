"""jsonl -> Megatron .bin/.idx, the core of tools/preprocess_data.py (importable without tools/)."""
import json
import multiprocessing as mp
import os
import sys
import time
from itertools import chain

import numpy as np

from .indexed_dataset import IndexedDatasetBuilder, optimal_dtype
from .tokenizers import build_tokenizer

LINES_PER_TASK = 256               # kept for compatibility; tasks are now blocks of whole lines
BLOCK_BYTES = 1 << 18              # input bytes per task (whole lines, ~10 ms of tokenizing)
_worker = {}


def _init_worker(tokenizer_args, json_keys, append_eod, path, dtype=None):
    _worker.update(tok=build_tokenizer(*tokenizer_args), keys=json_keys, eod=append_eod, path=path,
                   dtype=None if dtype is None else np.dtype(dtype))


def _tokenize_all(tok, texts):
    batch = getattr(tok, "tokenize_batch", None)
    return batch(texts) if batch is not None else [tok.tokenize(t) for t in texts]


def encode_lines(task):
    """(first line number, raw lines as a list or one bytes block of whole lines) ->
    (n_bytes, {key: (tokens, per-document lengths)}).

    The texts of a task are tokenized in one call, in line order; an unreadable line is reported
    after the texts before it (so the first error in file order is the one raised).
    """
    first, lines = task
    if isinstance(lines, (bytes, bytearray)):
        n_bytes, lines = len(lines), lines.split(b"\n")
    else:
        n_bytes = sum(len(r) for r in lines)
    tok, keys, path = _worker["tok"], _worker["keys"], _worker["path"]
    texts, problem = [], None
    for n, raw in enumerate(lines, first):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError as e:
            problem = ValueError(f"{path}:{n}: not valid JSON ({e}); fix or remove that line.")
            break
        for key in keys:
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                problem = ValueError(f"{path}:{n}: no string field {key!r}; check --json-keys or "
                                     f"fix that line.")
                break
            texts.append(record[key])
        if problem is not None:
            break
    ids = _tokenize_all(tok, texts)
    if problem is not None:
        raise problem
    eod = tok.eod if _worker["eod"] else None
    packed = {}
    for k, key in enumerate(keys):
        docs = ids[k::len(keys)]
        lengths = np.fromiter(map(len, docs), np.int64, len(docs))
        if eod is not None:
            lengths += lengths > 0                          # eod after every non-empty text
            docs = [d for doc in docs for d in (doc, (eod,)) if doc]
        tokens = np.fromiter(chain.from_iterable(docs), np.int64, int(lengths.sum()))
        packed[key] = (_narrow(tokens, _worker.get("dtype")), lengths)
    return n_bytes, packed


def _narrow(tokens, dtype):
    """The tokens in the output dtype when they fit (less to send back); else left for the
    builder to report."""
    if dtype is None or not tokens.size:
        return tokens
    info = np.iinfo(dtype)
    if tokens.min() < info.min or tokens.max() > info.max:
        return tokens
    return tokens.astype(dtype)


def _tasks(path):
    """Blocks of whole lines (bytes) with the number of their first line, numbered from 1."""
    with open(path, "rb") as f:
        first = 1
        while True:
            block = f.read(BLOCK_BYTES)
            if not block:
                return
            if not block.endswith(b"\n"):
                block += f.readline()
            yield first, block
            first += block.count(b"\n")


def preprocess(input, output_prefix, tokenizer_type, tokenizer_model=None, json_keys=("text",),
               append_eod=False, workers=1, log_interval=10000, vocab_size=None, log=sys.stderr,
               vocab_file=None, merge_file=None):
    """Tokenise a jsonl file into {output_prefix}_{key}_document.bin/.idx; returns the prefixes.

    Nothing appears under the final names unless the whole file was processed.
    """
    if not os.path.isfile(input):
        raise ValueError(f"{input}: input file not found; pass --input with a jsonl file.")
    args = (tokenizer_type, tokenizer_model, vocab_size, vocab_file, merge_file)
    dtype = optimal_dtype(build_tokenizer(*args).vocab_size)
    prefixes = {k: f"{output_prefix}_{k}_document" for k in json_keys}
    builders = {k: IndexedDatasetBuilder(p + ".bin", dtype) for k, p in prefixes.items()}
    init = (args, tuple(json_keys), append_eod, input, dtype)
    pool = mp.get_context("fork").Pool(workers, _init_worker, init) if workers > 1 else None
    try:
        if pool is None:
            _init_worker(*init)
            results = map(encode_lines, _tasks(input))
        else:
            results = pool.imap(encode_lines, _tasks(input), chunksize=1)
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

