"""The embedded default corpus: Python's own documentation, tokenised once and cached.

Sources, all in every Python installation: pydoc_data.topics (the language reference topics) and
the docstrings of the standard library's source files (read with ast, nothing is imported).
"""
import ast
import json
import os
import sysconfig

from .preprocess import preprocess
from .tokenizers import train_sentencepiece

MAX_BYTES = 3_000_000
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "ensurepip",
             "turtledemo", "__pycache__", "tkinter"}


def _source_files(root):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def _docstrings(path):
    """Module docstring plus class/function docstrings of one source file, as one text."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return ""
    nodes = [tree] + [n for n in ast.walk(tree)
                      if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    return "\n\n".join(d for d in (ast.get_docstring(n) for n in nodes) if d and len(d) > 40)


def default_documents(max_bytes=MAX_BYTES):
    """Deterministic list of documents (str), about max_bytes of text in all."""
    from pydoc_data.topics import topics
    docs = [topics[k] for k in sorted(topics)]
    total = sum(len(d) for d in docs)
    for path in _source_files(sysconfig.get_paths()["stdlib"]):
        if total >= max_bytes:
            break
        text = _docstrings(path)
        if text:
            docs.append(text)
            total += len(text)
    return docs


def _default_corpus_paths(cache_dir, vocab_size):
    """(output prefix, data prefix, tokenizer model) of the default corpus under cache_dir."""
    out_prefix = os.path.join(cache_dir, f"stdlib_docs_sp{vocab_size}")
    return out_prefix, out_prefix + "_text_document", out_prefix + ".model"


def default_corpus_ready(cache_dir, vocab_size=2048) -> bool:
    """True when the default corpus under cache_dir is complete (nothing to build)."""
    _, data_prefix, model = _default_corpus_paths(cache_dir, vocab_size)
    return all(os.path.isfile(p) for p in (model, data_prefix + ".bin", data_prefix + ".idx"))


def default_corpus_files(cache_dir, vocab_size=2048):
    """(data_prefix, tokenizer_model_path) the default corpus has under cache_dir, built or not."""
    _, data_prefix, model = _default_corpus_paths(cache_dir, vocab_size)
    return data_prefix, model


def build_default_corpus(cache_dir, vocab_size=2048):
    """(data_prefix, tokenizer_model_path) of the default corpus under cache_dir, built once.

    Every file is written under a temporary name and renamed, so an interrupted build is redone.
    """
    os.makedirs(cache_dir, exist_ok=True)
    out_prefix, data_prefix, model = _default_corpus_paths(cache_dir, vocab_size)
    model_prefix = out_prefix
    if default_corpus_ready(cache_dir, vocab_size):
        return data_prefix, model
    docs = default_documents()
    jsonl = os.path.join(cache_dir, "stdlib_docs.jsonl")
    tmp = f"{jsonl}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        os.replace(tmp, jsonl)
    finally:                        # an error or Ctrl-C leaves no partial file
        if os.path.exists(tmp):
            os.remove(tmp)
    if not os.path.isfile(model):
        train_sentencepiece(docs, model_prefix, vocab_size)
    preprocess(jsonl, out_prefix, "GPTSentencePieceTokenizer", model, append_eod=True,
               workers=min(4, os.cpu_count() or 1), log_interval=0)
    return data_prefix, model
