"""Tokenise a jsonl corpus into Megatron-LM .bin/.idx files (same flags and output names).

python tools/preprocess_data.py --input corpus.jsonl --output-prefix out/corpus \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 2
writes out/corpus_text_document.bin/.idx. The input may be compressed (.gz, .bz2, .xz, and .zst
when the zstandard package is installed): it is recognised by its first bytes, whatever its name.

A mistake (a bad line, a missing file, an empty input) ends with one `error:` line and exit 1
(`--debug` adds the traceback); Ctrl-C with one line and exit 130, SIGTERM with one line and exit
1. Nothing is left behind: no output under the final names, no temporary file.
"""
import argparse
import os
import sys

try:
    from megatron_sp.data.preprocess import MAX_LINE_BYTES, preprocess
    from megatron_sp.errors import DataError
    from megatron_sp.reporting import run_main
except ImportError:  # running from a checkout that is not installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from data.preprocess import MAX_LINE_BYTES, preprocess
    from megatron_sp.errors import DataError
    from megatron_sp.reporting import run_main


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True,
                   help="jsonl file, one JSON object per line (may be .gz/.bz2/.xz/.zst)")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--append-eod", action="store_true")
    p.add_argument("--tokenizer-type", required=True,
                   choices=["SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                            "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer"])
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--trust-remote-code", action="store_true",
                   help="HuggingFaceTokenizer: allow a tokenizer folder whose config has auto_map "
                        "to run its own Python code (never asked, refused without this flag)")
    p.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    p.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    p.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    p.add_argument("--dtype", choices=["uint16", "int32"], default=None,
                   help="token dtype of the .bin (default: uint16 when the vocabulary has fewer "
                        "than 65500 ids, else int32)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes that tokenize: this one and a pool of workers - 1")
    p.add_argument("--max-line-bytes", type=int, default=MAX_LINE_BYTES,
                   help=f"longest input line (one document) accepted, in bytes (default "
                        f"{MAX_LINE_BYTES >> 20} MiB; 0: no bound); tokenizing a line takes "
                        f"about 30x its size in memory, per worker")
    p.add_argument("--log-interval", type=int, default=10000)
    p.add_argument("--debug", action="store_true",
                   help="print the Python traceback with an error message (also "
                        "MEGATRON_SP_DEBUG=1)")
    return p.parse_args(argv)


def main(argv=None):
    args = get_args(argv)
    try:
        prefixes = preprocess(args.input, args.output_prefix, args.tokenizer_type,
                              args.tokenizer_model, args.json_keys, args.append_eod, args.workers,
                              args.log_interval, args.vocab_size, dtype=args.dtype,
                              vocab_file=args.vocab_file, merge_file=args.merge_file,
                              max_line_bytes=args.max_line_bytes,
                              trust_remote_code=args.trust_remote_code)
    except KeyboardInterrupt:
        print(f"interrupted: preprocessing of {args.input} stopped; nothing was written under "
              f"{args.output_prefix}_* and the temporary files were removed.", file=sys.stderr,
              flush=True)
        raise SystemExit(130) from None
    except ValueError as err:    # a tokenizer's or a flag's message (DataError is one too)
        raise DataError(str(err)) from err
    for p in prefixes.values():
        print(f"wrote {p}.bin and {p}.idx")
    return 0


if __name__ == "__main__":
    run_main(main)   # user errors in one line (--debug: with the traceback), exit 1 (errors.py)
