"""jsonl -> Megatron .bin/.idx, the core of tools/preprocess_data.py (importable without tools/)."""
import collections
import errno
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from itertools import chain

import numpy as np

from megatron_sp.errors import reraise_as

from . import preprocess_io as files
from .indexed_dataset import DataError, IndexedDatasetBuilder, optimal_dtype
from .tokenizers import build_tokenizer

BLOCK_BYTES = 1 << 19              # most input bytes per task (whole lines, ~20 ms of tokenizing)
MIN_BLOCK_BYTES = 1 << 16          # least, for small inputs: every worker gets several tasks
POOL_AHEAD_PER_WORKER = 2          # tasks given to the pool ahead of its results, per worker
IN_FLIGHT_PER_WORKER = 4           # results held before they are written, per worker
SPILL_FILE_BYTES = 1 << 28         # a pool worker starts a new spill file after this many bytes
PROGRESS_DELAY_S = 3.0             # the progress bar appears once a run has taken this long
# The longest line (one document) read, in bytes. A line is held whole while it is decoded and
# tokenized: up to ~30x its size in memory at the peak (its bytes, the str, the Python ints of its
# tokens, the array; 27x measured on a 100 MB line, 12x with NullTokenizer's short ids), so a
# 32 MiB line takes up to ~1 GB per worker. A longer one is refused with
# its file:line and --max-line-bytes (raise it when the memory is there); no line is ever read
# past the bound, so a file without newlines cannot exhaust the memory either.
MAX_LINE_BYTES = 32 << 20
DTYPES = {"uint16": np.uint16, "int32": np.int32}
_worker = {}


def _init_worker(tokenizer, json_keys, append_eod, path, dtype=None, spill=None, name=None,
                 max_line_bytes=MAX_LINE_BYTES):
    """The per-process state of encode_range. Called in the parent before the pool forks, so the
    workers inherit the tokenizer instead of each loading it again. `spill`: the folder where
    pool workers write their tokens (the parent then copies bytes instead of unpickling arrays).
    `path` is the file read, `name` the input as the messages name it (a decompressed copy is
    read under the name of the compressed file)."""
    _worker.update(tok=tokenizer, keys=json_keys, eod=append_eod, path=path, fd=None,
                   dtype=None if dtype is None else np.dtype(dtype), spill=spill, out={},
                   name=name or path, max_line=max_line_bytes or None)


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
    tok, keys, path = _worker["tok"], _worker["keys"], _worker["name"]
    texts, numbers, problem = [], [], None
    for n, raw in enumerate(lines, first):
        if _worker["max_line"] is not None and len(raw) > _worker["max_line"]:
            problem = _too_long(n, len(raw))
            break
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


def _line_start(pos, limit=None):
    """The first offset >= pos at which a line begins (0, or just after a newline), or the size;
    None when none does within `limit` bytes of pos (a line longer than that covers pos)."""
    if pos == 0:
        return 0
    at, chunk = pos - 1, 1 << 13
    while True:
        if limit is not None and at - pos > limit:
            return None
        data = _read_block(at, chunk)
        if not data:
            return at
        found = data.find(b"\n")
        if found >= 0:
            return at + found + 1
        at += len(data)


def _too_long(line, size=None):
    """The error of a line over the bound (`size` when it was read)."""
    bound, what = _worker["max_line"], "" if size is None else f"{size} bytes, "
    return DataError(f"{_worker['name']}:{line}: the line is {what}longer than the bound of "
                     f"{bound} bytes (--max-line-bytes); split that document or raise "
                     f"--max-line-bytes (a line takes ~30x its size in memory while tokenized).")


def _aligned_block(start, stop):
    """(offset, bytes) of the whole lines that begin in [start, stop) of the input.

    Never reads a line longer than the bound (`max_line`): a range inside such a line has no
    line of its own (begins and ends are searched no further than the bound plus the range), and
    the range the line begins in raises its file:line."""
    limit = None if _worker["max_line"] is None else _worker["max_line"] + (stop - start)
    begin = _line_start(start, limit)
    if begin is None:                   # inside a too-long line that began before start
        return start, b""
    end = _line_start(stop, limit)
    if end is None:                     # the last line beginning here is too long
        head = _read_block(begin, stop - begin)
        last = begin + head.rfind(b"\n") + 1
        raise _too_long(_line_number(last))
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
               dtype=None, vocab_file=None, merge_file=None, max_line_bytes=MAX_LINE_BYTES,
               trust_remote_code=False):
    """Tokenise a jsonl file into {output_prefix}_{key}_document.bin/.idx; returns the prefixes.

    `workers` processes tokenize: this one and a pool of workers - 1 (forked, so they inherit the
    tokenizer). This process writes the output in input order and encodes a task itself whenever
    the oldest pool result is not ready yet, so with 2 workers no core waits on the other.

    Nothing appears under the final names unless the whole file was processed; ids outside the
    vocabulary, lines over `max_line_bytes` (MAX_LINE_BYTES; 0: no bound) and an input without a
    document are refused. A compressed input (gzip, bzip2, xz; zstd with the zstandard package)
    is decompressed into the temporary folder first. Every temporary file is removed on an error,
    on SIGTERM (then a DataError) and on Ctrl-C (KeyboardInterrupt), and the leftovers of a killed
    earlier run with this output prefix by the next run (preprocess_io.py). Ends with one line:
    documents, tokens and MB/s (when log_interval).
    """
    start = time.time()
    if max_line_bytes is not None and max_line_bytes < 0:
        raise DataError(f"--max-line-bytes {max_line_bytes} is negative; pass a number of bytes "
                        f"(0: no bound).")
    if not os.path.isfile(input):
        raise DataError(f"{input}: input file not found; pass --input with a jsonl file.")
    folder = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(folder):
        raise DataError(f"the output folder {folder} does not exist; create it (mkdir -p) or pass "
                        f"another --output-prefix.")
    with reraise_as(DataError, ValueError):
        tokenizer = build_tokenizer(tokenizer_type, tokenizer_model, vocab_size, vocab_file,
                                    merge_file, trust_remote_code=trust_remote_code)
    dtype = _output_dtype(dtype, tokenizer.vocab_size)
    prefixes = {k: f"{output_prefix}_{k}_document" for k in json_keys}
    nothing = f"nothing was written under {output_prefix}_* and the temporary files were removed"
    try:
        with files.stop_on_signals():
            files.remove_leftovers(output_prefix, json_keys, log)
            temp = files.temp_folder_name(output_prefix)
            try:
                files.make_temp_folder(temp)
                docs, tokens, nbytes = _preprocess_in(temp, input, prefixes, tokenizer, dtype,
                                                      append_eod, workers, log_interval, log,
                                                      max_line_bytes)
            finally:
                with files.signals_held():
                    shutil.rmtree(temp, ignore_errors=True)
    except files.Stopped as stop:
        raise DataError(f"preprocessing of {input} was {stop}; {nothing}.") from None
    except OSError as err:
        raise _os_error(err, output_prefix, nothing) from err
    if log_interval:
        dt = max(time.time() - start, 1e-9)
        print(f"done: {docs} documents, {tokens} tokens, {nbytes / 1e6:.1f} MB in {dt:.1f} s "
              f"({nbytes / dt / 1e6:.2f} MB/s, {workers} worker(s))", file=log, flush=True)
    return prefixes


def _preprocess_in(temp, input, prefixes, tokenizer, dtype, append_eod, workers, log_interval,
                   log, max_line_bytes):
    """preprocess with every file it writes in the folder `temp`; (documents, tokens, bytes)."""
    path = files.readable_input(input, temp, log)
    builders = {k: IndexedDatasetBuilder(p + ".bin", dtype, tmp_dir=temp)
                for k, p in prefixes.items()}
    _init_worker(tokenizer, tuple(prefixes), append_eod, path, dtype,
                 temp if workers > 1 else None, input, max_line_bytes)     # inherited
    pool = (mp.get_context("fork").Pool(workers - 1, initializer=files.quiet_worker)
            if workers > 1 else None)
    interrupted = False
    try:
        size = os.path.getsize(path)
        tasks = _ranges(size, _block_bytes(size, workers))
        results = (map(encode_range, tasks) if pool is None else
                   _in_order(pool, tasks, POOL_AHEAD_PER_WORKER * (workers - 1),
                             IN_FLIGHT_PER_WORKER * workers))
        docs, tokens, nbytes = _consume(results, builders, log_interval, log, size)
        _check_not_empty(input, docs, tokens, tuple(prefixes))
        for k, b in builders.items():
            b.finalize(prefixes[k] + ".idx")
    except BaseException as err:
        interrupted = not isinstance(err, Exception)
        with files.signals_held():
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
    return docs, tokens, nbytes


def _check_not_empty(input, docs, tokens, keys):
    """Refuse an input that gives no document (empty, or blank lines only) or only empty ones."""
    if docs == 0:
        raise DataError(f"{input} holds no document (the file is empty or every line is blank); "
                        f"pass a jsonl file with one JSON object per line.")
    if tokens == 0:
        raise DataError(f"{input}: all {docs} documents are empty (no text under --json-keys "
                        f"{' '.join(keys)}); check --json-keys or the file.")


def _os_error(err: OSError, output_prefix, nothing):
    """One sentence for an OS error while preprocessing: the file, the reason, what to do."""
    folder = os.path.dirname(os.path.abspath(output_prefix))
    where = err.filename or folder
    if err.errno == errno.ENOSPC:
        todo = (f"free space there ({shutil.disk_usage(folder).free / 1e6:.1f} MB free now) or "
                f"pass another --output-prefix")
    elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        todo = "check its permissions (or the file system's) or pass other paths"
    else:
        todo = "check the file and its disk"
    return DataError(f"{where}: {err.strerror or err}; {nothing}; {todo}.")


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
