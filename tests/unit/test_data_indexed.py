"""Indexed dataset: byte compatibility with megatron-core both ways, and clear errors on bad files."""
import os
import struct
import warnings

import numpy as np
import pytest

from megatron_sp.data import DataFileError, IndexedDataset, IndexedDatasetBuilder


def random_docs(rng, n, vocab, empty_every=7):
    docs = []
    for i in range(n):
        nseq = int(rng.integers(1, 4))
        seqs = [rng.integers(0, vocab, int(rng.integers(0 if i % empty_every == 0 else 1, 50)))
                for _ in range(nseq)]
        docs.append(seqs)
    return docs


def write_ours(prefix, docs, dtype, use_items=False):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for seqs in docs:
        if use_items:
            for s in seqs:
                b.add_item(s)
            b.end_document()
        else:
            b.add_document(np.concatenate(seqs), [len(s) for s in seqs])
    b.finalize(prefix + ".idx")


def mcore():
    import megatron.core  # noqa: F401 (test extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def write_theirs(prefix, docs, dtype):
    import torch
    b = mcore().IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for seqs in docs:
        b.add_document(torch.from_numpy(np.concatenate(seqs).astype(np.int64)),
                       [len(s) for s in seqs])
    b.finalize(prefix + ".idx")


def assert_same(ours, theirs):
    assert len(ours) == len(theirs)
    np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    for i in range(len(ours)):
        a, b = ours[i], theirs[i]
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
        if len(a) > 3:
            np.testing.assert_array_equal(ours.get(i, 1, 2), theirs.get(i, 1, 2))


@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 65000), (np.int32, 200000)])
def test_both_directions_byte_identical(tmp_path, dtype, vocab, seed):
    rng = np.random.default_rng(seed)
    docs = random_docs(rng, 60, vocab)
    write_ours(str(tmp_path / "ours"), docs, dtype)
    write_ours(str(tmp_path / "items"), docs, dtype, use_items=True)
    write_theirs(str(tmp_path / "theirs"), docs, dtype)
    for ext in (".bin", ".idx"):
        theirs = (tmp_path / f"theirs{ext}").read_bytes()
        assert (tmp_path / f"ours{ext}").read_bytes() == theirs
        assert (tmp_path / f"items{ext}").read_bytes() == theirs
    ref = mcore().IndexedDataset(str(tmp_path / "ours"))
    assert_same(IndexedDataset(str(tmp_path / "theirs")), ref)
    flat = [s for seqs in docs for s in seqs]
    ours = IndexedDataset(str(tmp_path / "theirs"))
    for i, s in enumerate(flat):
        np.testing.assert_array_equal(ours[i], s)
    assert ours.num_tokens == sum(len(s) for s in flat)


def test_merge_and_empty_documents(tmp_path, seed):
    rng = np.random.default_rng(seed)
    parts = [random_docs(rng, int(rng.integers(5, 30)), 1000, empty_every=3) for _ in range(3)]
    parts[1].append([np.zeros(0, np.int64)])          # a document of one empty sequence
    for k, docs in enumerate(parts):
        write_theirs(str(tmp_path / f"p{k}"), docs, np.uint16)
    ours = IndexedDatasetBuilder(str(tmp_path / "merged_ours.bin"), np.uint16)
    theirs = mcore().IndexedDatasetBuilder(str(tmp_path / "merged_theirs.bin"), dtype=np.uint16)
    for k in range(3):
        ours.add_index(str(tmp_path / f"p{k}"))
        theirs.add_index(str(tmp_path / f"p{k}"))
    ours.finalize(str(tmp_path / "merged_ours.idx"))
    theirs.finalize(str(tmp_path / "merged_theirs.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"merged_ours{ext}").read_bytes() == \
            (tmp_path / f"merged_theirs{ext}").read_bytes()
    merged = IndexedDataset(str(tmp_path / "merged_ours"))
    assert len(merged.document_indices) == sum(len(p) for p in parts) + 1
    assert_same(merged, mcore().IndexedDataset(str(tmp_path / "merged_theirs")))
    with pytest.raises(IndexError):
        merged.get(0, 0, int(merged.sequence_lengths[0]) + 1)


def test_builder_leaves_no_file_until_finalize(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16)
    b.add_document(np.arange(10), [4, 6])
    assert not (tmp_path / "x.bin").exists()
    b.abort()
    assert os.listdir(tmp_path) == []
    b = IndexedDatasetBuilder(str(tmp_path / "y.bin"), np.uint16)
    with pytest.raises(ValueError, match=r"do not fit uint16; .*--dtype int32"):
        b.add_document(np.array([70000]), [1])
    with pytest.raises(ValueError, match="sum to"):
        b.add_document(np.arange(5), [2, 2])
    b.abort()


def good_pair(tmp_path, rng):
    prefix = str(tmp_path / "good")
    write_ours(prefix, random_docs(rng, 20, 1000), np.int32)
    return prefix, (tmp_path / "good.idx").read_bytes(), (tmp_path / "good.bin").read_bytes()


def corrupt(tmp_path, idx, bin_, match):
    prefix = str(tmp_path / "bad")
    (tmp_path / "bad.idx").write_bytes(idx)
    (tmp_path / "bad.bin").write_bytes(bin_)
    with pytest.raises(DataFileError, match=match) as info:
        IndexedDataset(prefix)
    msg = str(info.value)
    assert "bad." in msg and msg.count("\n") == 0 and msg.endswith(".")


def test_corrupted_files_give_one_clear_error(tmp_path, seed):
    rng = np.random.default_rng(seed)
    _, idx, bin_ = good_pair(tmp_path, rng)
    n_seq, n_doc = struct.unpack("<QQ", idx[18:34])
    corrupt(tmp_path, b"NOTMMIDX\x00" + idx[9:], bin_, "wrong magic")
    corrupt(tmp_path, idx[:9] + struct.pack("<Q", 2) + idx[17:], bin_, "version 2")
    corrupt(tmp_path, idx[:17] + bytes([9]) + idx[18:], bin_, "unknown dtype code 9")
    corrupt(tmp_path, idx[:20], bin_, "truncated index")
    corrupt(tmp_path, idx[:-int(rng.integers(1, 8 * n_doc))], bin_, "truncated index")
    corrupt(tmp_path, idx + b"\x00" * 8, bin_, "longer than")
    corrupt(tmp_path, idx, bin_[:-int(rng.integers(1, len(bin_)))], "truncated")
    corrupt(tmp_path, idx, bin_ + b"\x00\x00\x00\x00", "too long")
    wrong_count = idx[:18] + struct.pack("<Q", n_seq + 1) + idx[26:]
    corrupt(tmp_path, wrong_count, bin_, "index")
    bad_docs = bytearray(idx)
    bad_docs[-8:] = struct.pack("<q", n_seq + 5)
    corrupt(tmp_path, bytes(bad_docs), bin_, "document indices")
    with pytest.raises(DataFileError, match="file not found"):
        IndexedDataset(str(tmp_path / "missing"))
