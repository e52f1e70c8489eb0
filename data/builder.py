"""build_gpt_datasets: Megatron's --data-path / --split / sample counts to (train, valid, test)."""
import contextlib
import errno
import math
import os
import re

import numpy as np

from .blended_dataset import BlendedDataset, normalize
from .gpt_dataset import GPTDataset, GPTDatasetConfig, num_epochs_needed
from .indexed_dataset import DataError, DataFileError, IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")
BLEND_SURPLUS = 0.005   # megatron-core's mid_level_dataset_surplus


def parse_data_path(data_path):
    """Megatron's list form -> (prefixes, weights or None)."""
    if isinstance(data_path, str):
        data_path = data_path.split()
    items = [str(x) for x in data_path]
    if len(items) % 2 == 1:
        return items, None
    try:
        weights = [float(w) for w in items[0::2]]
    except ValueError:
        return items, None
    for text, w, prefix in zip(items[0::2], weights, items[1::2]):   # as Megatron-LM refuses
        if not (math.isfinite(w) and w > 0):
            raise DataError(f"--data-path gives {prefix} the weight {text}, which is not a "
                            f"positive number; give every dataset a weight above 0 (leave a "
                            f"dataset out of --data-path to skip it).")
    return items[1::2], weights


SPLIT_EXAMPLE = "969,30,1"


def parse_split(split) -> list[float]:
    """--split as three weights: '949,50,1' or '949/50/1' (Megatron-LM's separators; missing
    weights are 0, '100' is train only). One sentence (DataError) for what Megatron asserts on
    or would misread: a weight that is not a number, a negative weight (megatron-core's regex
    would read '98,-2,4' as 98,2,4), more than three weights, or no positive weight at all."""
    text = split if isinstance(split, str) else ",".join(map(str, split))
    given = f"--split {text}"
    # Megatron's launch scripts expand "--split '99,1,0'" unquoted: the quotes reach the parser.
    parts = [p.strip() for p in re.split(r"[,/]", text.strip().strip("'\""))] \
        if isinstance(split, str) else [str(w) for w in split]
    if len(parts) > 3:
        raise DataError(f"{given} has {len(parts)} weights; give at most three, train,valid,test "
                        f"(e.g. --split {SPLIT_EXAMPLE}).")
    weights = []
    for part in parts:
        try:
            weight = float(part)
        except ValueError:
            weight = None
        if weight is None or not math.isfinite(weight):
            raise DataError(f"{given}: {part!r} is not a number; give train,valid,test weights "
                            f"separated by commas or slashes (e.g. --split {SPLIT_EXAMPLE}).")
        if weight < 0:
            raise DataError(f"{given} gives a split the negative weight {part}; weights must be "
                            f"0 or more (0 skips a split, e.g. --split 98,2,0).")
        weights.append(weight)
    if sum(weights) <= 0:
        raise DataError(f"{given} gives every split a weight of 0; give the training split a "
                        f"positive weight (e.g. --split {SPLIT_EXAMPLE}).")
    return weights + [0.0] * (3 - len(weights))


def split_matrix(split):
    """'949,50,1' -> [(0, .949), (.949, .999), (.999, 1.0)], None for a 0-weight split."""
    split = parse_split(split)
    ends, acc = [0.0], 0.0
    for w in normalize(split):
        acc = acc + w
        ends.append(acc)
    return [(a, b) if b > a else None for a, b in zip(ends[:-1], ends[1:])]


def split_documents(bookends, n):
    """The contiguous range of sequence ids a split covers."""
    beg, end = int(round(bookends[0] * float(n))), int(round(bookends[1] * float(n)))
    return np.arange(beg, end, dtype=np.int32)


def _read(bookends, size):
    """Whether a split is built: it has documents in --split and someone asks for its samples
    (a count of 0, e.g. the test split without test iterations, is never read)."""
    return bookends is not None and size != 0


def _gpt_splits(prefix, matrix, sizes, config, build):
    indexed = IndexedDataset(prefix)
    return [GPTDataset(indexed, prefix, split_documents(bookends, len(indexed)), size, name,
                       config, build) if _read(bookends, size) else None
            for bookends, size, name in zip(matrix, sizes, SPLIT_NAMES)]


def _split_tokens(lengths, matrix, read):
    """Tokens of each split that is read (None for the others)."""
    return [int(lengths[split_documents(b, len(lengths))].sum(dtype=np.int64)) if r else None
            for b, r in zip(matrix, read)]


def suggest_split(lengths, read):
    """A --split (percentages) under which every split that is read holds at least 2 tokens: the
    smallest share for validation/test that works, the rest for training; None if none does."""
    for share in (1, 2, 3, 5, 10, 20, 30, 40):
        weights = [100 - share * sum(read[1:])] + [share if r else 0 for r in read[1:]]
        tokens = _split_tokens(lengths, split_matrix(weights), read)
        if all(t is None or t >= 2 for t in tokens):
            return ",".join(map(str, weights))
    return None


def check_splits(prefix, split, matrix, sizes):
    """One sentence when a split that will be read holds fewer than 2 tokens (which split, how
    many documents the data has, a --split that works)."""
    lengths = IndexedDataset(prefix).sequence_lengths
    read = [_read(b, s) for b, s in zip(matrix, sizes)]
    for name, tokens, bookends in zip(SPLIT_NAMES, _split_tokens(lengths, matrix, read), matrix):
        if tokens is None or tokens >= 2:
            continue
        docs = split_documents(bookends, len(lengths))
        held = f"documents {docs[0]}..{docs[-1]}" if len(docs) else "no document"
        better = suggest_split(lengths, read)
        todo = (f"pass --split {better}" if better else
                "use more data, or --split 100,0,0 with --eval-iters 0 (no validation)")
        raise DataError(f"the {name} split of {prefix} is empty: --split {split} gives it {held} "
                        f"({tokens} tokens) of the {len(lengths)} documents the data has; {todo}.")


def short_split_notes(prefix, matrix, sizes, seq_length):
    """The notes for the splits read whose one epoch holds fewer tokens than one sample
    (seq_length + 1): each sample then holds the split's documents several times over, and the
    run reads them many epochs (Megatron's sample order, said rather than changed)."""
    lengths = IndexedDataset(prefix).sequence_lengths
    read = [_read(b, s) for b, s in zip(matrix, sizes)]
    notes = []
    for name, tokens, size in zip(SPLIT_NAMES, _split_tokens(lengths, matrix, read), sizes):
        if tokens is None or tokens < 2 or tokens >= seq_length + 1:
            continue
        runs = ""
        if size:
            epochs = num_epochs_needed(tokens, size, seq_length)
            runs = f", {epochs} times over the {size} samples asked of it"
        notes.append(f"> note: the {name} split of {prefix} holds {tokens} tokens, fewer than one "
                     f"sample (--seq-length {seq_length} + 1 tokens): each of its documents "
                     f"repeats about {(seq_length + 1) / tokens:.0f} times in every sample"
                     f"{runs}; use more data or a shorter --seq-length.")
    return notes


def _prefix_sizes(weights, sizes, matrix, n_prefixes):
    """Sample counts asked of each prefix's splits (megatron-core's per-dataset targets plus its
    surplus when blending with weights; None = the whole split)."""
    if weights is None:      # blended by size: whole splits, except those nobody reads
        return [list(sizes)] if n_prefixes == 1 else [[0 if s == 0 else None for s in sizes]
                                                      for _ in range(n_prefixes)]
    if any(s is None for s, m in zip(sizes, matrix) if m is not None):
        raise ValueError("blending with weights needs a sample count for every used split")
    return [[int(math.ceil(math.ceil(s * w) * (1 + BLEND_SURPLUS))) if s is not None else None
             for s in sizes] for w in normalize(weights)]


def _build_all(prefixes, weights, matrix, sizes, config, build):
    if len(prefixes) == 1 and weights is None:
        return _gpt_splits(prefixes[0], matrix, sizes, config, build)
    if weights is not None:
        weights = normalize(weights)
        targets = [[int(math.ceil(s * w)) if s is not None else None for s in sizes]
                   for w in weights]
    buffers = _prefix_sizes(weights, sizes, matrix, len(prefixes))
    per_prefix = [_gpt_splits(p, matrix, b, config, build) for p, b in zip(prefixes, buffers)]
    out = []
    for i, bookends in enumerate(matrix):
        if not _read(bookends, sizes[i]):
            out.append(None)
            continue
        parts = [splits[i] for splits in per_prefix]
        if weights is not None:
            w_i, size_i = weights, sum(row[i] for row in targets)
        else:
            w_i = [len(d) for d in parts]
            size_i = sum(w_i) if sizes[i] is None else min(sizes[i], sum(w_i))
        out.append(BlendedDataset(parts, w_i, size_i, config.cache_dir, build))
    return out


def build_gpt_datasets(data_path, split, seq_length, seed, num_samples, eod_id, pad_id, cache_dir,
                       *, reset_position_ids=False, reset_attention_mask=False,
                       eod_mask_loss=False, return_document_ids=False, rank=0, world_size=1,
                       barrier=None, note=None):
    """(train, valid, test) datasets equal to megatron-core's for the same settings; a split
    with no documents in --split or a sample count of 0 is None (never built).

    Rank 0 builds (and caches) the indices; the others wait (barrier, or polling the cache when
    no barrier is given) and memory-map them. Rank 0 says through `note` (default: print) when a
    split holds fewer tokens than one sample (short_split_notes).
    """
    prefixes, weights = parse_data_path(data_path)
    config = GPTDatasetConfig(seq_length, seed, eod_id, pad_id, cache_dir, reset_position_ids,
                              reset_attention_mask, eod_mask_loss, return_document_ids)
    matrix = split_matrix(split)
    sizes = list(num_samples) + [None] * (3 - len(num_samples))
    for prefix, row in zip(prefixes, _prefix_sizes(weights, sizes, matrix, len(prefixes))):
        check_splits(prefix, split, matrix, row)     # every rank: all stop together, none waits
    result = None
    if rank == 0:
        say = note or (lambda line: print(line, flush=True))
        for prefix, row in zip(prefixes, _prefix_sizes(weights, sizes, matrix, len(prefixes))):
            for line in short_split_notes(prefix, matrix, row, seq_length):
                say(line)
        result = _build_all(prefixes, weights, matrix, sizes, config, build=True)
    if world_size > 1 and barrier is not None:
        barrier()
    if rank != 0:
        if cache_dir is None:
            raise ValueError("several ranks need a shared cache_dir for the dataset indices")
        result = _build_all(prefixes, weights, matrix, sizes, config, build=False)
    return tuple(result)


@contextlib.contextmanager
def os_errors_named(cache_dir=None):
    """An OS error while opening the data files or reading/writing the index cache (a file or
    folder without permission, chmod 000; a read-only or full cache) becomes one DataError that
    names the file and what to do."""
    try:
        yield
    except OSError as err:
        raise _os_error(err, cache_dir) from err


def _os_error(err: OSError, cache_dir):
    """The sentence of `err`: in the cache folder (permissions, space) or a data file."""
    path = err.filename or "a data file"
    reason = err.strerror or str(err)
    cache = os.path.abspath(cache_dir) if cache_dir else None
    if cache and (os.path.abspath(path) + os.sep).startswith(cache + os.sep):
        where = f"{path}: {reason} (the data cache, --data-cache-path {cache_dir})"
        if err.errno == errno.ENOSPC:
            return DataError(f"{where}; free space there or pass another --data-cache-path.")
        return DataError(f"{where}; make that folder readable and writable by this user (chmod "
                         f"-R u+rwX {cache_dir}) or pass another --data-cache-path.")
    if err.errno in (errno.EACCES, errno.EPERM):
        return DataFileError(f"{path}: {reason}; make the data files readable by this user "
                             f"(chmod u+r {path}) or check --data-path.")
    return DataFileError(f"{path}: {reason}; check the file, its disk and --data-path.")
