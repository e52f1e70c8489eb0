"""Tokenizers with Megatron's names and ids: SentencePieceTokenizer, GPTSentencePieceTokenizer,
HuggingFaceTokenizer, GPT2BPETokenizer, NullTokenizer.

Each exposes .vocab_size (unpadded), .eod, .pad (-1 when the tokenizer has none), .tokenize(text)
and .detokenize(ids).
"""
import json
import os

EOD_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")
PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")


class NullTokenizer:
    """Megatron's NullTokenizer: text is space-separated ids; eod = vocab_size (N + 1 ids)."""

    def __init__(self, vocab_size):
        if vocab_size is None:
            raise ValueError("NullTokenizer needs vocab_size (Megatron's --vocab-size).")
        self.vocab_size = int(vocab_size) + 1
        self.eod = int(vocab_size)
        self.pad = -1

    def tokenize(self, text):
        try:
            return [int(x) for x in text.split()]
        except ValueError:
            bad = next(x for x in text.split() if not x.lstrip("+-").isdigit())
            raise ValueError(f"NullTokenizer text must be integer ids separated by spaces, "
                             f"found {bad[:40]!r}") from None

    def detokenize(self, ids):
        return " ".join(str(int(x)) for x in ids)


class GPTSentencePieceTokenizer:
    """Megatron's GPTSentencePieceTokenizer: a sentencepiece .model file as it is; vocab = its
    pieces, eod = its </s> (eos) id, pad = its pad id (or -1)."""

    def __init__(self, model_file):
        import sentencepiece as spm
        if not model_file or not os.path.isfile(model_file):
            raise ValueError(f"{model_file}: sentencepiece model not found; pass --tokenizer-model "
                             f"with the path of a .model file.")
        self.sp = spm.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self.sp.get_piece_size()
        self.eod = self.sp.eos_id()
        self.pad = self.sp.pad_id()
        if self.eod < 0:
            raise ValueError(f"{model_file}: the model has no </s> (eos) piece to use as eod; "
                             f"train it with eos_id set.")

    def tokenize(self, text):
        return self.sp.encode(text)

    def detokenize(self, ids):
        return self.sp.decode([int(i) for i in ids])


class SentencePieceTokenizer(GPTSentencePieceTokenizer):
    """Megatron's (legacy) SentencePieceTokenizer: the model's pieces followed by the special
    tokens <CLS>, <SEP>, <EOD>, <MASK> and the pad/bos/eos pieces (<PAD>, <BOS>, <EOS> when the model
    has none), each appended when not already a piece. eod = <EOD>; vocab_size counts the added
    tokens; special-token strings in the text map to their ids. The same ids as Megatron-LM, so
    .bin files preprocessed by either tool train in both."""

    def __init__(self, model_file):
        super().__init__(model_file)
        self.vocab = {self.sp.id_to_piece(i): i for i in range(self.sp.get_piece_size())}
        self.special = {}
        for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            self._add_special(token)
        for piece_id, fallback in ((self.sp.pad_id(), "<PAD>"), (self.sp.bos_id(), "<BOS>"),
                                   (self.sp.eos_id(), "<EOS>")):
            self._add_special(self.sp.id_to_piece(piece_id) if piece_id >= 0 else fallback)
        self.vocab_size = len(self.vocab)
        self.eod = self.vocab["<EOD>"]
        self.pad = self.vocab[self.sp.id_to_piece(self.sp.pad_id()) if self.sp.pad_id() >= 0
                              else "<PAD>"]
        self.inverse_special = {i: t for t, i in self.special.items()}

    def _add_special(self, token):
        self.vocab.setdefault(token, len(self.vocab))
        self.special[token] = self.vocab[token]

    def tokenize(self, text):
        """Pieces of the text between special-token strings, which map to their own ids."""
        ids, start = [], 0
        while True:
            found = [(text.find(t, start), t) for t in self.special if text.find(t, start) >= 0]
            if not found:
                break
            at, token = min(found)
            ids.extend(self.sp.encode(text[start:at]))
            ids.append(self.special[token])
            start = at + len(token)
        ids.extend(self.sp.encode(text[start:]))
        return ids

    def detokenize(self, ids):
        text, last = "", 0
        ids = [int(i) for i in ids]
        for k, i in enumerate(ids):
            if i in self.inverse_special:
                text += self.sp.decode(ids[last:k]) + " " + self.inverse_special[i] + " "
                last = k + 1
        return text + self.sp.decode(ids[last:])


REMOTE_CODE_FILES = ("tokenizer_config.json", "config.json")


def remote_code_file(folder):
    """The file of a Hugging Face folder that asks to run the folder's own Python code (an
    `auto_map` entry in tokenizer_config.json or config.json), or None."""
    for name in REMOTE_CODE_FILES:
        path = os.path.join(folder, name)
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):      # absent or unreadable: transformers says so itself
            continue
        if isinstance(config, dict) and config.get("auto_map"):
            return path
    return None


def load_auto_tokenizer(folder, trust_remote_code=False):
    """transformers.AutoTokenizer of a local folder; never asks a question: custom code in the
    folder (auto_map) runs only with trust_remote_code (--trust-remote-code), else a ValueError
    names the file that asks for it."""
    asking = remote_code_file(folder)
    if asking is not None and not trust_remote_code:
        raise ValueError(f"{asking} has an auto_map entry: loading this tokenizer would run Python "
                         f"code from {folder}; read that code and pass --trust-remote-code to "
                         f"allow it, or use a tokenizer folder without custom code.")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=bool(trust_remote_code))


class HuggingFaceTokenizer:
    """Megatron's HuggingFaceTokenizer: a Hugging Face tokenizer folder through
    transformers.AutoTokenizer (eod = its eos_token_id; text encoded with its special tokens, e.g.
    Llama's BOS, as Megatron does), or a bare `tokenizers` JSON file (eod found by name). A folder
    with custom code (auto_map) is refused unless trust_remote_code (`load_auto_tokenizer`)."""

    def __init__(self, path, trust_remote_code=False):
        if path and os.path.isdir(path):
            self._tok = load_auto_tokenizer(path, trust_remote_code)
            self._encode = lambda text: self._tok(text).input_ids
            vocab = self._tok.get_vocab()
            self.vocab_size = len(self._tok)
            self.eod = self._tok.eos_token_id
            self.pad = self._tok.pad_token_id
        elif path and os.path.isfile(path):
            from tokenizers import Tokenizer
            self._tok = Tokenizer.from_file(path)
            self._encode = lambda text: self._tok.encode(text).ids
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            self.eod = self.pad = None
        else:
            raise ValueError(f"{path}: no tokenizer JSON file or tokenizer folder there; pass "
                             f"--tokenizer-model with a tokenizer.json or a Hugging Face folder.")
        self._decode = self._tok.decode
        if self.eod is None:
            self.eod = next((vocab[n] for n in EOD_NAMES if n in vocab), None)
        if self.eod is None:
            raise ValueError(f"{path}: no eos token is configured and none of {EOD_NAMES} is in the "
                             f"vocabulary, so there is no end-of-document token; add one.")
        if self.pad is None:
            self.pad = next((vocab[n] for n in PAD_NAMES if n in vocab), -1)

    def tokenize(self, text):
        return list(self._encode(text))

    def detokenize(self, ids):
        return self._decode([int(i) for i in ids])


class GPT2BPETokenizer:
    """Megatron's GPT2BPETokenizer: GPT-2's byte-level BPE from --vocab-file (vocab.json) and
    --merge-file (merges.txt), run by the `tokenizers` library. The same ids as transformers'
    GPT-2 tokenizer built from the two files (Megatron-core wraps that one): no prefix space, and the
    text "<|endoftext|>" is one token, the eod; vocab_size = the vocabulary's entries; no pad."""

    EOD = "<|endoftext|>"

    def __init__(self, vocab_file, merge_file):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise ValueError(f"GPT2BPETokenizer needs {flag} with an existing file, got {path!r}.")
        self._tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        vocab = self._tok.get_vocab()
        if self.EOD not in vocab:
            raise ValueError(f"{vocab_file} has no {self.EOD} entry, GPT2BPETokenizer's end-of-document "
                             f"token; is it a GPT-2 vocab.json?")
        self._tok.add_special_tokens([self.EOD])   # already in the vocabulary: keeps its id
        self.vocab_size = len(vocab)
        self.eod = vocab[self.EOD]
        self.pad = -1

    def tokenize(self, text):
        return self._tok.encode(text).ids

    def detokenize(self, ids):
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def build_tokenizer(tokenizer_type, tokenizer_model=None, vocab_size=None, vocab_file=None,
                    merge_file=None, trust_remote_code=False):
    """Megatron's --tokenizer-type / --tokenizer-model / --vocab-size / --vocab-file / --merge-file
    (and --trust-remote-code, HuggingFaceTokenizer only) to a tokenizer object."""
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model, trust_remote_code)
    raise ValueError(f"unknown tokenizer type {tokenizer_type!r}; use SentencePieceTokenizer, "
                     f"GPTSentencePieceTokenizer, HuggingFaceTokenizer, GPT2BPETokenizer or "
                     f"NullTokenizer.")


MAX_SENTENCE_BYTES = 16384     # sentencepiece's max_sentence_length here: longer inputs are cut
NORMALIZATIONS = ("identity", "nmt_nfkc", "nfkc")


def _text_iterator(texts_or_files, keep_whitespace: bool = True):
    """Training inputs from a list of strings and/or paths of text files.

    keep_whitespace: each text in pieces of whole lines, newlines kept, at most MAX_SENTENCE_BYTES
    each (sentencepiece skips longer inputs), so the model learns "\n" and indentation; else one
    input per non-blank line (sentencepiece's classic line-per-sentence input)."""
    items = [texts_or_files] if isinstance(texts_or_files, str) else texts_or_files
    for item in items:
        if isinstance(item, str) and len(item) < 4096 and os.path.isfile(item):
            with open(item, encoding="utf-8") as f:
                text = f.read()
        else:
            text = str(item)
        if not keep_whitespace:
            yield from (line for line in text.splitlines() if line.strip())
            continue
        chunk, size = [], 0
        for line in text.splitlines(keepends=True):
            n = len(line.encode("utf-8"))
            if chunk and size + n > MAX_SENTENCE_BYTES:
                yield "".join(chunk)
                chunk, size = [], 0
            chunk.append(line[:MAX_SENTENCE_BYTES // 4] if n > MAX_SENTENCE_BYTES else line)
            size += min(n, MAX_SENTENCE_BYTES)
        if chunk and "".join(chunk).strip():
            yield "".join(chunk)


def train_sentencepiece(texts_or_files, model_prefix, vocab_size, model_type="unigram",
                        normalization="identity"):
    """Train a sentencepiece model (unk 0, bos 1, eos 2 = eod, pad 3, byte fallback).

    normalization "identity" (default) keeps the text as it is: no Unicode normalisation, runs of
    spaces, tabs and newlines kept ("\n" is a piece of its own, pieces of spaces alone allowed:
    code and man pages keep their lines and indentation); "nmt_nfkc" / "nfkc" are sentencepiece's
    rules (NFKC, whitespace collapsed, newlines become spaces). The vocabulary is a soft limit
    (hard_vocab_limit=False): a small corpus gives fewer pieces than asked. A unigram model's
    scores are rounded (data/sentencepiece_hf.py) so a Hugging Face export has the same ids.
    Written under a temporary prefix and renamed; returns the path of the .model file.
    """
    import sentencepiece as spm
    from .sentencepiece_hf import round_unigram_scores
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"unknown normalization {normalization!r}; use one of {NORMALIZATIONS}.")
    keep = normalization == "identity"
    whitespace = dict(remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
                      user_defined_symbols=["\n"], split_digits=False) if keep else {}
    tmp = f"{model_prefix}.tmp{os.getpid()}"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_text_iterator(texts_or_files, keep)), model_prefix=tmp,
        vocab_size=vocab_size, model_type=model_type, character_coverage=0.9995,
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=3, hard_vocab_limit=False,
        normalization_rule_name=normalization, max_sentence_length=MAX_SENTENCE_BYTES,
        input_sentence_size=200000, shuffle_input_sentence=True, num_threads=os.cpu_count() or 1,
        minloglevel=2, **whitespace)
    round_unigram_scores(tmp + ".model")
    os.replace(tmp + ".vocab", model_prefix + ".vocab")
    os.replace(tmp + ".model", model_prefix + ".model")
    return model_prefix + ".model"
