"""Data and tokenizer faults end in one `error:` line and exit 1 (issue 26): unreadable .idx,
.bin and data cache; a tokenizer folder that asks to run its own code (auto_map), which is never
asked about interactively and never trusted without --trust-remote-code.

Unreadable files: chmod 000 where that blocks reads; the tests run as root on the CI machine,
where it does not, so there every run goes through an entry that makes open() of the blocked
path fail as chmod 000 would (PermissionError, errno EACCES) and the checks are the same.
"""
import dataclasses
import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from megatron_sp.data import build_tokenizer, preprocess
from megatron_sp.testing import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AS_ROOT = os.geteuid() == 0          # chmod 000 does not stop root: inject the failure instead
ENTRY = """
import builtins, errno, os, runpy, sys
blocked = os.environ.get("BLOCK")
real_open = builtins.open
def guarded_open(file, *args, **kwargs):
    path = os.path.abspath(os.fspath(file)) if isinstance(file, (str, os.PathLike)) else ""
    if blocked and (path == blocked or path.startswith(blocked + os.sep)):
        raise PermissionError(errno.EACCES, "Permission denied", os.fspath(file))
    return real_open(file, *args, **kwargs)
builtins.open = guarded_open
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
TINY = ["--vocab-size", "1000", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "1", "--eval-iters", "0"]
WORDS = "the river stone light quick brown fox jumps over lazy dog data model token".split()


def run(script, args, block=None):
    """Popen of a repository script; `block`: a path made unreadable (chmod 000 / injected)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MEGATRON_SP_DEBUG")
           and not k.startswith(("SLURM_", "MEGATRON_SP_INJECT_"))}
    env["OMP_NUM_THREADS"] = "1"
    if block is not None and AS_ROOT:
        env["BLOCK"] = os.path.abspath(block)
    elif block is not None:
        os.chmod(block, 0)
    return subprocess.Popen([sys.executable, "-c", ENTRY, os.path.join(ROOT, script), *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def one_error_line(proc, limit_s=300):
    out, err = proc.communicate(timeout=limit_s)
    lines = [line for line in (out + err).splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(lines) == 1, (proc.returncode, err[-3000:])
    assert "Traceback" not in err and err.strip().splitlines()[-1] == lines[0], err[-3000:]
    return lines[0]


def hf_folder(path, auto_map_in=None):
    """A small Hugging Face tokenizer folder; `auto_map_in`: the config file that gets an
    auto_map entry (asking to run the folder's own code)."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<pad>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(str(path))
    if auto_map_in is not None:
        file = path / auto_map_in
        config = json.loads(file.read_text()) if file.exists() else {}
        config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
        file.write_text(json.dumps(config))
        (path / "tokenization_evil.py").write_text("raise SystemExit('custom code ran')\n")
    return path


def corpus(tmp_path, name):
    """A small NullTokenizer dataset under tmp_path/name; its prefix."""
    rng = np.random.default_rng(11)
    src = tmp_path / "c.jsonl"
    if not src.exists():
        with open(src, "w") as f:
            for _ in range(200):
                f.write(json.dumps({"text": " ".join(map(str, rng.integers(0, 1000, 30)))}) + "\n")
    (tmp_path / name).mkdir()
    preprocess(str(src), str(tmp_path / name / "c"), "NullTokenizer", vocab_size=1000,
               append_eod=True, log_interval=0)
    return str(tmp_path / name / "c_text_document")


def unreadable(path, monkeypatch):
    """Make `path` (a file or a folder and what is in it) unreadable in this process."""
    if not AS_ROOT:
        os.chmod(path, 0)
        return
    import builtins
    import errno
    real_open, blocked = builtins.open, os.path.abspath(path)

    def guarded_open(file, *args, **kwargs):
        name = os.path.abspath(os.fspath(file)) if isinstance(file, (str, os.PathLike)) else ""
        if name == blocked or name.startswith(blocked + os.sep):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(file))
        return real_open(file, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", guarded_open)


def test_unreadable_index_and_untrusted_tokenizer_end_the_scripts_with_one_line(tmp_path):
    """pretrain_gpt.py with an unreadable .idx; preprocess_data.py with a tokenizer folder that
    has auto_map: exit 1, one line each."""
    prefix = corpus(tmp_path, "idx")
    evil = hf_folder(tmp_path / "evil", "tokenizer_config.json")
    procs = {
        "idx": run("pretrain_gpt.py", ["--data-path", prefix, "--tokenizer-type", "NullTokenizer",
                                       *TINY], block=prefix + ".idx"),
        "remote code": run("tools/preprocess_data.py", [
            "--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "p"),
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(evil)]),
    }
    try:
        lines = {name: one_error_line(proc) for name, proc in procs.items()}
    finally:
        os.chmod(prefix + ".idx", stat.S_IRUSR | stat.S_IWUSR)
    path = prefix + ".idx"
    assert lines["idx"] == (f"error: {path}: Permission denied; make the data files readable by "
                            f"this user (chmod u+r {path}) or check --data-path."), lines["idx"]
    assert lines["remote code"] == (
        f"error: {evil / 'tokenizer_config.json'} has an auto_map entry: loading this tokenizer "
        f"would run Python code from {evil}; read that code and pass --trust-remote-code to allow "
        f"it, or use a tokenizer folder without custom code.")
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl", "evil", "idx"]


@pytest.mark.parametrize("what", ["bin", "cache"])
def test_unreadable_bin_or_cache_is_one_sentence(tmp_path, monkeypatch, what):
    """What pretrain_gpt's build_datasets raises (a DataError: one line, exit 1, as above) for an
    unreadable .bin or data cache folder: the file, the flag, what to do."""
    from megatron_sp.data import DataError, build_gpt_datasets
    from megatron_sp.data.builder import os_errors_named
    prefix = corpus(tmp_path, what)
    cache = tmp_path / "indices"
    cache.mkdir()
    unreadable(prefix + ".bin" if what == "bin" else str(cache), monkeypatch)
    try:
        with pytest.raises(DataError) as info, os_errors_named(str(cache)):
            build_gpt_datasets([prefix], "1", 32, 1, (10, 0, 0), 1000, -1, str(cache))
    finally:
        monkeypatch.undo()
        os.chmod(prefix + ".bin" if what == "bin" else str(cache), stat.S_IRWXU)
    message = str(info.value)
    if what == "bin":
        path = prefix + ".bin"
        assert message == (f"{path}: Permission denied; make the data files readable by this "
                           f"user (chmod u+r {path}) or check --data-path.")
    else:
        assert message.startswith(f"{cache}{os.sep}") and message.endswith(
            f": Permission denied (the data cache, --data-cache-path {cache}); make that folder "
            f"readable and writable by this user (chmod -R u+rwX {cache}) or pass another "
            f"--data-cache-path."), message


def test_trust_remote_code_only_when_given(tmp_path, monkeypatch, capsys):
    """auto_map in tokenizer_config.json or config.json is refused by name (build_tokenizer,
    convert.py); transformers is always called with an explicit trust_remote_code (False unless
    --trust-remote-code: so it never asks), and the flag reaches DataConfig and pretrain_gpt's
    tokenizer."""
    from transformers import AutoTokenizer
    from megatron_sp.cli.build import parse_job
    from megatron_sp.data import DataError
    plain = hf_folder(tmp_path / "plain")
    in_config = hf_folder(tmp_path / "in_config", "config.json")
    in_tok = hf_folder(tmp_path / "in_tok", "tokenizer_config.json")
    ok = build_tokenizer("HuggingFaceTokenizer", str(plain))
    assert ok.tokenize("quick fox") and ok.eod == 2
    for folder, file in ((in_config, "config.json"), (in_tok, "tokenizer_config.json")):
        with pytest.raises(ValueError, match=rf"^{folder / file} has an auto_map entry.*"
                                             rf"pass --trust-remote-code"):
            build_tokenizer("HuggingFaceTokenizer", str(folder))
    convert = load_script("tools/checkpoint/convert.py")
    with pytest.raises(convert.ConversionError, match=rf"^{in_tok / 'tokenizer_config.json'} has "
                                                      rf"an auto_map entry"):
        convert._hf_tokenizer(str(in_tok))
    missing = ["--loader", "megatron_sp", "--saver", "hf", "--load-dir", str(tmp_path / "none"),
               "--save-dir", str(tmp_path / "export")]
    for debug in ([], ["--debug"]):          # convert.py's --debug keeps the traceback
        with pytest.raises(SystemExit, match="holds no checkpoint"):
            convert.main(missing + debug)
        assert ("Traceback (most recent call last)" in capsys.readouterr().err) == bool(debug)
    calls = []
    real = AutoTokenizer.from_pretrained.__func__

    def recorded(cls, path, **kwargs):
        calls.append((os.path.basename(path), kwargs.get("trust_remote_code")))
        return real(cls, str(plain))        # the custom code itself is not run here
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(recorded))
    build_tokenizer("HuggingFaceTokenizer", str(plain))
    build_tokenizer("HuggingFaceTokenizer", str(in_tok), trust_remote_code=True)
    assert calls == [("plain", False), ("in_tok", True)]
    assert parse_job(["--mock-data", "--trust-remote-code"]).data.trust_remote_code is True
    assert parse_job(["--mock-data"]).data.trust_remote_code is False
    pretrain_gpt = load_script("pretrain_gpt.py")        # the flag reaches the tokenizer
    job = parse_job(["--data-path", "x", "--tokenizer-type", "HuggingFaceTokenizer",
                     "--tokenizer-model", str(in_tok)])
    with pytest.raises(DataError, match="has an auto_map entry"):
        pretrain_gpt.build_tokenizer(job, None)
    build_tokenizer_of = pretrain_gpt.build_tokenizer
    build_tokenizer_of(dataclasses.replace(job, data=dataclasses.replace(
        job.data, trust_remote_code=True)), None)
    assert calls[-1] == ("in_tok", True)
