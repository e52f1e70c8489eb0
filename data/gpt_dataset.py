"""GPT pretraining dataset: the same document, sample and shuffle indices as megatron-core.

A sample is seq_length + 1 consecutive tokens of the shuffled, epoch-tiled document stream;
sample i starts at token i * seq_length (so consecutive samples share one token).
"""
import hashlib
import json
import os
import time
from dataclasses import dataclass

import numpy as np

from .indexed_dataset import DataError

SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


@dataclass
class GPTDatasetConfig:
    """Everything that shapes GPT samples (plain values, no torch)."""
    seq_length: int
    seed: int
    eod_id: int
    pad_id: int = -1
    cache_dir: str = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    return_document_ids: bool = False


# ---------------------------------------------------------------------------------------------
# index building (pure numpy, vectorised)

def num_epochs_needed(tokens_per_epoch, num_samples, seq_length):
    """Smallest e >= 1 with e * tokens_per_epoch >= num_samples * seq_length + 1."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(documents, num_epochs, rng, separate_final_epoch):
    """The split's documents tiled num_epochs times and shuffled (the last epoch on its own)."""
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate((first, last))
    index = np.tile(np.asarray(documents, np.int32), num_epochs)
    rng.shuffle(index)
    return index


SAMPLE_INDEX_CHUNK = 1 << 15      # documents per step: the temporaries stay in the CPU cache


def build_sample_index(sequence_lengths, document_index, seq_length, num_samples):
    """[num_samples + 1, 2] rows of (position in document_index, token offset in that document).

    Row i (i >= 1) locates token i * seq_length of the flattened stream, i.e. the document that
    holds it (empty documents never do); row 0 is (0, 0) as in Megatron's helper. One pass over
    document_index in cache-sized chunks: the boundaries k * seq_length before each document's end
    are ceil(end / seq_length), so each document is repeated once per boundary it holds.
    """
    lengths = np.asarray(sequence_lengths)
    document_index = np.asarray(document_index)
    i32 = np.iinfo(np.int32).max
    n_docs, rows = len(document_index), num_samples + 1
    big = n_docs > i32 or (lengths.size and int(lengths.max()) > i32
                           and int(lengths[document_index].max(initial=0)) > i32)
    out = np.empty((rows, 2), np.int64 if big else np.int32)
    if n_docs * (int(lengths.max()) if lengths.size else 0) >= 2 ** 52:
        return _sample_index_int(lengths, document_index, seq_length, out)
    chunk = SAMPLE_INDEX_CHUNK
    sizes = np.empty(min(chunk, n_docs), lengths.dtype)
    ends = np.empty(len(sizes), np.int64)
    upto_f = np.empty(len(sizes))
    upto = np.empty(len(sizes), np.int64)
    counts = np.empty(len(sizes), np.int64)
    ids = np.arange(len(sizes), dtype=out.dtype)
    done, tokens, boundaries = 0, 0, 0          # rows written, tokens and boundaries so far
    for lo in range(0, n_docs, chunk):
        m = min(chunk, n_docs - lo)
        sz, en, uf, up, ct = sizes[:m], ends[:m], upto_f[:m], upto[:m], counts[:m]
        np.take(lengths, document_index[lo:lo + m], out=sz)
        np.cumsum(sz, dtype=np.int64, out=en)
        en += tokens                            # token position of each document's end
        np.divide(en, float(seq_length), out=uf)   # exact: integers below 2**52
        np.ceil(uf, out=uf)
        np.copyto(up, uf, casting="unsafe")     # boundaries k * seq_length before each end
        ct[0] = up[0] - boundaries
        np.subtract(up[1:], up[:-1], out=ct[1:])
        take = min(int(up[-1]) - boundaries, rows - done)
        if take > 0:
            held = np.repeat(ids[:m], ct)[:take]        # chunk-local document of each row
            en -= sz                                    # now each document's start
            block = out[done:done + take]
            np.add(held, lo, out=block[:, 0], casting="unsafe")
            offsets = np.arange(done * seq_length, (done + take) * seq_length, seq_length,
                                dtype=np.int64)
            offsets -= en.take(held)
            block[:, 1] = offsets
            done += take
            en += sz
        tokens, boundaries = int(en[-1]), int(up[-1])
        if done == rows:
            break
    if done < rows:
        raise ValueError(f"the document stream holds too few tokens for {num_samples} samples")
    out[0] = 0
    return out


def _sample_index_int(lengths, document_index, seq_length, out):
    """build_sample_index with integer arithmetic only (token counts of 2**52 and more)."""
    sizes = lengths[document_index].astype(np.int64)
    ends = np.cumsum(sizes)
    upto = -(-ends // seq_length)
    counts = np.diff(upto, prepend=0)
    rows = len(out)
    if int(upto[-1]) < rows:
        raise ValueError(f"the document stream holds too few tokens for {rows - 1} samples")
    held = np.repeat(np.arange(len(sizes), dtype=np.int64), counts)[:rows]
    out[:, 0] = held
    out[:, 1] = np.arange(rows, dtype=np.int64) * seq_length - (ends - sizes)[held]
    out[0] = 0
    return out


def build_shuffle_index(num_samples, total_size, rng):
    """Permutation of [0, num_samples) followed by a separate permutation of the rest."""
    dtype = np.int64 if total_size >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(sequence_lengths, documents, num_samples, seq_length, seed):
    """(document_index, sample_index, shuffle_index), equal to megatron-core's GPTDataset."""
    tokens_per_epoch = int(np.asarray(sequence_lengths)[documents].sum(dtype=np.int64))
    if tokens_per_epoch < 2:
        raise ValueError("it holds fewer than 2 tokens")
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length)
    separate, sans_final = False, None
    if num_epochs > 1:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = num_samples - sans_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate)
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length, total)
    shuffle_index = build_shuffle_index(sans_final if separate else total, total, rng)
    return document_index, sample_index, shuffle_index


# ---------------------------------------------------------------------------------------------
# item assembly

def ltor_fields(tokens, eod_id, reset_position_ids, eod_mask_loss, want_document_ids):
    """loss_mask, position_ids and (optionally) per-token segment ids; never an s x s mask."""
    s = len(tokens)
    loss_mask = np.ones(s, np.float32)
    is_eod = tokens == eod_id
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    position_ids = np.arange(s, dtype=np.int64)
    document_ids = None
    if reset_position_ids or want_document_ids:
        new_segment = np.empty(s, bool)
        new_segment[:1] = True
        new_segment[1:] = is_eod[:-1]
        document_ids = np.cumsum(new_segment, dtype=np.int64) - 1
        if reset_position_ids:
            position_ids -= np.flatnonzero(new_segment)[document_ids]
    return loss_mask, position_ids, document_ids


# ---------------------------------------------------------------------------------------------
# caching

def save_npy(path, array):
    """np.save under a temporary name, then rename (readers never see a partial file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def wait_for(paths, timeout=3600.0):
    """Poll until every path exists (used when no barrier callable is given)."""
    deadline = time.time() + timeout
    while not all(os.path.isfile(p) for p in paths):
        if time.time() > deadline:
            raise TimeoutError(f"gave up waiting for rank 0 to write {paths[0]}; check rank 0's "
                               f"log and that the cache directory is shared by all ranks.")
        time.sleep(0.2)


def description_hash(description):
    """md5 of a JSON description (the cache key)."""
    text = json.dumps(description, indent=2, sort_keys=True, default=str)
    return text, hashlib.md5(text.encode()).hexdigest()


def load_cached(path, cache_dir, stem_glob):
    """One cached index array, memory-mapped (never unpickled: allow_pickle stays False); a file
    that is not a plain integer .npy (an object array, truncated, another dtype) is a DataError
    naming it and how to rebuild it."""
    try:
        array = np.load(path, mmap_mode="r")
    except (ValueError, EOFError) as err:
        raise corrupt_cache(path, cache_dir, stem_glob, _numpy_reason(err)) from None
    if array.dtype.kind not in "iu" or array.ndim not in (1, 2):
        raise corrupt_cache(path, cache_dir, stem_glob,
                            f"it holds a {array.ndim}-d {array.dtype} array, not integer indices")
    return array


def _numpy_reason(err) -> str:
    """What numpy's refusal of a cached .npy means, in words (numpy's own kept in brackets)."""
    text = str(err).strip().rstrip(".") or type(err).__name__
    if "Python objects" in text:
        return "it holds an array of Python objects, not integer indices"
    if "pickle" in text:
        return "it is not a .npy array (numpy would have to unpickle it)"
    if isinstance(err, EOFError) or "EOF" in text or "greater than file size" in text:
        return f"it is truncated (numpy: {text})"
    return f"it is not a readable .npy file (numpy: {text})"


def corrupt_cache(path, cache_dir, stem_glob, reason):
    """The sentence for a cached index that cannot be used: the file, why, what to delete."""
    return DataError(f"{path}: this cached dataset index cannot be used: {reason}; delete "
                     f"{os.path.join(cache_dir, stem_glob)} (or the whole cache folder {cache_dir}) "
                     f"and run again to rebuild the indices.")


def cached_indices(cache_dir, description: dict, stem: str, names, build_fn, build: bool,
                   check=None):
    """Index arrays keyed by a hash of `description`: memory-mapped from `cache_dir` when cached,
    else built by `build_fn()` and saved (build=True, one rank) or waited for (build=False).
    Without a cache_dir they are built in memory. `check(arrays)`: None, or (name, problem) for
    arrays whose shapes do not fit the dataset (a damaged or foreign cache file): a DataError
    naming that file."""
    if cache_dir is None:
        return build_fn()
    text, key = description_hash(description)
    paths = [os.path.join(cache_dir, f"{key}-{stem}-{n}.npy") for n in names]
    if not all(map(os.path.isfile, paths)):
        if not build:
            wait_for(paths)
        else:
            os.makedirs(cache_dir, exist_ok=True)
            with open(os.path.join(cache_dir, f"{key}-{stem}.json"), "w") as f:
                f.write(text)
            for path, array in zip(paths, build_fn()):
                save_npy(path, array)
    stem_glob = f"{key}-{stem}-*.npy"
    arrays = tuple(load_cached(p, cache_dir, stem_glob) for p in paths)
    problem = check(arrays) if check is not None else None
    if problem is not None:
        name, reason = problem
        raise corrupt_cache(paths[list(names).index(name)], cache_dir, stem_glob, reason)
    return arrays


class GPTDataset:
    """Megatron-compatible GPT samples drawn from an IndexedDataset split.

    build=False means "the indices must already be cached" (non-zero ranks).
    """

    def __init__(self, indexed, path_prefix, documents, num_samples, split_name, config,
                 build=True):
        self.indexed, self.config, self.split_name = indexed, config, split_name
        self.num_samples = num_samples
        self.documents = np.asarray(documents, np.int32)
        self.pad_id = -1 if config.pad_id == config.eod_id else config.pad_id
        self.description = {   # the cache key: the .idx contents, not only its path
            "class": "GPTDataset", "path": os.path.abspath(path_prefix),
            "idx": indexed.fingerprint(),
            "documents": [int(self.documents[0]), int(self.documents[-1]) + 1]
            if len(self.documents) else [0, 0],
            "num_samples": num_samples, "split": split_name, "seq_length": config.seq_length,
            "seed": config.seed,
        }
        self.document_index, self.sample_index, self.shuffle_index = self._indices(build)

    def _indices(self, build):
        return cached_indices(self.config.cache_dir, self.description, f"GPTDataset-{self.split_name}",
                              ("document_index", "sample_index", "shuffle_index"), self._build, build,
                              check=self._check_indices)

    def _check_indices(self, arrays):
        """(name, problem) when cached indices cannot be this split's (shapes only: no full read)."""
        document_index, sample_index, shuffle_index = arrays
        samples = len(sample_index) - 1
        if document_index.ndim != 1:
            return "document_index", f"its shape is {document_index.shape}, not one row"
        if not len(document_index) or len(document_index) % max(len(self.documents), 1):
            return "document_index", (f"its {len(document_index)} entries are not whole epochs of "
                                      f"the split's {len(self.documents)} documents")
        if sample_index.ndim != 2 or sample_index.shape[1] != 2 or samples < 0:
            return "sample_index", f"its shape is {sample_index.shape}, not (samples + 1, 2)"
        if self.num_samples is not None and samples < self.num_samples:
            return "sample_index", (f"it holds {samples} samples, fewer than the "
                                    f"{self.num_samples} asked")
        if shuffle_index.ndim != 1 or len(shuffle_index) != samples:
            return "shuffle_index", (f"its shape is {shuffle_index.shape}, not ({samples},) for the "
                                     f"{samples} samples of the sample index")
        return None

    def _build(self):
        try:
            return build_gpt_indices(self.indexed.sequence_lengths, self.documents,
                                     self.num_samples, self.config.seq_length, self.config.seed)
        except ValueError as err:   # name the split and the file: the user picks the fix
            lo, hi = self.description["documents"]
            held = f"documents {lo}..{hi - 1}" if len(self.documents) else "no document"
            raise DataError(
                f"the {self.split_name} split of {self.description['path']} ({held} of "
                f"{len(self.indexed)}) cannot be built: {err}; give it documents with another "
                f"--split (a weight of 0 skips a split, e.g. 98,2,0) or use more data.") from None

    def __len__(self):
        return len(self.sample_index) - 1

    def locate(self, idx):
        """Where sample idx comes from, for messages: the data file, split and first document."""
        row = int(self.sample_index[int(self.shuffle_index[idx])][0])
        return (f"sample {idx} of the {self.split_name} split of {self.description['path']} "
                f"(from document {int(self.document_index[row])})")

    def text(self, idx):
        """The seq_length + 1 token ids of sample idx (after shuffling), as int64."""
        j = int(self.shuffle_index[idx])
        d0, o0 = (int(v) for v in self.sample_index[j])
        d1, o1 = (int(v) for v in self.sample_index[j + 1])
        doc, get = self.document_index, self.indexed.get
        if d0 == d1:
            parts = [get(int(doc[d0]), o0, o1 - o0 + 1)]
        else:
            parts = [get(int(doc[d0]), o0)]
            parts += [get(int(doc[k])) for k in range(d0 + 1, d1)]
            parts.append(get(int(doc[d1]), 0, o1 + 1))
        text = np.concatenate(parts, dtype=np.int64)
        short = self.config.seq_length + 1 - len(text)
        if short > 0:
            text = np.concatenate([text, np.full(short, self.pad_id, np.int64)])
        return text

    def __getitem__(self, idx):
        cfg = self.config
        text = self.text(idx)
        tokens, labels = text[:-1].copy(), text[1:].copy()
        loss_mask, position_ids, document_ids = ltor_fields(
            tokens, cfg.eod_id, cfg.reset_position_ids, cfg.eod_mask_loss,
            cfg.return_document_ids or cfg.reset_attention_mask)
        loss_mask[labels == self.pad_id] = 0.0
        tokens[tokens == self.pad_id] = 0
        labels[labels == self.pad_id] = 0
        item = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                "position_ids": position_ids}
        if cfg.return_document_ids:
            item["document_ids"] = document_ids
        return item
