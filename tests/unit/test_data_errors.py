"""Bad data input ends in one sentence and leaves nothing behind (docs/design.md §12), small
datasets included: blend weights, token ids outside the vocabulary (preprocessing and training), the
index cache after re-preprocessing a prefix, empty splits, the preprocessing CLI's errors."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from megatron_sp.data import (DataError, IndexedDataset, IndexedDatasetBuilder,
                              PretrainingDataLoader, build_gpt_datasets, preprocess)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EOD = 999


def write_corpus(prefix, rng, n_docs, max_len=60, vocab=EOD):
    b = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for _ in range(n_docs):
        doc = rng.integers(0, vocab, int(rng.integers(2, max_len)))
        doc[-1] = EOD
        b.add_document(doc, [len(doc)])
    b.finalize(prefix + ".idx")
    return prefix


def write_ids_jsonl(path, rng, n, bad_line=None, bad_text="4 5000 5"):
    with open(path, "w") as f:
        for i in range(1, n + 1):
            text = bad_text if i == bad_line else " ".join(map(str, rng.integers(0, 1000, 20)))
            f.write(json.dumps({"text": text}) + "\n")


@pytest.mark.parametrize("data_path,shown", [
    ("1 {a} -3 {b}", "-3"), ("0 {a} 1 {b}", "0"), ("0 {a} 0 {b}", "0"), ("1 {a} nan {b}", "nan"),
    ("1 {a} inf {b}", "inf")])
def test_blend_weights_must_be_positive(tmp_path, data_path, shown):
    rng = np.random.default_rng(0)
    a, b = (write_corpus(str(tmp_path / n), rng, 30) for n in "ab")
    path = data_path.format(a=a, b=b).split()
    bad = path[path.index(shown) + 1]
    with pytest.raises(DataError, match=rf"--data-path gives {bad} the weight {shown}, which is not "
                                        rf"a positive number"):
        build_gpt_datasets(path, "1", 16, 1, (50, 0, 0), EOD, -1, str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("seed", [0, 1])
def test_preprocess_refuses_ids_outside_the_vocabulary(tmp_path, seed):
    """`4 5000 5` with --vocab-size 1000: file:line, the id, the size; no file left (1 and 2
    workers, the bad line in a later block than the first)."""
    rng = np.random.default_rng(seed)
    bad = int(rng.integers(3000, 6000))
    src = str(tmp_path / "ids.jsonl")
    write_ids_jsonl(src, rng, 7000, bad_line=bad)
    for workers in (1, 2):
        with pytest.raises(DataError, match=rf"ids.jsonl:{bad}: token id 5000 is outside the "
                                            rf"tokenizer's vocabulary of 1001 ids"):
            preprocess(src, str(tmp_path / "out"), "NullTokenizer", vocab_size=1000,
                       workers=workers, log_interval=0)
        assert sorted(os.listdir(tmp_path)) == ["ids.jsonl"]


def test_preprocess_cli_errors_and_dtype(tmp_path):
    """One line, exit 1, no traceback, nothing written: non-integer NullTokenizer text (file:line),
    a missing output folder, --dtype uint16 for a vocabulary it cannot hold. --dtype int32 is
    honoured for a small vocabulary; the run ends with documents, tokens and MB/s."""
    rng = np.random.default_rng(3)
    src = tmp_path / "in.jsonl"
    write_ids_jsonl(str(src), rng, 40, bad_line=17, bad_text="3 4 hello 5")
    base = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", str(src),
            "--tokenizer-type", "NullTokenizer", "--workers", "2", "--append-eod"]

    def run(*extra):
        return subprocess.run(base + list(extra), capture_output=True, text=True, timeout=120)

    cases = [(("--output-prefix", str(tmp_path / "o"), "--vocab-size", "1000"),
              f"{src}:17: NullTokenizer text must be integer ids separated by spaces, found 'hello'"),
             (("--output-prefix", str(tmp_path / "missing" / "o"), "--vocab-size", "1000"),
              f"the output folder {tmp_path / 'missing'} does not exist"),
             (("--output-prefix", str(tmp_path / "o"), "--vocab-size", "70000", "--dtype", "uint16"),
              "--dtype uint16 holds ids up to 65535 but the tokenizer has 70001 ids; pass --dtype "
              "int32")]
    for extra, message in cases:
        out = run(*extra)
        assert out.returncode == 1 and out.stderr.startswith("error: ") and message in out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
        assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]
    write_ids_jsonl(str(src), rng, 40)
    out = run("--output-prefix", str(tmp_path / "o"), "--vocab-size", "1000", "--dtype", "int32")
    assert out.returncode == 0, out.stderr
    assert "done: 40 documents, 840 tokens" in out.stderr and "MB/s" in out.stderr
    assert IndexedDataset(str(tmp_path / "o_text_document")).dtype == np.int32


def test_preprocess_report_and_progress_bar(tmp_path, monkeypatch):
    """On a terminal a tqdm bar follows the input bytes (shown at once here); the run ends with
    one line: documents, tokens, MB/s."""
    import io
    module = sys.modules["megatron_sp.data.preprocess"]     # the package exports the function
    monkeypatch.setattr(module, "PROGRESS_DELAY_S", 0.0)
    monkeypatch.setattr(module, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(module, "MIN_BLOCK_BYTES", 4096)

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    src = str(tmp_path / "ids.jsonl")
    write_ids_jsonl(src, np.random.default_rng(8), 600)
    log = Terminal()
    preprocess(src, str(tmp_path / "o"), "NullTokenizer", vocab_size=1000, workers=2, log=log)
    text = log.getvalue()
    assert "preprocessing: 100%" in text and "\r" in text
    assert text.rstrip().splitlines()[-1].startswith("done: 600 documents, 12000 tokens, ")


def test_reprocessed_prefix_never_reuses_stale_indices(tmp_path):
    """The same prefix written again from the same documents by another tokenizer (the same
    number of documents, so the same .idx size; other lengths) under the same cache: the indices
    are rebuilt, equal to a build without cache, for a GPT and a blended dataset."""
    rng = np.random.default_rng(4)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_corpus(b, rng, 40)
    cache = str(tmp_path / "cache")
    sizes = set()
    for max_len in (50, 30):
        write_corpus(a, rng, 60, max_len)
        sizes.add(os.path.getsize(a + ".idx"))
        for path in ([a], ["0.6", a, "0.4", b]):
            cached = build_gpt_datasets(path, "90,10,0", 16, 5, (300, 10, 0), EOD, -1, cache)
            fresh = build_gpt_datasets(path, "90,10,0", 16, 5, (300, 10, 0), EOD, -1, None)
            for c, f in zip(cached[:2], fresh[:2]):
                assert len(c) == len(f)
                for i in (0, len(f) // 2, len(f) - 1):
                    np.testing.assert_array_equal(c[i]["tokens"], f[i]["tokens"])
    assert len(sizes) == 1 and len(os.listdir(cache)) > 0


def test_training_batches_checked_against_the_vocabulary(tmp_path):
    """A corpus with ids up to 999 read with a 600-id vocabulary: the loader names the dataset, the
    split, the sample and the id; in range, nothing is raised."""
    rng = np.random.default_rng(5)
    a = write_corpus(str(tmp_path / "a"), rng, 50)
    b = write_corpus(str(tmp_path / "b"), rng, 50, vocab=500)
    train = build_gpt_datasets([a], "1", 16, 1, (40, 0, 0), EOD, -1, None)[0]
    with pytest.raises(DataError, match=rf"sample \d+ of the train split of {a} \(from document "
                                        rf"\d+\) holds token id \d+, outside the vocabulary of 600"):
        next(iter(PretrainingDataLoader(train, 0, 2, 0, 1, vocab_size=600)))
    assert len(list(PretrainingDataLoader(train, 0, 2, 0, 1, vocab_size=1000))) == len(train) // 2
    blend = build_gpt_datasets(["0.5", b, "0.5", a], "1", 16, 1, (40, 0, 0), EOD, -1, None)[0]
    with pytest.raises(DataError, match=rf"blended sample \d+: sample \d+ of the train split of {a}"):
        list(PretrainingDataLoader(blend, 0, 2, 0, 1, vocab_size=600))


def test_small_corpus_splits(tmp_path):
    """A split asked for 0 samples is not built (the run goes on); one that is read but empty is
    named with the document count and a --split that works, which then builds."""
    rng = np.random.default_rng(6)
    a = write_corpus(str(tmp_path / "a"), rng, 40)
    train, valid, test = build_gpt_datasets([a], "969,30,1", 16, 1, (100, 10, 0), EOD, -1, None)
    assert len(train) >= 100 and len(valid) >= 10 and test is None
    with pytest.raises(DataError) as info:
        build_gpt_datasets([a], "969,30,1", 16, 1, (100, 10, 10), EOD, -1, str(tmp_path / "c"))
    message = str(info.value)
    assert message.startswith(f"the test split of {a} is empty: --split 969,30,1 gives it no "
                              f"document (0 tokens) of the 40 documents the data has; pass --split ")
    assert not (tmp_path / "c").exists()
    better = message.rsplit("--split ", 1)[1].rstrip(".")
    assert all(len(d) for d in build_gpt_datasets([a], better, 16, 1, (100, 10, 10), EOD, -1, None))


@pytest.mark.parametrize("seed", [0, 1])
def test_preprocess_ranges_split_lines_anywhere(tmp_path, monkeypatch, seed):
    """Pool workers take byte ranges of 64 bytes that cut lines anywhere (lines up to ~700 bytes
    span many ranges, blank lines, no newline at the end): the output equals one worker's
    byte for byte, spill files are deleted once copied, an error names the file's line, and the
    workers' spill folder is gone."""
    module = sys.modules["megatron_sp.data.preprocess"]
    monkeypatch.setattr(module, "BLOCK_BYTES", 64)
    monkeypatch.setattr(module, "MIN_BLOCK_BYTES", 64)
    monkeypatch.setattr(module, "SPILL_FILE_BYTES", 256)       # a new spill file every 256 bytes
    spill_files = []                                           # files present at each copy
    copied = module._SpillFiles.copied

    def spy(self, path):
        copied(self, path)
        spill_files.append(len(os.listdir(os.path.dirname(path))))
    monkeypatch.setattr(module._SpillFiles, "copied", spy)
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(300):
        if rng.random() < 0.1:
            lines.append("")
        else:
            ids = rng.integers(0, 1000, int(rng.integers(0, 150)))
            lines.append(json.dumps({"text": " ".join(map(str, ids))}))
    src = tmp_path / "ids.jsonl"
    src.write_text("\n".join(lines))                    # no newline after the last line
    out = {}
    for workers in (1, 2, 3):
        spill_files.clear()
        prefix = preprocess(str(src), str(tmp_path / f"w{workers}"), "NullTokenizer",
                            vocab_size=1000, append_eod=True, workers=workers,
                            log_interval=0)["text"]
        out[workers] = [open(prefix + ext, "rb").read() for ext in (".bin", ".idx")]
        # Copied spill files are deleted: at most the pool workers' current files and those of
        # the tasks in flight (4 per worker) exist at any copy, out of the dozens written.
        pool = workers - 1
        assert workers == 1 or (len(spill_files) > 20 and
                                max(spill_files) <= pool * (1 + 4 * workers) + 2), spill_files
    assert out[1] == out[2] == out[3] and len(out[1][0]) > 1000
    bad = int(rng.integers(150, 290))
    while not lines[bad - 1]:
        bad += 1
    lines[bad - 1] = json.dumps({"text": "1 2000 3"})
    src.write_text("\n".join(lines))
    with pytest.raises(DataError, match=rf"ids.jsonl:{bad}: token id 2000 is outside"):
        preprocess(str(src), str(tmp_path / "bad"), "NullTokenizer", vocab_size=1000, workers=2,
                   log_interval=0)
    assert sorted(os.listdir(tmp_path)) == sorted(["ids.jsonl"] + [
        f"w{w}_text_document{ext}" for w in (1, 2, 3) for ext in (".bin", ".idx")])


class _FakePool:
    """apply_async whose results turn ready only after `slow` ready() calls: deterministic
    stand-in for the pool, to see which tasks the writer encodes itself. `given` counts the tasks
    given to it."""

    def __init__(self, slow):
        self.slow, self.given = slow, 0

    def apply_async(self, fn, args):
        pool = self
        self.given += 1

        class Result:
            calls = 0

            def ready(self):
                self.calls += 1
                return self.calls > pool.slow

            def get(self):
                return fn(*args)
        return Result()


@pytest.mark.parametrize("seed", [0, 1])
def test_preprocess_writer_encodes_while_the_pool_is_behind(monkeypatch, seed):
    """With a pool that is behind, the writing process encodes the next tasks itself (no spill)
    and the results still come in task order; only while the oldest pool result is not ready,
    with at most pool_ahead tasks given to the pool and in_flight results held. An error in a
    task encoded here waits for its turn: an earlier error from the pool is the one raised."""
    module = sys.modules["megatron_sp.data.preprocess"]
    rng = np.random.default_rng(seed)
    n, pool_ahead = int(rng.integers(20, 40)), int(rng.integers(1, 4))
    in_flight = pool_ahead + int(rng.integers(1, 5))
    where, bad = {}, set()

    def fake_encode(task, spill=True):
        where[task] = "pool" if spill else "here"
        if task in bad:
            raise DataError(f"task {task}")
        return task
    monkeypatch.setattr(module, "encode_range", fake_encode)
    for slow in (0, 1, 3):
        where.clear()
        pool, written = _FakePool(slow), []
        for result in module._in_order(pool, range(n), pool_ahead, in_flight):
            here = sum(w == "here" for w in where.values())
            assert pool.given + here - len(written) <= in_flight     # results held, at most
            written.append(result)
        assert written == list(range(n)) and pool.given + here == n == len(where)
        here = sorted(t for t, w in where.items() if w == "here")
        assert here == [] if slow == 0 else len(here) > 0, (slow, here)
        # Nothing is encoded here before pool_ahead tasks have gone to the pool.
        assert all(t >= pool_ahead for t in here)
    # Task pool_ahead is the first encoded here, while task 0 is not ready: its error is kept
    # until the pool's earlier one (task pool_ahead - 1) has been raised.
    bad = {pool_ahead - 1, pool_ahead}
    where.clear()
    with pytest.raises(DataError, match=f"task {pool_ahead - 1}$"):
        list(module._in_order(_FakePool(3), range(n), pool_ahead, in_flight))
    assert where[pool_ahead] == "here"


# Issue 34: --split, damaged cache files, a corpus shorter than one sample ---------------------

@pytest.mark.parametrize("split, words", [
    ("0,0,0", "--split 0,0,0 gives every split a weight of 0; give the training split a positive "
              "weight"),
    ("98,-2,4", "--split 98,-2,4 gives a split the negative weight -2; weights must be 0 or more"),
    ("98,x,2", "--split 98,x,2: 'x' is not a number"),
    ("90,5,3,2", "--split 90,5,3,2 has 4 weights; give at most three"),
    ("nan,1,1", "--split nan,1,1: 'nan' is not a number"),
])
def test_split_refused_by_the_data_builder(tmp_path, split, words):
    """build_gpt_datasets itself (the library API) refuses what megatron-core's regex would
    misread ('98,-2,4' as 98,2,4) or divide by (0,0,0), before anything is built."""
    a = write_corpus(str(tmp_path / "a"), np.random.default_rng(8), 30)
    with pytest.raises(DataError) as info:
        build_gpt_datasets([a], split, 16, 1, (20, 0, 0), EOD, -1, str(tmp_path / "c"))
    message = str(info.value)
    assert message.startswith(words) and message.endswith(".") and "\n" not in message
    assert not (tmp_path / "c").exists()


def test_split_accepts_megatrons_separators(tmp_path):
    """Commas or slashes (Megatron-LM's get_train_valid_test_split_), missing weights are 0."""
    from megatron_sp.data.builder import parse_split, split_matrix
    assert parse_split("949/50/1") == parse_split("949, 50, 1") == [949.0, 50.0, 1.0]
    assert parse_split("1") == [1.0, 0.0, 0.0] and parse_split("98,2") == [98.0, 2.0, 0.0]
    assert parse_split("'99,1,0'") == [99.0, 1.0, 0.0]    # a launch script's quotes (unexpanded)
    assert split_matrix("80/20") == split_matrix("80,20,0")
    a = write_corpus(str(tmp_path / "a"), np.random.default_rng(9), 40)
    slash = build_gpt_datasets([a], "90/10/0", 16, 1, (50, 5, 0), EOD, -1, None)
    comma = build_gpt_datasets([a], "90,10,0", 16, 1, (50, 5, 0), EOD, -1, None)
    for s, c in zip(slash[:2], comma[:2]):
        np.testing.assert_array_equal(s.shuffle_index, c.shuffle_index)


def test_split_refused_by_pretrain_gpt_at_the_edge(tmp_path):
    """pretrain_gpt's load_job (before any model or process group): --split 0,0,0 and 0,100,0
    with training asked for are one sentence, not a TypeError at len(train_ds); 0,100,0 with
    --train-iters 0 is accepted."""
    from megatron_sp.errors import UserError
    from megatron_sp.testing import load_script
    pretrain_gpt = load_script("pretrain_gpt.py")
    a = write_corpus(str(tmp_path / "a"), np.random.default_rng(10), 30)
    base = ["--model", "gpt2-tiny", "--data-path", a, "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "1000", "--seq-length", "16", "--micro-batch-size", "2"]
    for split, iters, words in (
            ("0,0,0", "5", "--split 0,0,0 gives every split a weight of 0"),
            ("0,100,0", "5", "--split 0,100,0 gives the training split a weight of 0 (no "
                             "documents) but --train-iters 5 asks for training; give the first "
                             "weight a positive share (e.g. --split 969,30,1).")):
        with pytest.raises(UserError) as info:
            pretrain_gpt.load_job(base + ["--split", split, "--train-iters", iters])
        assert str(info.value).startswith(words) and "\n" not in str(info.value)
    job, _ = pretrain_gpt.load_job(base + ["--split", "0,100,0", "--train-iters", "0"])
    assert job.data.split_weights() == [0.0, 100.0, 0.0]


def _cached(cache, stem):
    return sorted(str(p) for p in cache.glob(f"*-{stem}-*.npy"))


@pytest.mark.parametrize("damage", ["object", "not-npy", "truncated", "header", "empty", "float",
                                    "shape", "short"])
def test_damaged_index_cache_names_the_file(tmp_path, damage):
    """A cached .npy replaced or cut short is never loaded (nor unpickled): one sentence names
    it and says what to delete; once deleted the indices are rebuilt, equal to a fresh build."""
    rng = np.random.default_rng(11)
    a = write_corpus(str(tmp_path / "a"), rng, 40)
    cache = tmp_path / "cache"
    args = ([a], "1", 16, 3, (60, 0, 0), EOD, -1, str(cache))
    fresh = build_gpt_datasets(*args[:-1], None)[0]
    build_gpt_datasets(*args)
    document, sample, shuffle = _cached(cache, "GPTDataset-train")
    target = {"float": sample, "shape": sample, "short": shuffle}.get(damage, document)
    data = open(target, "rb").read()
    if damage == "object":
        np.save(target, np.array([1, "x", None], dtype=object), allow_pickle=True)
    elif damage == "not-npy":
        open(target, "wb").write(b"not an array " * 20)
    elif damage in ("truncated", "header", "empty"):
        open(target, "wb").write(data[:{"truncated": len(data) - 8, "header": 40,
                                        "empty": 0}[damage]])
    elif damage == "float":
        np.save(target, np.load(target).astype(np.float64))
    elif damage == "shape":
        np.save(target, np.zeros((len(fresh) + 1, 3), np.int32))
    else:
        np.save(target, np.load(target)[:-1])
    with pytest.raises(DataError) as info:
        build_gpt_datasets(*args)
    message = str(info.value)
    stem = os.path.basename(target).rsplit("-", 1)[0] + "-*.npy"
    assert message.startswith(f"{target}: this cached dataset index cannot be used: ")
    assert message.endswith(f"; delete {os.path.join(str(cache), stem)} (or the whole cache "
                            f"folder {cache}) and run again to rebuild the indices.")
    assert "\n" not in message and "allow_pickle" not in message
    if damage in ("object", "not-npy"):
        assert "Python objects" in message or "unpickle" in message
    os.remove(target)
    again = build_gpt_datasets(*args)[0]
    np.testing.assert_array_equal(again.shuffle_index, fresh.shuffle_index)
    np.testing.assert_array_equal(again[len(fresh) - 1]["tokens"], fresh[len(fresh) - 1]["tokens"])


def test_damaged_blend_cache_names_the_file(tmp_path):
    """The blend's cached dataset index with another length, or naming a dataset the blend does
    not have: the file is named (not an IndexError at the first batch)."""
    rng = np.random.default_rng(12)
    a, b = (write_corpus(str(tmp_path / n), rng, 30) for n in "ab")
    cache = tmp_path / "cache"
    args = (["0.3", a, "0.7", b], "1", 16, 1, (40, 0, 0), EOD, -1, str(cache))
    build_gpt_datasets(*args)
    dataset_index = [p for p in _cached(cache, "BlendedDataset-train") if "-dataset_index" in p][0]
    original = np.load(dataset_index)
    for damaged, reason in ((original[:-1], f"its shape is ({len(original) - 1},), not "
                                            f"({len(original)},)"),
                            (np.full_like(original, 5), "it names datasets outside the blend's 2")):
        np.save(dataset_index, damaged)
        with pytest.raises(DataError, match=rf"^{dataset_index}: this cached dataset index cannot "
                                            rf"be used: {re.escape(reason)}"):
            build_gpt_datasets(*args)


def test_corpus_shorter_than_one_sample_is_said_once(tmp_path, capsys):
    """14 tokens and --seq-length 1024: one note from rank 0 (how often each document repeats in
    a sample and over the run, what to do); the samples are Megatron's all the same (the same as
    without the note), other ranks and a corpus longer than a sample say nothing."""
    tiny = str(tmp_path / "tiny")
    b = IndexedDatasetBuilder(tiny + ".bin", np.uint16)
    b.add_document(np.arange(1, 15) % EOD, [14])
    b.finalize(tiny + ".idx")
    notes = []
    train = build_gpt_datasets([tiny], "1", 1024, 1, (12, 0, 0), EOD, -1, None,
                               note=notes.append)[0]
    assert notes == [f"> note: the train split of {tiny} holds 14 tokens, fewer than one sample "
                     f"(--seq-length 1024 + 1 tokens): each of its documents repeats about 73 "
                     f"times in every sample, 878 times over the 12 samples asked of it; use more "
                     f"data or a shorter --seq-length."]
    assert len(train) >= 12 and list(train[0]["tokens"][:15]) == list(range(1, 15)) + [1]
    cache = str(tmp_path / "c")
    build_gpt_datasets([tiny], "1", 1024, 1, (12, 0, 0), EOD, -1, cache, note=notes.append)
    assert len(notes) == 2 and notes[0] == notes[1]
    other = build_gpt_datasets([tiny], "1", 1024, 1, (12, 0, 0), EOD, -1, cache, rank=1,
                               world_size=2)[0]        # memory-maps rank 0's indices, quietly
    assert capsys.readouterr().out == ""
    np.testing.assert_array_equal(other.shuffle_index, train.shuffle_index)
    a = write_corpus(str(tmp_path / "a"), np.random.default_rng(13), 40)
    build_gpt_datasets([a], "1", 16, 1, (12, 0, 0), EOD, -1, None)
    assert capsys.readouterr().out == ""
    build_gpt_datasets([tiny], "1", 1024, 1, (12, 0, 0), EOD, -1, None)     # default: print
    assert capsys.readouterr().out.startswith(f"> note: the train split of {tiny} holds 14 tokens")
