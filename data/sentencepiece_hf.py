"""A sentencepiece .model as a Hugging Face tokenizer with the same ids (the `tokenizers` library's
tokenizer.json, loaded by transformers.AutoTokenizer).

    tok = hf_tokenizer_from_sentencepiece("tok.model")        # a PreTrainedTokenizerFast
    save_hf_tokenizer(tok, "hf-out")                        # tokenizer.json, tokenizer_config.json
    AutoTokenizer.from_pretrained("hf-out")("NAME\\n  ls").input_ids == sp.encode("NAME\\n  ls")

The tokenizer.json follows the model's own settings, as SentencePieceProcessor.encode runs them:
- normalizer: the precompiled character map (nmt_nfkc / nfkc; none for identity), the removal of
  extra spaces when the model was trained with it, the dummy prefix (a space before the text), and
  spaces escaped as U+2581 "▁";
- pre-tokenizer: the user-defined pieces (e.g. "\\n" from tools/train_tokenizer.py) isolated, as
  sentencepiece always emits them whole;
- model: Unigram with the pieces' scores, or BPE whose merges are ranked by the merged piece's score
  (sentencepiece's BPE merges the adjacent pair whose result scores highest); byte fallback as
  trained. Control, byte and unknown pieces get a score no path prefers, because sentencepiece never
  matches them against text ("<0x0A>" or "<s>" typed in a text stay characters);
- decoder: "▁" back to spaces, byte pieces back to bytes, the dummy prefix removed.

Ties: a unigram Viterbi can meet two segmentations of equal score (runs of spaces: "▁▁▁▁" +
"▁▁▁▁▁▁▁▁" or the reverse). sentencepiece sums scores in float32, `tokenizers` in float64, so a tie
that rounding breaks one way in one may break the other way in the other. Scores that are multiples
of 1/64 sum exactly in both (below 2**18 in magnitude), so both break every tie the same way (the
first start position wins); `train_sentencepiece` rounds a unigram model's scores so
(`round_unigram_scores`). BPE compares single scores and has no such ties.

Special tokens: bos "<s>", eos "</s>", unk "<unk>", pad "<pad>" (those the model has); with
`split_special_tokens` set, a text that contains "<s>" is encoded as sentencepiece does (as
characters), and no BOS is added: the ids are those of Megatron's GPTSentencePieceTokenizer, which
the model was trained on. `megatron_specials=True` appends Megatron's <CLS> <SEP> <EOD> <MASK>
(and <PAD>/<BOS>/<EOS> where the model has none) as SentencePieceTokenizer does, eos = <EOD>.
"""
from __future__ import annotations

import os
import re

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6   # ModelProto piece types
UNIGRAM, BPE = 1, 2
SCORE_STEP = 1 / 64          # unigram scores on this grid sum exactly in float32 and float64


def read_model_proto(model_file: str):
    """The sentencepiece ModelProto of a .model file; a file that is not one is a ValueError."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    if not os.path.isfile(model_file):
        raise ValueError(f"{model_file}: sentencepiece model not found.")
    proto = pb.ModelProto()
    with open(model_file, "rb") as f:
        data = f.read()
    try:
        proto.ParseFromString(data)
    except Exception:   # google.protobuf.message.DecodeError
        raise ValueError(f"{model_file} is not a sentencepiece .model file.") from None
    if not proto.pieces:
        raise ValueError(f"{model_file} is not a sentencepiece .model file (no pieces).")
    return proto


def round_unigram_scores(model_file: str) -> None:
    """Round a unigram model's piece scores to multiples of SCORE_STEP, in place (a temporary file
    renamed), so that sentencepiece and `tokenizers` break Viterbi ties alike (module docstring)."""
    proto = read_model_proto(model_file)
    if proto.trainer_spec.model_type != UNIGRAM:
        return
    for piece in proto.pieces:
        if piece.type == NORMAL:
            piece.score = round(piece.score / SCORE_STEP) * SCORE_STEP
    tmp = f"{model_file}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(proto.SerializeToString())
    os.replace(tmp, model_file)


def _model(proto):
    """The `tokenizers` model (Unigram or BPE) of the proto's pieces, with the same ids."""
    from tokenizers import models
    spec = proto.trainer_spec
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    if spec.model_type == UNIGRAM:
        never = min(s for _, s, t in pieces if t == NORMAL) - 1e4   # below every real path
        vocab = [(p, s if t in (NORMAL, USER_DEFINED) else never) for p, s, t in pieces]
        return models.Unigram(vocab, unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)
    if spec.model_type != BPE:
        raise ValueError(f"sentencepiece model type {spec.model_type} (char/word) has no Hugging "
                         f"Face equivalent here; train a unigram or bpe model.")
    normal = {p: (s, i) for i, (p, s, t) in enumerate(pieces) if t == NORMAL}
    ranked = sorted((-s, i, p[:k], p[k:]) for p, (s, i) in normal.items()
                    for k in range(1, len(p)) if p[:k] in normal and p[k:] in normal)
    return models.BPE({p: i for i, (p, _, _) in enumerate(pieces)},
                      [(left, right) for _, _, left, right in ranked],
                      unk_token=spec.unk_piece, fuse_unk=True, byte_fallback=spec.byte_fallback,
                      ignore_merges=False)


def sentencepiece_to_tokenizers(model_file: str):
    """A `tokenizers.Tokenizer` that encodes and decodes like the sentencepiece model."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    proto = read_model_proto(model_file)
    spec = proto.normalizer_spec
    tok = Tokenizer(_model(proto))
    steps = []
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:      # spaces only, as sentencepiece
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""),
                  normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.add_dummy_prefix:
        steps.append(normalizers.Prepend(" "))
    if spec.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    user = sorted((p.piece for p in proto.pieces if p.type == USER_DEFINED), key=len, reverse=True)
    if user:
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("|".join(re.escape(u) for u in user)),
                                                 behavior="isolated")
    steps = [decoders.Replace("\u2581", " ")]
    if proto.trainer_spec.byte_fallback:
        steps.append(decoders.ByteFallback())
    steps.append(decoders.Fuse())
    if spec.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def hf_tokenizer_from_sentencepiece(model_file: str, megatron_specials: bool = False,
                                    model_max_length: int | None = None):
    """A transformers PreTrainedTokenizerFast with the sentencepiece model's ids and its
    bos/eos/unk/pad tokens (Megatron's appended specials with `megatron_specials`)."""
    from transformers import PreTrainedTokenizerFast
    proto = read_model_proto(model_file)
    tok = sentencepiece_to_tokenizers(model_file)
    spec = proto.trainer_spec
    names = {"bos_token": spec.bos_id, "eos_token": spec.eos_id, "unk_token": spec.unk_id,
             "pad_token": spec.pad_id}
    special = {k: proto.pieces[i].piece for k, i in names.items() if 0 <= i < len(proto.pieces)}
    if megatron_specials:
        from tokenizers import AddedToken
        pieces = {p.piece for p in proto.pieces}
        added = ["<CLS>", "<SEP>", "<EOD>", "<MASK>"]
        added += [special.get(k, fallback) for k, fallback in
                  (("pad_token", "<PAD>"), ("bos_token", "<BOS>"), ("eos_token", "<EOS>"))]
        new = [t for i, t in enumerate(added) if t not in pieces and t not in added[:i]]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in new])
        special.update(eos_token="<EOD>", pad_token=special.get("pad_token", "<PAD>"))
    extra = {"model_max_length": model_max_length} if model_max_length else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                   split_special_tokens=not megatron_specials, **special, **extra)


def save_hf_tokenizer(tokenizer, folder: str) -> None:
    """save_pretrained, with tokenizer_config.json naming PreTrainedTokenizerFast (transformers 5
    writes its TokenizersBackend, which transformers 4 cannot load; both load the former)."""
    import json
    tokenizer.save_pretrained(folder)
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    os.replace(path + ".tmp", path)
