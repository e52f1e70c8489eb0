"""jsonl -> Megatron .bin/.idx, the core of tools/preprocess_data.py (importable without tools/)."""
import collections
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from itertools import chain

import numpy as np

from .indexed_dataset import DataError, IndexedDatasetBuilder, optimal_dtype
from .tokenizers import build_tokenizer

BLOCK_BYTES = 1 << 19              # most input bytes per task (whole lines, ~20 ms of tokenizing)
MIN_BLOCK_BYTES = 1 << 16          # least, for small inputs: every worker gets several tasks
POOL_AHEAD_PER_WORKER = 2          # tasks given to the pool ahead of its results, per worker
IN_FLIGHT_PER_WORKER = 4           # results held before they are written, per worker
SPILL_FILE_BYTES = 1 << 28         # a pool worker starts a new spill file after this many bytes
PROGRESS_DELAY_S = 3.0             # the progress bar appears once a run has taken this long
DTYPES = {"uint16": np.uint16, "int32": np.int32}
_worker = {}


def _init_worker(tokenizer, json_keys, append_eod, path, dtype=None, spill=None):
    """The per-process state of encode_range. Called in the parent before the pool forks, so the
    workers inherit the tokenizer instead of each loading it again. `spill`: the folder where
    pool workers write their tokens (the parent then copies bytes instead of unpickling arrays)."""
    _worker.update(tok=tokenizer, keys=json_keys, eod=append_eod, path=path, fd=None,
                   dtype=None if dtype is None else np.dtype(dtype), spill=spill, out={})


def _tokenize_all(tok, texts, lines, path):
    """Token ids of every text; a text the tokenizer refuses (e.g. NullTokenizer text that is not
    integers) is reported with its file:line."""
    batch = getattr(tok, "tokenize_batch", None)
    try:
        return batch(texts) if batch is not None else [tok.tokenize(t) for t in texts]
    except ValueError:
        for text, n in zip(texts, lines):
            try:
                tok.tokenize(text)
            except ValueError as e:
                raise DataError(f"{path}:{n}: {e}; fix that line or pick the right "
                                f"--tokenizer-type.") from None
        raise


def _check_ids(tokens, lengths, lines, vocab_size, path):
    """Refuse ids outside [0, vocab_size) with the file:line of the first one (min/max per task)."""
    if not tokens.size or (tokens.min() >= 0 and tokens.max() < vocab_size):
        return
    at = int(np.flatnonzero((tokens < 0) | (tokens >= vocab_size))[0])
    doc = int(np.searchsorted(np.cumsum(lengths), at, side="right"))
    raise DataError(f"{path}:{lines[doc]}: token id {int(tokens[at])} is outside the tokenizer's "
                    f"vocabulary of {vocab_size} ids; fix the text or pass the right --vocab-size "
                    f"or tokenizer.")


def _read_block(offset, length):
    """Bytes [offset, offset + length) of the input, read by the process that encodes them: a
    pool's parent sends only the range, no text goes through the pool's pipes."""
    if _worker.get("fd") is None:
        _worker["fd"] = os.open(_worker["path"], os.O_RDONLY)
    return os.pread(_worker["fd"], length, offset)


def encode_lines(task):
    """(first line number, one bytes block of whole lines) -> (n_bytes, {key: (tokens,
    per-document lengths)}).

    The texts of a task are tokenized in one call, in line order; an unreadable line is reported
    after the texts before it (so the first error in file order is the one raised).
    """
    first, block = task
    n_bytes, lines = len(block), block.split(b"\n")
    tok, keys, path = _worker["tok"], _worker["keys"], _worker["path"]
    texts, numbers, problem = [], [], None
    for n, raw in enumerate(lines, first):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError as e:
            problem = DataError(f"{path}:{n}: not valid JSON ({e}); fix or remove that line.")
            break
        for key in keys:
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                problem = DataError(f"{path}:{n}: no string field {key!r}; check --json-keys or "
                                    f"fix that line.")
                break
            texts.append(record[key])
        if problem is not None:
            break
        numbers.append(n)
    texts = texts[:len(numbers) * len(keys)]                # whole records only
    ids = _tokenize_all(tok, texts, [n for n in numbers for _ in keys], path)
    eod = tok.eod if _worker["eod"] else None
    packed = {}
    for k, key in enumerate(keys):
        docs = ids[k::len(keys)]
        lengths = np.fromiter(map(len, docs), np.int64, len(docs))
        if eod is not None:
            lengths += lengths > 0                          # eod after every non-empty text
            docs = [d for doc in docs for d in (doc, (eod,)) if doc]
        tokens = np.fromiter(chain.from_iterable(docs), np.int64, int(lengths.sum()))
        _check_ids(tokens, lengths, numbers, tok.vocab_size, path)
        packed[key] = (_narrow(tokens, _worker.get("dtype")), lengths)
    if problem is not None:         # after the lines before it: the first error in file order
        raise problem
    return n_bytes, packed


def _ranges(size, block_bytes):
    """Byte ranges [start, stop) covering the input, one per task: each task takes the whole lines
    that begin in its range (`_aligned_block`), so a pool's parent reads no text."""
    return [(start, min(start + block_bytes, size)) for start in range(0, size, block_bytes)]


def _line_start(pos):
    """The first offset >= pos at which a line begins (0, or just after a newline), or the size."""
    if pos == 0:
        return 0
    at, chunk = pos - 1, 1 << 13
    while True:
        data = _read_block(at, chunk)
        if not data:
            return at
        found = data.find(b"\n")
        if found >= 0:
            return at + found + 1
        at += len(data)


def _aligned_block(start, stop):
    """(offset, bytes) of the whole lines that begin in [start, stop) of the input."""
    begin, end = _line_start(start), _line_start(stop)
    return begin, (_read_block(begin, end - begin) if begin < end else b"")


def _line_number(offset):
    """1 + the newlines before `offset` (only for error messages: reads the input up to there)."""
    count, at = 1, 0
    while at < offset:
        data = _read_block(at, min(1 << 22, offset - at))
        count += data.count(b"\n")
        at += len(data)
    return count


def _spill(key, tokens):
    """Append `tokens` to this worker's current file for `key`; returns (path, offset, bytes).

    A worker starts a new file every SPILL_FILE_BYTES, so the parent can delete the files it has
    copied (`_SpillFiles`) and the extra disk stays ~ workers x SPILL_FILE_BYTES, not a second copy
    of the output.
    """
    out = _worker["out"]
    if key not in out or out[key][2] >= SPILL_FILE_BYTES:
        number = out[key][3] + 1 if key in out else 0
        if key in out:
            os.close(out[key][1])
        writer = list(_worker["keys"]).index(key)
        path = os.path.join(_worker["spill"], f"{writer}.{os.getpid()}.{number}")
        out[key] = [path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), 0, number]
    path, fd, offset, _ = out[key]
    data = memoryview(np.ascontiguousarray(tokens)).cast("B")
    written = 0
    while written < len(data):
        written += os.write(fd, data[written:])
    out[key][2] = offset + len(data)
    return path, offset, len(data)


class _SpillFiles:
    """The parent's side: a worker's spill files are used in task order, so once a result comes
    from a worker's next file, its previous file has been copied in full and is deleted."""

    def __init__(self):
        self.current = {}               # "{key index}.{pid}" -> the file last read from

    def copied(self, path):
        writer = path.rsplit(".", 1)[0]
        previous = self.current.get(writer)
        if previous is not None and previous != path:
            os.remove(previous)
        self.current[writer] = path


def encode_range(task, spill=True):
    """One task: encode the lines that begin in the byte range `task`; returns (n_bytes, {key:
    (tokens, lengths)}), in a pool worker (`spill`) with the tokens written to its spill file
    instead: {key: ((path, offset, bytes), lengths)}.

    Line numbers count from the block (nobody counted the lines before it); an error is encoded
    again with the block's line number in the file, so the message names the file's line.
    """
    begin, block = _aligned_block(*task)
    try:
        n_bytes, packed = encode_lines((1, block))
    except DataError:
        encode_lines((_line_number(begin), block))      # raises it with the file's numbers
        raise
    if _worker["spill"] is None or not spill:
        return n_bytes, packed
    return n_bytes, {key: (_spill(key, tokens), lengths) for key, (tokens, lengths) in packed.items()}


def _narrow(tokens, dtype):
    """The tokens in the output dtype when they fit (less to send back); else left for the
    builder to report."""
    if dtype is None or not tokens.size:
        return tokens
    info = np.iinfo(dtype)
    if tokens.min() < info.min or tokens.max() > info.max:
        return tokens
    return tokens.astype(dtype)


def _block_bytes(size, workers):
    """Bytes per task: large blocks keep the parent's per-task work (pipes, threads) small; small
    inputs get smaller ones so that the workers finish together (16 tasks per worker at least)."""
    return int(min(BLOCK_BYTES, max(MIN_BLOCK_BYTES, size // (16 * max(1, workers)))))


def _output_dtype(dtype, vocab_size):
    """--dtype (uint16 / int32) or Megatron's default for the vocabulary."""
    if dtype is None:
        return np.dtype(optimal_dtype(vocab_size))
    if str(dtype) not in DTYPES:
        raise DataError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}; pick one of them.")
    dtype = np.dtype(DTYPES[str(dtype)])
    if vocab_size > np.iinfo(dtype).max + 1:
        raise DataError(f"--dtype {dtype.name} holds ids up to {np.iinfo(dtype).max} but the "
                        f"tokenizer has {vocab_size} ids; pass --dtype int32.")
    return dtype


def preprocess(input, output_prefix, tokenizer_type, tokenizer_model=None, json_keys=("text",),
               append_eod=False, workers=1, log_interval=10000, vocab_size=None, log=sys.stderr,
               dtype=None, vocab_file=None, merge_file=None):
    """Tokenise a jsonl file into {output_prefix}_{key}_document.bin/.idx; returns the prefixes.

    `workers` processes tokenize: this one and a pool of workers - 1 (forked, so they inherit the
    tokenizer). This process writes the output in input order and encodes a task itself whenever
    the oldest pool result is not ready yet, so with 2 workers no core waits on the other.

    Nothing appears under the final names unless the whole file was processed; ids outside the
    vocabulary are refused. Ends with one line: documents, tokens and MB/s (when log_interval).
    """
    start = time.time()
    if not os.path.isfile(input):
        raise DataError(f"{input}: input file not found; pass --input with a jsonl file.")
    folder = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(folder):
        raise DataError(f"the output folder {folder} does not exist; create it (mkdir -p) or pass "
                        f"another --output-prefix.")
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model, vocab_size, vocab_file, merge_file)
    dtype = _output_dtype(dtype, tokenizer.vocab_size)
    prefixes = {k: f"{output_prefix}_{k}_document" for k in json_keys}
    builders = {k: IndexedDatasetBuilder(p + ".bin", dtype) for k, p in prefixes.items()}
    spill = tempfile.mkdtemp(prefix=".preprocess-", dir=folder) if workers > 1 else None
    _init_worker(tokenizer, tuple(json_keys), append_eod, input, dtype, spill)   # inherited
    pool = mp.get_context("fork").Pool(workers - 1) if workers > 1 else None
    interrupted = False
    try:
        size = os.path.getsize(input)
        tasks = _ranges(size, _block_bytes(size, workers))
        results = (map(encode_range, tasks) if pool is None else
                   _in_order(pool, tasks, POOL_AHEAD_PER_WORKER * (workers - 1),
                             IN_FLIGHT_PER_WORKER * workers))
        docs, tokens, nbytes = _consume(results, builders, log_interval, log, size)
        for k, b in builders.items():
            b.finalize(prefixes[k] + ".idx")
    except BaseException as err:
        interrupted = not isinstance(err, Exception)
        for b in builders.values():
            b.abort()
        raise
    finally:
        if pool is not None:    # waits for the few tasks in flight: terminating a worker while it
            if interrupted:     # writes its result would leave the result pipe's lock taken
                pool.terminate()
            else:
                pool.close()
                pool.join()
        if _worker.get("fd") is not None:
            os.close(_worker["fd"])
        _worker.clear()
        if spill is not None:
            shutil.rmtree(spill, ignore_errors=True)
    if log_interval:
        dt = max(time.time() - start, 1e-9)
        print(f"done: {docs} documents, {tokens} tokens, {nbytes / 1e6:.1f} MB in {dt:.1f} s "
              f"({nbytes / dt / 1e6:.2f} MB/s, {workers} worker(s))", file=log, flush=True)
    return prefixes


def _in_order(pool, tasks, pool_ahead, in_flight):
    """encode_range of each task, results in task order; at most pool_ahead tasks given to the
    pool and in_flight results held (a stop after an error waits for those few, never for the
    whole file).

    The pool gets tasks in order, a few per worker (one running, one queued: the last pool task
    ends soon after this process's last one). While the oldest pool result is not ready, this
    process takes the next task and encodes it here, so the writer never idles while the pool is
    behind, and with many workers it mostly writes. A task encoded here keeps its error until its
    turn, so the first error in file order is still the one raised.
    """
    pending, tasks, pooled = collections.deque(), iter(tasks), 0
    while True:
        while pooled < pool_ahead and len(pending) < in_flight and (
                task := next(tasks, None)) is not None:
            pending.append(pool.apply_async(encode_range, (task,)))
            pooled += 1
        if not pending:
            return
        if (not pending[0].ready() and len(pending) < in_flight
                and (task := next(tasks, None)) is not None):
            pending.append(_EncodedHere(task))      # after every task already given to the pool
            continue
        result = pending.popleft()
        pooled -= not isinstance(result, _EncodedHere)
        yield result.get()


class _EncodedHere:
    """A task encoded in this process (its tokens stay in memory, no spill file), with the
    AsyncResult methods _in_order uses; an error is kept and raised by get(), at the task's turn."""

    def __init__(self, task):
        self._value, self._error = None, None
        try:
            self._value = encode_range(task, spill=False)
        except Exception as err:        # noqa: BLE001 - re-raised by get(), in file order
            self._error = err

    def ready(self):
        return True

    def get(self):
        if self._error is not None:
            raise self._error
        return self._value


def _progress(total, log, enabled):
    """A tqdm bar over the input bytes, shown on a terminal once the run takes a few seconds."""
    if not enabled or not getattr(log, "isatty", lambda: False)():
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, file=log, delay=PROGRESS_DELAY_S,
                desc="preprocessing")


def _consume(results, builders, log_interval, log, total_bytes=None):
    """Write encoded chunks in order, reporting documents/s and MB/s (a progress bar on a
    terminal, lines every log_interval documents otherwise); returns (documents, tokens, bytes)."""
    start, docs, tokens, nbytes, next_log = time.time(), 0, 0, 0, log_interval
    spilled = _SpillFiles()
    bar = _progress(total_bytes, log, bool(log_interval))
    try:
        for size, packed in results:
            nbytes += size
            for key, (ids, lengths) in packed.items():
                if isinstance(ids, tuple):          # (file, offset, bytes) a worker spilled
                    tokens += builders[key].add_documents_from(lengths, *ids)
                    spilled.copied(ids[0])
                else:
                    builders[key].add_documents(ids, lengths)
                    tokens += ids.size
            docs += len(next(iter(packed.values()))[1])
            if bar is not None:
                bar.update(size)
            elif log_interval and docs >= next_log:
                next_log += log_interval
                dt = max(time.time() - start, 1e-9)
                print(f"processed {docs} documents ({docs / dt:.0f} docs/s, "
                      f"{nbytes / dt / 1e6:.2f} MB/s)", file=log, flush=True)
    finally:
        if bar is not None:
            bar.close()
    return docs, tokens, nbytes
