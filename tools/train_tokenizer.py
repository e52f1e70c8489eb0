"""Train a sentencepiece tokenizer on the same jsonl that tools/preprocess_data.py reads.

python tools/train_tokenizer.py --input corpus.jsonl --json-keys text --vocab-size 32000 \
    --output-prefix tok --tokenizer-type GPTSentencePieceTokenizer
writes tok.model (and tok.vocab), then prints the preprocessing command that uses it, runnable as
printed: one tools/preprocess_data.py command per --input file (it takes one), with the same
--json-keys, the --tokenizer-type and the model just written, and --workers (given here, or 4 at
most: the processes that tokenize), paths quoted for the shell.

Megatron-friendly defaults: byte fallback (no <unk> for unseen characters), ids unk 0, bos 1,
eos 2 (the end-of-document token of GPTSentencePieceTokenizer), pad 3. SentencePieceTokenizer
appends Megatron's <CLS> <SEP> <EOD> <MASK> when it loads the model, as Megatron-LM does, so the same
.model serves both types.

Whitespace is kept by default (--normalization identity): no Unicode normalisation, no collapsing
of spaces, "\n" a piece of its own, pieces of spaces alone allowed, so a model trained on code or
man pages sees and writes line breaks and indentation. --normalization nmt_nfkc is sentencepiece's
default (NFKC, runs of whitespace and newlines become one space).

The vocabulary is a soft limit: on a small corpus sentencepiece finds fewer pieces than asked
(its unigram trainer prunes from the corpus's frequent substrings, and a small corpus has fewer of
them; BPE stops when no pair occurs twice), says how many and why, and keeps what it found.
"""
import argparse
import json
import os
import shlex
import sys

try:
    from megatron_sp.data.tokenizers import NORMALIZATIONS, train_sentencepiece
except ImportError:  # running from a checkout that is not installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from data.tokenizers import NORMALIZATIONS, train_sentencepiece

TYPES = ("GPTSentencePieceTokenizer", "SentencePieceTokenizer")


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", required=True, nargs="+", help="jsonl file(s), one JSON object per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys whose text is trained on")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=32000, help="pieces in the vocabulary")
    p.add_argument("--model-type", choices=["unigram", "bpe"], default="unigram",
                   help="sentencepiece algorithm")
    p.add_argument("--normalization", choices=NORMALIZATIONS, default="identity",
                   help="identity keeps the text as it is (newlines, tabs, runs of spaces); "
                        "nmt_nfkc / nfkc: sentencepiece's NFKC rules, whitespace collapsed")
    p.add_argument("--tokenizer-type", choices=TYPES, default="GPTSentencePieceTokenizer",
                   help="the --tokenizer-type you will preprocess and train with")
    p.add_argument("--workers", type=int, default=None,
                   help="--workers of the printed tools/preprocess_data.py command (default: the "
                        "cores here, 4 at most); sentencepiece trains on every core")
    return p.parse_args(argv)


COMPRESSED = (".gz", ".bz2", ".xz", ".zst")


def corpus_prefix(path: str) -> str:
    """corpus.jsonl(.gz) -> corpus: the --output-prefix the preprocessing command writes under."""
    root, ext = os.path.splitext(path)
    return os.path.splitext(root)[0] if ext in COMPRESSED else root


def next_commands(args, model: str) -> list[str]:
    """The tools/preprocess_data.py command for each --input (it takes one file), as the shell
    runs it from here: this run's --json-keys, --tokenizer-type, the new model and --workers."""
    tool = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preprocess_data.py")
    if not os.path.relpath(tool).startswith(os.pardir):   # under the current folder: shorter
        tool = os.path.relpath(tool)
    workers = args.workers if args.workers is not None else min(4, os.cpu_count() or 1)
    return [shlex.join(["python", tool, "--input", path, "--output-prefix", corpus_prefix(path),
                        "--json-keys", *args.json_keys, "--append-eod",
                        "--tokenizer-type", args.tokenizer_type, "--tokenizer-model", model,
                        "--workers", str(workers)])
            for path in args.input]


def jsonl_texts(paths, keys):
    """The text under each of `keys` in every line of every jsonl file; bad lines name file:line."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number} is not valid JSON ({err.msg}); fix or "
                                     f"remove that line.") from None
                for key in keys:
                    if key not in record:
                        raise ValueError(f"{path}:{number} has no key {key!r}; pass the keys your "
                                         f"records have with --json-keys.")
                    yield str(record[key])


def main(argv=None):
    args = get_args(argv)
    if args.workers is not None and args.workers < 1:
        print(f"error: --workers {args.workers}: give 1 or more processes.", file=sys.stderr)
        return 1
    for path in args.input:
        if not os.path.isfile(path):
            print(f"error: --input {path} does not exist.", file=sys.stderr)
            return 1
    folder = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(folder):
        print(f"error: the folder of --output-prefix ({folder}) does not exist; create it first.",
              file=sys.stderr)
        return 1
    try:
        documents = chars = 0
        for text in jsonl_texts(args.input, args.json_keys):   # validates every line
            documents, chars = documents + 1, chars + len(text)
        model = train_sentencepiece(jsonl_texts(args.input, args.json_keys), args.output_prefix,
                                    args.vocab_size, model_type=args.model_type,
                                    normalization=args.normalization)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    import sentencepiece as spm
    size = spm.SentencePieceProcessor(model_file=model).get_piece_size()
    print(f"wrote {model} ({size} pieces, trained on {documents} texts, {chars:,} characters, "
          f"normalization {args.normalization})")
    if size < args.vocab_size:    # sentencepiece's "Vocabulary size is smaller than required"
        print(f"note: {size} pieces, not the {args.vocab_size} asked: the corpus ({chars:,} "
              f"characters) is too small to hold more distinct {args.model_type} pieces; "
              f"sentencepiece keeps those it found (hard_vocab_limit=False). More text gives more.")
    for command in next_commands(args, model):
        print(f"next: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
