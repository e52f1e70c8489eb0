"""Megatron-LM compatible indexed dataset (the MMIDIDX .bin/.idx pair), read with memory maps.

.idx layout (little-endian, packed): magic b"MMIDIDX\\x00\\x00", version u64 (=1), dtype code u8,
sequence_count u64, document_count u64, int32 sequence_lengths[S], int64 sequence_pointers[S]
(byte offsets into .bin), int64 document_indices[D] (0 ... S). The .bin is the raw tokens.
"""
import hashlib
import mmap
import os
import shutil
import struct

import numpy as np

from megatron_sp.errors import DataError  # noqa: F401  (re-exported: megatron_sp.data.DataError)

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 9 + 8 + 1 + 8 + 8
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.float32, 8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


class DataFileError(DataError):
    """A .bin/.idx file that cannot be read as an indexed dataset (the message says why)."""


def optimal_dtype(vocab_size):
    """Megatron's token dtype: uint16 when the vocabulary fits (< 65500), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def _fail(path, problem, todo="rebuild it with tools/preprocess_data.py"):
    raise DataFileError(f"{path}: {problem}; {todo}.")


def _map(path):
    """Read-only memory map of a whole file (an empty bytes object for an empty file)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def read_index(idx_path):
    """Parse and validate an .idx file; returns (dtype, lengths, pointers, doc_indices, buffer)."""
    if not os.path.isfile(idx_path):
        _fail(idx_path, "file not found", "check the data path prefix (without .bin/.idx)")
    buf = _map(idx_path)
    size = len(buf)
    if size < HEADER_BYTES:
        _fail(idx_path, f"truncated index ({size} bytes, the header alone is {HEADER_BYTES})")
    if bytes(buf[:9]) != MAGIC:
        _fail(idx_path, f"wrong magic {bytes(buf[:9])!r}, not a Megatron MMIDIDX index",
              "pass the prefix of a Megatron-LM .bin/.idx pair")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", buf[9:HEADER_BYTES])
    if version != VERSION:
        _fail(idx_path, f"unsupported index version {version} (only {VERSION} is known)")
    if code not in DTYPES:
        _fail(idx_path, f"unknown dtype code {code} (known: {sorted(DTYPES)})")
    expected = HEADER_BYTES + 12 * n_seq + 8 * n_doc
    if size < expected:
        _fail(idx_path, f"truncated index: {size} bytes, but {n_seq} sequences and {n_doc} "
              f"document entries need {expected}")
    if size > expected:
        _fail(idx_path, f"index is {size - expected} bytes longer than its {n_seq} sequences and "
              f"{n_doc} document entries account for (multimodal indices are not supported)")
    off = HEADER_BYTES
    lengths = np.frombuffer(buf, np.int32, n_seq, off)
    pointers = np.frombuffer(buf, np.int64, n_seq, off + 4 * n_seq)
    docs = np.frombuffer(buf, np.int64, n_doc, off + 12 * n_seq)
    if n_doc < 1 or docs[0] != 0 or docs[-1] != n_seq:
        _fail(idx_path, f"document indices must run from 0 to the sequence count {n_seq}, "
              f"found {docs[:1].tolist()} ... {docs[-1:].tolist()}")
    if n_doc > 1 and np.any(np.diff(docs) < 0):
        _fail(idx_path, "document indices are not non-decreasing")
    if n_seq and (pointers[0] != 0 or lengths.min() < 0):
        _fail(idx_path, "sequence pointers must start at 0 and lengths be non-negative")
    return DTYPES[code], lengths, pointers, docs, buf


class IndexedDataset:
    """Read-only view of a Megatron .bin/.idx pair; nothing is loaded beyond the memory maps.

    ds[i] -> numpy array of sequence i; ds.get(i, offset, length) -> a slice of it.
    """

    def __init__(self, path_prefix):
        self.path_prefix = path_prefix
        idx_path, bin_path = path_prefix + ".idx", path_prefix + ".bin"
        self.dtype, self.sequence_lengths, self.sequence_pointers, self.document_indices, \
            self._idx_buf = read_index(idx_path)
        self.dtype = np.dtype(self.dtype)
        if not os.path.isfile(bin_path):
            _fail(bin_path, "file not found", "the .idx has no matching .bin next to it")
        n = len(self.sequence_lengths)
        need = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize \
            if n else 0
        have = os.path.getsize(bin_path)
        if have != need:
            _fail(bin_path, f"{'truncated' if have < need else 'too long'}: {have} bytes, but "
                  f"{idx_path} describes {need} bytes of {self.dtype.name} tokens")
        self._bin_buf = _map(bin_path)
        # hot-path views: Python ints straight from the index, tokens as one array to slice
        self._lengths = memoryview(self.sequence_lengths).cast("B").cast("i")
        self._pointers = memoryview(self.sequence_pointers).cast("B").cast("q")
        size = self.dtype.itemsize
        self._shift, self._misaligned = size.bit_length() - 1, size - 1
        self._tokens = (np.frombuffer(self._bin_buf, self.dtype)
                        if len(self._bin_buf) % size == 0 else None)

    def __len__(self):
        return len(self.sequence_lengths)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = self._lengths[i]                    # lean path: this is the hot loop of training
        if n == 0:
            return np.empty(0, self.dtype)
        ptr = self._pointers[i]
        if ptr & self._misaligned or self._tokens is None:
            return np.frombuffer(self._bin_buf, self.dtype, n, ptr)
        ptr >>= self._shift
        return self._tokens[ptr:ptr + n]

    def get(self, i, offset=0, length=None):
        """Tokens [offset, offset+length) of sequence i (to its end when length is None)."""
        n = self._lengths[i]
        if length is None:
            length = n - offset
        if offset < 0 or length < 0 or offset + length > n:
            raise IndexError(f"{self.path_prefix}: tokens [{offset}, {offset + length}) are outside "
                             f"sequence {i} of length {n}")
        if length == 0:
            return np.empty(0, self.dtype)
        ptr = self._pointers[i]
        if ptr & self._misaligned or self._tokens is None:
            return np.frombuffer(self._bin_buf, self.dtype, length,
                                 ptr + offset * self.dtype.itemsize)
        ptr = (ptr >> self._shift) + offset
        return self._tokens[ptr:ptr + length]

    def fingerprint(self):
        """Identity of the .idx contents: its size and a blake2b hash of its bytes (the index is
        small: 12 bytes per sequence). Sample indices depend on nothing else in the pair."""
        if getattr(self, "_fingerprint", None) is None:
            digest = hashlib.blake2b(self._idx_buf, digest_size=16).hexdigest()
            self._fingerprint = f"{len(self._idx_buf)}-{digest}"
        return self._fingerprint

    @property
    def num_tokens(self):
        """Total number of tokens in the .bin."""
        return int(self.sequence_lengths.sum(dtype=np.int64))


def write_index(idx_path, dtype, lengths, document_indices):
    """Write an .idx file (pointers are derived from the lengths)."""
    lengths = np.asarray(lengths, np.int32)
    docs = np.asarray(document_indices, np.int64)
    pointers = np.zeros(len(lengths), np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    with open(idx_path, "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", VERSION, CODES[np.dtype(dtype)], len(lengths), len(docs)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(docs.tobytes(order="C"))


class IndexedDatasetBuilder:
    """Writes a .bin/.idx pair, Megatron's IndexedDatasetBuilder interface.

    The .bin is written under a temporary name; finalize(idx_path) writes the .idx, also under a
    temporary name, and renames both when complete, so a failed run leaves no partial file.
    `tmp_dir`: where the temporary files are (default: next to the outputs, `{name}.tmp{pid}`);
    on the outputs' file system.
    """

    def __init__(self, bin_path, dtype=np.int32, tmp_dir=None):
        self.bin_path = bin_path
        self._tmp_dir = tmp_dir
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise ValueError(f"{bin_path}: dtype {self.dtype} has no MMIDIDX code; use one of "
                             f"{[np.dtype(d).name for d in DTYPES.values()]}.")
        self._tmp_bin = self._tmp_name(bin_path)
        self._tmp_idx = None
        self._file = open(self._tmp_bin, "wb")
        self._lengths = []            # list of int32 arrays
        self._num_sequences = 0
        self._documents = [np.zeros(1, np.int64)]

    def _tmp_name(self, path):
        if self._tmp_dir is None:
            return f"{path}.tmp{os.getpid()}"
        return os.path.join(self._tmp_dir, os.path.basename(path))

    def _as_tokens(self, tokens):
        arr = np.asarray(tokens)
        if arr.dtype != self.dtype:
            if arr.size and np.issubdtype(self.dtype, np.integer):
                info = np.iinfo(self.dtype)
                if arr.min() < info.min or arr.max() > info.max:
                    raise DataError(f"{self.bin_path}: token ids {arr.min()}..{arr.max()} do not "
                                    f"fit {self.dtype.name}; preprocess with a wider dtype "
                                    f"(tools/preprocess_data.py --dtype int32).")
            arr = arr.astype(self.dtype)
        return np.ascontiguousarray(arr.reshape(-1))

    def add_item(self, tokens):
        """Append one sequence (the document continues until end_document())."""
        arr = self._as_tokens(tokens)
        self._file.write(arr.tobytes())
        self._lengths.append(np.array([arr.size], np.int32))
        self._num_sequences += 1

    def end_document(self):
        """Close the current document."""
        self._documents.append(np.array([self._num_sequences], np.int64))

    def add_document(self, tokens, lengths):
        """Append a whole document made of sequences of the given lengths."""
        arr = self._as_tokens(tokens)
        lengths = np.asarray(lengths, np.int32).reshape(-1)
        if int(lengths.sum()) != arr.size:
            raise ValueError(f"{self.bin_path}: document lengths sum to {int(lengths.sum())} but "
                             f"{arr.size} tokens were given; pass lengths that cover the tokens.")
        self._file.write(arr.tobytes())
        self._lengths.append(lengths)
        self._num_sequences += len(lengths)
        self.end_document()

    def add_documents(self, tokens, lengths):
        """Append many one-sequence documents at once; a length of 0 is an empty document."""
        arr = self._as_tokens(tokens)
        lengths = np.asarray(lengths, np.int64).reshape(-1)
        if int(lengths.sum()) != arr.size:
            raise ValueError(f"{self.bin_path}: lengths sum to {int(lengths.sum())} but "
                             f"{arr.size} tokens were given; pass lengths that cover the tokens.")
        self._file.write(memoryview(arr).cast("B"))
        self._append_documents(lengths)

    def _append_documents(self, lengths):
        """Index entries of one-sequence documents (a length of 0: an empty document)."""
        nonempty = lengths > 0
        self._lengths.append(lengths[nonempty].astype(np.int32))
        self._documents.append(self._num_sequences + np.cumsum(nonempty, dtype=np.int64))
        self._num_sequences += int(nonempty.sum())

    def add_documents_from(self, lengths, path, offset, nbytes):
        """add_documents for tokens already in this builder's dtype at bytes [offset, offset +
        nbytes) of the file `path` (a preprocessing worker's spill file); returns the count."""
        lengths = np.asarray(lengths, np.int64).reshape(-1)
        count = int(lengths.sum())
        if count * self.dtype.itemsize != nbytes:
            raise ValueError(f"{path}: {nbytes} bytes at {offset} are not {count} "
                             f"{self.dtype.name} tokens; spill the tokens in the builder's dtype.")
        with open(path, "rb") as f:
            f.seek(offset)
            self._file.write(f.read(nbytes))
        self._append_documents(lengths)
        return count

    def add_index(self, path_prefix):
        """Append a whole existing .bin/.idx pair (same dtype), keeping its document structure."""
        dtype, lengths, _, docs, _ = read_index(path_prefix + ".idx")
        if np.dtype(dtype) != self.dtype:
            raise ValueError(f"{path_prefix}.idx: dtype {np.dtype(dtype).name} differs from the "
                             f"builder's {self.dtype.name}; merge only datasets of one dtype.")
        self._lengths.append(np.array(lengths, np.int32))
        self._documents.append(np.array(docs[1:], np.int64) + self._num_sequences)
        self._num_sequences += len(lengths)
        with open(path_prefix + ".bin", "rb") as f:
            shutil.copyfileobj(f, self._file, 16 << 20)

    def finalize(self, idx_path):
        """Write the .idx and move both files to their final names."""
        self._file.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        self._tmp_idx = self._tmp_name(idx_path)
        write_index(self._tmp_idx, self.dtype, lengths, np.concatenate(self._documents))
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, idx_path)

    def abort(self):
        """Drop everything written so far (no file is left under the final names, no temporary
        file either, even when closing fails: a full disk)."""
        try:
            self._file.close()
        except OSError:
            pass
        for tmp in (self._tmp_bin, self._tmp_idx):
            if tmp is not None and os.path.exists(tmp):
                os.remove(tmp)
