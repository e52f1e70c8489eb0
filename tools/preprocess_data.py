"""Tokenise a jsonl corpus into Megatron-LM .bin/.idx files (same flags and output names).

python tools/preprocess_data.py --input corpus.jsonl --output-prefix out/corpus \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 2
writes out/corpus_text_document.bin/.idx.
"""
import argparse
import os
import sys

try:
    from megatron_sp.data.preprocess import preprocess
except ImportError:  # running from a checkout that is not installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from data.preprocess import preprocess


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="jsonl file, one JSON object per line")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--append-eod", action="store_true")
    p.add_argument("--tokenizer-type", required=True,
                   choices=["SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                            "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer"])
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    p.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    p.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    p.add_argument("--dtype", choices=["uint16", "int32"], default=None,
                   help="token dtype of the .bin (default: uint16 when the vocabulary has fewer "
                        "than 65500 ids, else int32)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes that tokenize: this one and a pool of workers - 1")
    p.add_argument("--log-interval", type=int, default=10000)
    return p.parse_args(argv)


def main(argv=None):
    args = get_args(argv)
    try:
        prefixes = preprocess(args.input, args.output_prefix, args.tokenizer_type,
                              args.tokenizer_model, args.json_keys, args.append_eod, args.workers,
                              args.log_interval, args.vocab_size, dtype=args.dtype,
                              vocab_file=args.vocab_file, merge_file=args.merge_file)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for p in prefixes.values():
        print(f"wrote {p}.bin and {p}.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
