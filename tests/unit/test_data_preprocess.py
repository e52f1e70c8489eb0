"""Preprocessing: real sentencepiece model, workers, Megatron's output names, bad input."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_sp.data import IndexedDataset, build_tokenizer, preprocess, train_sentencepiece

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = "the river stone light quick brown fox jumps over lazy dog data model token".split()


def write_jsonl(path, rng, n, bad_line=None):
    texts = []
    with open(path, "w") as f:
        for i in range(1, n + 1):
            text = " ".join(rng.choice(WORDS, int(rng.integers(0, 40))))
            texts.append(text)
            if i == bad_line:
                f.write('{"text": "unterminated\n')
            else:
                f.write(json.dumps({"text": text, "title": f"doc {i}"}) + "\n")
    return texts


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory, base_seed):
    d = tmp_path_factory.mktemp("sp")
    texts = write_jsonl(str(d / "train.jsonl"), np.random.default_rng([base_seed, 5]), 800)
    return train_sentencepiece(texts, str(d / "sp"), 400)


def test_sentencepiece_tokenizer(sp_model):
    tok = build_tokenizer("GPTSentencePieceTokenizer", sp_model)
    assert 260 < tok.vocab_size <= 400 and tok.eod == 2 and tok.pad == 3
    ids = tok.tokenize("the quick brown fox")
    assert ids and max(ids) < tok.vocab_size and tok.detokenize(ids) == "the quick brown fox"
    null = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (null.vocab_size, null.eod, null.pad) == (101, 100, -1)
    assert null.tokenize("3 4  17") == [3, 4, 17] and null.detokenize([3, 4]) == "3 4"
    with pytest.raises(ValueError, match="unknown tokenizer type"):
        build_tokenizer("Bogus")


def test_sentencepiece_tokenizers_have_megatrons_ids(sp_model):
    """Megatron's SentencePieceTokenizer appends <CLS>, <SEP>, <EOD>, <MASK> after the pieces (the
    model's pad/bos/eos pieces exist, so nothing more); GPTSentencePieceTokenizer uses the model as
    it is (eod = </s>)."""
    gpt = build_tokenizer("GPTSentencePieceTokenizer", sp_model)
    legacy = build_tokenizer("SentencePieceTokenizer", sp_model)
    n = gpt.vocab_size
    assert (gpt.eod, gpt.pad) == (2, 3)
    assert legacy.vocab_size == n + 4 and legacy.eod == n + 2 and legacy.pad == 3
    assert legacy.special == {"<CLS>": n, "<SEP>": n + 1, "<EOD>": n + 2, "<MASK>": n + 3,
                              "<pad>": 3, "<s>": 1, "</s>": 2}
    ids = legacy.tokenize("quick fox<EOD>lazy dog")
    assert ids == gpt.tokenize("quick fox") + [n + 2] + gpt.tokenize("lazy dog")
    assert legacy.detokenize(ids) == "quick fox <EOD> lazy dog"


def test_huggingface_tokenizer(tmp_path):
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<pad>", "</s>"])
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    tok.save(str(tmp_path / "tok.json"))
    ours = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tok.json"))
    assert (ours.eod, ours.pad) == (2, 1) and ours.vocab_size == tok.get_vocab_size()
    assert ours.tokenize("quick fox") == tok.encode("quick fox").ids


def test_preprocess_workers_and_megatron_layout(sp_model, tmp_path, seed, monkeypatch):
    """1, 2 and 3 workers write the same files, byte for byte, with two json keys; blocks of 2 KB,
    so the main process encodes some blocks itself between the pool's."""
    module = sys.modules["megatron_sp.data.preprocess"]
    monkeypatch.setattr(module, "BLOCK_BYTES", 2048)
    monkeypatch.setattr(module, "MIN_BLOCK_BYTES", 2048)
    here = []
    encoded_here = module._EncodedHere.__init__
    monkeypatch.setattr(module._EncodedHere, "__init__",
                        lambda self, task: (here.append(task), encoded_here(self, task))[1])
    rng = np.random.default_rng(seed)
    texts = write_jsonl(str(tmp_path / "in.jsonl"), rng, 1500)
    tok = build_tokenizer("SentencePieceTokenizer", sp_model)
    outs = {}
    for workers in (1, 2, 3):
        outs[workers] = preprocess(str(tmp_path / "in.jsonl"), str(tmp_path / f"w{workers}"),
                                   "SentencePieceTokenizer", sp_model, ("text", "title"),
                                   append_eod=True, workers=workers, log_interval=500,
                                   log=open(os.devnull, "w"))
    assert outs[1]["text"] == str(tmp_path / "w1_text_document")
    assert here, "the main process encoded no block itself"
    for key in ("text", "title"):
        for ext in (".bin", ".idx"):
            one = open(outs[1][key] + ext, "rb").read()
            assert one == open(outs[2][key] + ext, "rb").read() == open(outs[3][key] + ext, "rb").read()
    ds = IndexedDataset(outs[2]["text"])
    assert ds.dtype == np.uint16 and len(ds.document_indices) == len(texts) + 1
    seq = 0
    for doc, text in enumerate(texts):
        n_seq = ds.document_indices[doc + 1] - ds.document_indices[doc]
        if text == "":
            assert n_seq == 0       # an empty text is a document without sequences, as Megatron
            continue
        assert n_seq == 1
        np.testing.assert_array_equal(ds[seq], tok.tokenize(text) + [tok.eod])
        seq += 1


def test_bad_line_reported_and_nothing_left(sp_model, tmp_path, seed):
    rng = np.random.default_rng(seed)
    bad = int(rng.integers(300, 900))
    write_jsonl(str(tmp_path / "bad.jsonl"), rng, 1000, bad_line=bad)
    for workers in (1, 2):
        with pytest.raises(ValueError, match=rf"bad.jsonl:{bad}: not valid JSON"):
            preprocess(str(tmp_path / "bad.jsonl"), str(tmp_path / "out"),
                       "SentencePieceTokenizer", sp_model, workers=workers, log_interval=0)
        assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]
    with pytest.raises(ValueError, match="no string field 'body'"):
        write_jsonl(str(tmp_path / "ok.jsonl"), rng, 5)
        preprocess(str(tmp_path / "ok.jsonl"), str(tmp_path / "o"), "NullTokenizer",
                   json_keys=("body",), vocab_size=10)


def test_cli_int32_and_error_message(tmp_path):
    with open(tmp_path / "ids.jsonl", "w") as f:
        for i in range(50):
            f.write(json.dumps({"text": " ".join(str(x) for x in range(i, i + 70000, 7000))}) + "\n")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input",
           str(tmp_path / "ids.jsonl"), "--output-prefix", str(tmp_path / "ids"),
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "80000", "--append-eod",
           "--workers", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    ds = IndexedDataset(str(tmp_path / "ids_text_document"))
    assert ds.dtype == np.int32
    np.testing.assert_array_equal(ds[3], list(range(3, 70003, 7000)) + [80000])
    (tmp_path / "broken.jsonl").write_text('{"text": "1 2"}\n[1, 2\n')
    cmd[3] = str(tmp_path / "broken.jsonl")
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 1 and "broken.jsonl:2: not valid JSON" in run.stderr
    assert "Traceback" not in run.stderr
