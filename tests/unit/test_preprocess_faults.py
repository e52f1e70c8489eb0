"""Preprocessing under faults (issue 26): stopped by SIGTERM, Ctrl-C or kill -9 with 2 workers,
empty and compressed inputs, a line over the bound, a full disk.

Nothing may be left behind (no output, no temporary file, no worker process); a killed run's
leftovers are removed by the next run with the same output prefix, with one note line. The
signalled runs tokenize slowly on purpose (1 ms per document, patched in the child) so that the
signal surely arrives while the pool workers are writing their spill files.
"""
import bz2
import errno
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron_sp.data import DataError, IndexedDataset, preprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")
SLOW_TOOL = ("import runpy, sys, time; import megatron_sp.data.tokenizers as t; "
             "orig = t.NullTokenizer.tokenize; "
             "t.NullTokenizer.tokenize = lambda self, text: (time.sleep(0.001), "
             "orig(self, text))[1]; sys.argv = sys.argv[1:]; "
             "runpy.run_path(sys.argv[0], run_name='__main__')")
FLAGS = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--append-eod"]
preprocess_module = sys.modules["megatron_sp.data.preprocess"]


def write_ids(path, rng, n, per_line=12):
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(map(str, rng.integers(0, 1000, per_line)))}) + "\n")


def tool(folder, *extra, slow=False):
    """tools/preprocess_data.py on folder/in.jsonl -> folder/o, 2 workers, its own session."""
    cmd = [sys.executable, *(["-c", SLOW_TOOL] if slow else []), TOOL, "--input",
           str(folder / "in.jsonl"), "--output-prefix", str(folder / "o"), "--workers", "2",
           *FLAGS, *extra]
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_SP_DEBUG"}
    return subprocess.Popen(cmd, cwd=folder, env={**env, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def temp_folder(folder, pid):
    return folder / f".preprocess.o.{pid}@{socket.gethostname()}"


def wait_until_spilling(proc, folder, limit_s=90):
    """Until a pool worker has written its first spill file (the run is in full flight)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        temp = temp_folder(folder, proc.pid)
        if temp.is_dir() and any(name.startswith("0.") for name in os.listdir(temp)):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    pytest.fail("the preprocessing never started spilling")


def group_gone(pgid, limit_s=20):
    """True once no process of the group is left (the workers ended with their parent)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    os.killpg(pgid, signal.SIGKILL)
    return False


def test_sigterm_ctrl_c_and_kill_9_leave_nothing_behind(tmp_path, seed):
    """SIGTERM (to the parent, as `kill PID` does): one error line, exit 1; Ctrl-C (SIGINT to the
    process group, as a terminal sends it): one line, exit 130, no KeyboardInterrupt traceback
    from any process; kill -9 of the group leaves its temporary folder, which the next run
    removes (one note), keeping what belongs to a live process; no worker survives its parent."""
    rng = np.random.default_rng(seed)
    folders = {name: tmp_path / name for name in ("term", "int", "kill")}
    for folder in folders.values():
        folder.mkdir()
        write_ids(str(folder / "in.jsonl"), rng, 6000)
    procs = {name: tool(folder, slow=True) for name, folder in folders.items()}
    for name, proc in procs.items():
        wait_until_spilling(proc, folders[name])
    os.kill(procs["term"].pid, signal.SIGTERM)
    os.killpg(procs["int"].pid, signal.SIGINT)
    os.killpg(procs["kill"].pid, signal.SIGKILL)
    results = {name: proc.communicate(timeout=120) for name, proc in procs.items()}

    term, interrupt = folders["term"], folders["int"]
    assert procs["term"].returncode == 1, results["term"]
    assert results["term"][1].splitlines() == [
        f"error: preprocessing of {term / 'in.jsonl'} was stopped by SIGTERM; nothing was "
        f"written under {term / 'o'}_* and the temporary files were removed."]
    assert procs["int"].returncode == 130, results["int"]
    assert results["int"][1].splitlines() == [
        f"interrupted: preprocessing of {interrupt / 'in.jsonl'} stopped; nothing was written "
        f"under {interrupt / 'o'}_* and the temporary files were removed."]
    for name in ("term", "int"):
        assert os.listdir(folders[name]) == ["in.jsonl"], name
        assert group_gone(procs[name].pid), f"{name}: a worker outlived its parent"

    killed, pid = folders["kill"], procs["kill"].pid
    assert procs["kill"].returncode == -signal.SIGKILL and group_gone(pid)
    assert temp_folder(killed, pid).is_dir()               # what kill -9 leaves ...
    (killed / f"o_text_document.bin.tmp{pid}").write_bytes(b"x" * 100)   # ... and older versions
    live = temp_folder(killed, os.getpid())                # a running process's: kept
    live.mkdir()
    rerun = tool(killed)
    out, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert notes == [f"note: removed what an earlier preprocessing run with this output prefix "
                     f"left when it was killed (pid {pid}, no longer running): "
                     f"{temp_folder(killed, pid)}, {killed / f'o_text_document.bin.tmp{pid}'}"]
    assert sorted(os.listdir(killed)) == sorted(["in.jsonl", live.name, "o_text_document.bin",
                                                 "o_text_document.idx"])
    assert len(IndexedDataset(str(killed / "o_text_document"))) == 6000
    live.rmdir()


def test_cli_refusals_are_one_line(tmp_path):
    """Exit 1 and one `error:` line (what, where, what to do), nothing written: an empty input, an
    all-blank one, a line over --max-line-bytes, a zstd input without the zstandard package (read
    when it is installed); --debug adds the traceback to the same line."""
    cases = {"empty": "", "blank": "\n  \n\n\t\n",
             "long": '{"text": "1 2"}\n{"text": "' + "7 " * 800 + '"}\n',
             "zstd": None}
    for name, text in cases.items():
        (tmp_path / name).mkdir()
        if text is not None:
            (tmp_path / name / "in.jsonl").write_text(text)
    try:
        import zstandard
        data = zstandard.ZstdCompressor().compress(b'{"text": "1 2 3"}\n')
    except ImportError:
        zstandard, data = None, b"\x28\xb5\x2f\xfd" + bytes(20)
    (tmp_path / "zstd" / "in.jsonl").write_bytes(data)
    (tmp_path / "debug").mkdir()
    (tmp_path / "debug" / "in.jsonl").write_text("")
    procs = {name: tool(tmp_path / name, *(["--max-line-bytes", "1000"] if name == "long" else []))
             for name in cases}
    procs["debug"] = tool(tmp_path / "debug", "--debug")
    results = {name: proc.communicate(timeout=120) for name, proc in procs.items()}
    src = {name: tmp_path / name / "in.jsonl" for name in procs}
    expected = {
        "empty": f"error: {src['empty']} holds no document (the file is empty or every line is "
                 f"blank); pass a jsonl file with one JSON object per line.",
        "blank": f"error: {src['blank']} holds no document (the file is empty or every line is "
                 f"blank); pass a jsonl file with one JSON object per line.",
        "long": f"error: {src['long']}:2: the line is 1612 bytes, longer than the bound of 1000 "
                f"bytes (--max-line-bytes); split that document or raise --max-line-bytes (a "
                f"line takes ~30x its size in memory while tokenized).",
        "zstd": f"error: {src['zstd']} is zstd-compressed but the zstandard package is not "
                f"installed; install it (pip install zstandard) or decompress the file first "
                f"(zstd -d).",
    }
    if zstandard is not None:
        assert procs["zstd"].returncode == 0, results["zstd"]
        assert "is zstd-compressed (its name does not end in .zst)" in results["zstd"][1]
        np.testing.assert_array_equal(IndexedDataset(str(tmp_path / "zstd" / "o_text_document"))[0],
                                      [1, 2, 3, 1000])
        del expected["zstd"]
    for name, line in expected.items():
        out, err = results[name]
        assert procs[name].returncode == 1 and err.splitlines() == [line], (name, err)
        assert os.listdir(tmp_path / name) == ["in.jsonl"], name
    out, err = results["debug"]
    assert procs["debug"].returncode == 1 and "Traceback (most recent call last)" in err
    assert err.strip().splitlines()[-1] == expected["empty"].replace("/empty/", "/debug/")


def test_compressed_inputs_are_read_by_their_bytes(tmp_path, seed):
    """gzip (named .gz or not: then a note names it), bzip2 give the plain file's output, byte for
    byte; a damaged gzip is refused by name; documents without text are refused."""
    rng = np.random.default_rng(seed)
    plain = tmp_path / "c.jsonl"
    write_ids(str(plain), rng, 500)
    raw = plain.read_bytes()
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "gzip-in-disguise.jsonl").write_bytes(gzip.compress(raw))
    (tmp_path / "c.jsonl.bz2").write_bytes(bz2.compress(raw))
    (tmp_path / "out").mkdir()
    common = dict(tokenizer_type="NullTokenizer", vocab_size=1000, append_eod=True,
                  log_interval=0)

    def run(name, workers=2, **kw):
        import io
        log = io.StringIO()
        preprocess(str(tmp_path / name), str(tmp_path / "out" / name), workers=workers, log=log,
                   **common, **kw)
        stem = str(tmp_path / "out" / f"{name}_text_document")
        with open(stem + ".bin", "rb") as b, open(stem + ".idx", "rb") as i:
            return b.read(), i.read(), log.getvalue()

    reference = run("c.jsonl")
    assert reference[2] == ""
    for name in ("c.jsonl.gz", "c.jsonl.bz2", "gzip-in-disguise.jsonl"):
        got = run(name)
        assert got[:2] == reference[:2], name
        disguised = name == "gzip-in-disguise.jsonl"
        assert (got[2] == f"note: {tmp_path / name} is gzip-compressed (its name does not end in "
                          f".gz): reading it decompressed.\n") == disguised, got[2]
    (tmp_path / "broken.jsonl.gz").write_bytes(gzip.compress(raw)[:len(raw) // 8])
    with pytest.raises(DataError, match=r"broken.jsonl.gz: the gzip data is damaged or incomplete "
                                        r"\(.*\); recompress it or pass the uncompressed file."):
        run("broken.jsonl.gz")
    (tmp_path / "void.jsonl").write_text('{"text": ""}\n' * 3)
    with pytest.raises(DataError, match=r"void.jsonl: all 3 documents are empty \(no text under "
                                        r"--json-keys text\)"):
        run("void.jsonl", workers=1)
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        f"{n}_text_document{ext}" for n in ("c.jsonl", "c.jsonl.gz", "c.jsonl.bz2",
                                            "gzip-in-disguise.jsonl") for ext in (".bin", ".idx"))


@pytest.mark.parametrize("workers", [1, 2])
def test_long_line_bounded(tmp_path, monkeypatch, workers, seed):
    """A 300 KB line (no newline inside, over many 4 KB tasks) under a 20 KB bound: refused with
    its file:line, and no process ever reads more than bound + one task at once (the line is
    never held whole); a 6 KB line under the bound is fine."""
    monkeypatch.setattr(preprocess_module, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(preprocess_module, "MIN_BLOCK_BYTES", 4096)
    reads = []
    read_block = preprocess_module._read_block
    monkeypatch.setattr(preprocess_module, "_read_block",
                        lambda offset, length: reads.append(length) or read_block(offset, length))
    rng = np.random.default_rng(seed)
    src = tmp_path / "long.jsonl"
    line = int(rng.integers(20, 40))
    write_ids(str(src), rng, line - 1)
    with open(src, "a") as f:
        f.write(json.dumps({"text": "5 " * 150_000}) + "\n")      # ~300 KB
    with open(src, "a") as f:
        f.write(json.dumps({"text": "6 " * 3000}) + "\n")
    common = dict(tokenizer_type="NullTokenizer", vocab_size=1000, workers=workers,
                  log_interval=0, max_line_bytes=20_000)
    with pytest.raises(DataError, match=rf"long.jsonl:{line}: the line is longer than the bound "
                                        rf"of 20000 bytes \(--max-line-bytes\)"):
        preprocess(str(src), str(tmp_path / "o"), **common)
    assert os.listdir(tmp_path) == ["long.jsonl"]
    if workers == 1:                  # the reads of this process (a pool worker's are not seen)
        assert max(reads) <= 20_000 + 4096, max(reads)
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "6 " * 3000}) + "\n")
    preprocess(str(short), str(tmp_path / "s"), **common)
    assert len(IndexedDataset(str(tmp_path / "s_text_document"))[0]) == 3000


def test_full_disk_while_finishing_leaves_nothing(tmp_path, monkeypatch):
    """No space left while the .idx is written (a fault-injecting writer): one sentence naming the
    file and the disk, no .bin/.idx under any name, the temporary folder gone."""
    indexed = sys.modules["megatron_sp.data.indexed_dataset"]
    write_index = indexed.write_index

    def full(path, *args):
        write_index(path, *args)
        raise OSError(errno.ENOSPC, "No space left on device", path)
    monkeypatch.setattr(indexed, "write_index", full)
    write_ids(str(tmp_path / "in.jsonl"), np.random.default_rng(2), 50)
    with pytest.raises(DataError, match=r"o_text_document.idx: No space left on device; nothing "
                                        r"was written under .*o_\* and the temporary files were "
                                        r"removed; free space there \(.* MB free now\) or pass "
                                        r"another --output-prefix."):
        preprocess(str(tmp_path / "in.jsonl"), str(tmp_path / "o"), "NullTokenizer",
                   vocab_size=1000, workers=2, log_interval=0)
    assert os.listdir(tmp_path) == ["in.jsonl"]
