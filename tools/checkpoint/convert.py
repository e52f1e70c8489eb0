#!/usr/bin/env python
"""Convert checkpoints between Hugging Face (GPT-2, Llama, Mistral, Qwen2/2.5, Qwen3) and megatron_sp.

    python tools/checkpoint/convert.py --loader hf --saver megatron_sp \
        --load-dir ./Llama-3.2-1B --save-dir ./ckpt/llama-1b        # then --load (any layout)
    python tools/checkpoint/convert.py --loader megatron_sp --saver hf \
        --load-dir ./ckpt/run1 --save-dir ./hf-export                 # GPT2LMHeadModel / LlamaForCausalLM
    python tools/checkpoint/convert.py --loader megatron_sp --saver safetensors \
        --load-dir ./ckpt/run1 --save-dir ./export                    # one model.safetensors, our names
    python tools/checkpoint/convert.py --loader megatron --saver hf \
        --load-dir ./megatron-run --save-dir ./hf-export    # Megatron-LM torch_dist / torch
    python tools/checkpoint/convert.py --loader megatron_sp --saver megatron \
        --ckpt-format torch_dist --target-tensor-parallel-size 2 \
        --load-dir ./ckpt/run1 --save-dir ./back-to-megatron  # megatron-core loads it strictly

Megatron-LM checkpoints (--loader megatron, also core / legacy) are read without Megatron-LM
installed, at whatever tp x pp they were saved with, their sizes from the stored arguments; the
formats are in docs/checkpoints.md and megatron_sp/checkpointing/megatron_lm/.

HF checkpoints are read from safetensors (or pytorch_model.bin with torch.load(weights_only=True));
nothing is downloaded. A megatron_sp checkpoint written here is a converted checkpoint (Megatron's
"release": weights only, iteration 0): train from it with `pretrain_gpt.py --load DIR` (any
tp/sp/pp/dp; optionally --finetune), or load it in Python with `megatron_sp.load_pretrained(DIR)`.

Export picks the family from the model (qk-norm: qwen3; q/k/v bias only: qwen2; a sliding window:
mistral; else llama; GPT-2 shapes: gpt2) unless --hf-family names one, and writes what the family
needs in config.json (rope_parameters with llama3 / yarn scaling, head_dim, tie_word_embeddings).
The export holds the tokenizer the training run recorded in the checkpoint (or --tokenizer-model:
a sentencepiece .model, written as a tokenizer.json that AutoTokenizer loads with sentencepiece's
ids, or a Hugging Face tokenizer folder) and config.json its bos/eos/pad ids. Exported files get
the user's umask.

A conversion never writes into a folder that holds a training run's checkpoints (iter_* folders,
a tracker naming an iteration): refused in one sentence. It holds the run lock of --save-dir while
it writes, so a run cannot start into it meanwhile (megatron_sp/checkpointing/lock.py).

The name and layout mapping is in megatron_sp/models/families.py.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

from megatron_sp.checkpointing.lock import conversion_target
from megatron_sp.reporting import debug_requested

from megatron_sp.models.families import (ConversionError, FAMILIES, full_tensors,  # noqa: F401
                                        hf_to_megatron_sp, megatron_sp_to_hf,
                                        model_from_full,
                                        read_hf_folder, token_ids_of, write_hf_folder)

build_model_from_full = model_from_full
MEGATRON_LOADERS = ("megatron", "core", "legacy")   # Megatron-LM's checkpoints, either format


# Entry points ---------------------------------------------------------------------------------------

def convert_hf_to_megatron_sp(load_dir: str, save_dir: str):
    from megatron_sp import checkpointing
    from megatron_sp.mesh import ParallelMesh
    hf_config, state = read_hf_folder(load_dir)
    config, full = hf_to_megatron_sp(hf_config, state)
    model = build_model_from_full(config, full)
    checkpointing.save_checkpoint(save_dir, checkpointing.RELEASE, [model], ParallelMesh.single(),
                                  config=config)
    return config


def convert_megatron_sp_to_hf(load_dir: str, save_dir: str, family: str = "auto",
                              tokenizer_model: str | None = None, trust_remote_code: bool = False,
                              tokenizer_type: str | None = None):
    """Write a HF folder of the family with the tokenizer (`_export_tokenizer`) and its ids."""
    from megatron_sp import load_pretrained
    from megatron_sp.models.families import stale_hf_files
    stale = stale_hf_files(save_dir)
    if stale:   # a loader would read them beside (or instead of) the new model.safetensors
        raise ConversionError(
            f"--save-dir {save_dir} holds another Hugging Face model's files that a loader would "
            f"read beside the export ({', '.join(stale[:4])}{', ...' if len(stale) > 4 else ''}): "
            f"choose a new or empty --save-dir, or move those files away first.")
    model = load_pretrained(load_dir)
    _note_capacity(model.config)
    tokenizer = _export_tokenizer(load_dir, tokenizer_model, tokenizer_type, trust_remote_code,
                                  model.config.max_position_embeddings)
    hf_config, state = megatron_sp_to_hf(model.config, full_tensors(model), family,
                                         token_ids_of(tokenizer) if tokenizer else None)
    write_hf_folder(save_dir, hf_config, state)
    if getattr(tokenizer, "built_here", False):   # a tokenizer.json made from our files
        from megatron_sp.data.sentencepiece_hf import save_hf_tokenizer
        save_hf_tokenizer(tokenizer, save_dir)
    elif tokenizer is not None:
        tokenizer.save_pretrained(save_dir)
    return hf_config


def _note_capacity(config) -> None:
    """Say that an export routes every token where training dropped tokens over capacity."""
    factor = getattr(config, "moe_expert_capacity_factor", None)
    if getattr(config, "num_experts", None) and factor is not None:
        print(f"> note: the model was trained with --moe-expert-capacity-factor {factor:g} "
              f"(tokens over an expert's capacity dropped); Hugging Face's models route every "
              f"token to its top-k experts, so the export's outputs differ from training's "
              f"wherever tokens were dropped.")


def _recorded_tokenizer(load_dir: str) -> dict:
    """The tokenizer flags the training run recorded in its checkpoint's args ({} for a converted
    checkpoint, which records none)."""
    from megatron_sp.checkpointing import read_meta, resolve_checkpoint
    folder = resolve_checkpoint(load_dir) if os.path.isdir(load_dir) else None
    args = (read_meta(folder).get("args") or {}) if folder else {}
    return {k: args.get(k) for k in ("tokenizer_type", "tokenizer_model", "vocab_file",
                                     "merge_file")}


def _export_tokenizer(load_dir: str, path: str | None, kind: str | None, trust_remote_code: bool,
                      max_length: int):
    """The transformers tokenizer saved with the export: --tokenizer-model (with --tokenizer-type),
    else the one the training run recorded in the checkpoint; None (said) when there is none.

    A sentencepiece .model becomes a tokenizer.json with the same ids (megatron_sp.data.
    sentencepiece_hf); a Hugging Face folder is saved as it is; GPT2BPETokenizer's vocab.json and
    merges.txt become GPT-2's fast tokenizer."""
    from megatron_sp.data.sentencepiece_hf import hf_tokenizer_from_sentencepiece
    recorded, source = {}, "--tokenizer-model"
    if path is None:
        recorded, source = _recorded_tokenizer(load_dir), "recorded in the checkpoint"
        path, kind = recorded["tokenizer_model"], kind or recorded["tokenizer_type"]
    if kind == "GPT2BPETokenizer" and recorded.get("vocab_file"):
        from transformers import PreTrainedTokenizerFast
        from megatron_sp.data import build_tokenizer
        try:
            ours = build_tokenizer(kind, vocab_file=recorded["vocab_file"],
                                   merge_file=recorded["merge_file"])
        except ValueError as err:
            raise ConversionError(f"the checkpoint's GPT2BPETokenizer: {err}") from None
        eod = "<|endoftext|>"
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=ours._tok, bos_token=eod,
                                            eos_token=eod, unk_token=eod,
                                            clean_up_tokenization_spaces=False)
        tokenizer.built_here = True      # saved naming PreTrainedTokenizerFast
        print(f"> tokenizer: GPT2BPETokenizer {recorded['vocab_file']} ({source})")
        return tokenizer
    if path is None or kind == "NullTokenizer":
        print("> no tokenizer exported: " + ("the checkpoint's run used the NullTokenizer"
              if kind == "NullTokenizer" else "the checkpoint records none (a converted "
              "checkpoint)") + "; pass --tokenizer-model (a sentencepiece .model or a Hugging "
              "Face tokenizer folder) to export one.")
        return None
    if not os.path.exists(path):
        raise ConversionError(f"the tokenizer {path} ({source}) does not exist; run from the "
                              f"folder the training ran in or pass --tokenizer-model PATH.")
    if os.path.isdir(path) or kind == "HuggingFaceTokenizer":
        tokenizer = _hf_tokenizer(path, trust_remote_code)
    else:
        try:
            tokenizer = hf_tokenizer_from_sentencepiece(
                path, megatron_specials=kind == "SentencePieceTokenizer",
                model_max_length=max_length)
            tokenizer.built_here = True
        except ValueError as err:
            raise ConversionError(f"the tokenizer {path} ({source}): {str(err).rstrip('.')}; "
                                  f"pass a sentencepiece .model or a Hugging Face tokenizer "
                                  f"folder.") from None
    print(f"> tokenizer: {kind or 'sentencepiece'} {path} ({source}): bos "
          f"{tokenizer.bos_token_id}, eos {tokenizer.eos_token_id}, pad {tokenizer.pad_token_id}")
    return tokenizer


def _hf_tokenizer(path: str, trust_remote_code: bool = False):
    """The folder's tokenizer; custom code (auto_map) only with --trust-remote-code, never asked."""
    from megatron_sp.data.tokenizers import load_auto_tokenizer
    if not os.path.isdir(path):
        raise ConversionError(f"--tokenizer-model {path} is not a Hugging Face tokenizer folder.")
    try:
        return load_auto_tokenizer(path, trust_remote_code)
    except ValueError as err:
        raise ConversionError(str(err)) from err


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--model-type", default="GPT", help="Megatron's flag; only GPT")
    p.add_argument("--loader", required=True, choices=["hf", "megatron_sp", *MEGATRON_LOADERS],
                   help="megatron (also Megatron-LM's names core, legacy): a Megatron-LM save or "
                        "iteration folder, torch_dist or torch, any tp x pp")
    p.add_argument("--saver", required=True, choices=["megatron_sp", "hf", "safetensors",
                                                      "megatron"])
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--hf-family", default="auto", choices=("auto",) + FAMILIES,
                   help="--saver hf: the Hugging Face model_type to write (auto: from the model)")
    p.add_argument("--tokenizer-model", default=None,
                   help="--saver hf: a sentencepiece .model (exported as a tokenizer.json with "
                        "the same ids) or a Hugging Face tokenizer folder, saved with the model "
                        "and its bos/eos/pad ids written into config.json (default: the tokenizer "
                        "the training run recorded in the checkpoint)")
    p.add_argument("--tokenizer-type", default=None,
                   choices=["GPTSentencePieceTokenizer", "SentencePieceTokenizer",
                            "HuggingFaceTokenizer"],
                   help="--saver hf: the type of --tokenizer-model (SentencePieceTokenizer adds "
                        "Megatron's <CLS> <SEP> <EOD> <MASK>, eos <EOD>)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="--tokenizer-model: allow a tokenizer folder whose config has auto_map to "
                        "run its own Python code (never asked; refused without this flag)")
    p.add_argument("--ckpt-format", default="torch_dist", choices=["torch_dist", "torch"],
                   help="--saver megatron: Megatron-LM's checkpoint format")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1,
                   help="--saver megatron: the tp the checkpoint is written for (torch: one file "
                        "per rank; torch_dist: only the stored arguments)")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1,
                   help="--saver megatron: the pp the checkpoint is written for")
    p.add_argument("--transformer-impl", default="transformer_engine",
                   choices=["transformer_engine", "local"],
                   help="--saver megatron: the spec of the Megatron-LM run that loads it (its "
                        "_extra_state entries; torch format: the norms' names)")
    p.add_argument("--debug", action="store_true",
                   help="print the Python traceback with an error message (also "
                        "MEGATRON_SP_DEBUG=1)")
    a = p.parse_args(argv)
    from megatron_sp.checkpointing import CheckpointError
    try:
        with conversion_target(a.save_dir):   # never into a run's folder; the run lock is ours
            config = _convert(a)
    except (ConversionError, CheckpointError) as err:
        if debug_requested(argv):
            traceback.print_exc()
        raise SystemExit(f"error: {err}") from None
    if config is False:
        return
    print(f"> converted {a.load_dir} ({a.loader}) -> {a.save_dir} ({a.saver})")
    if config is not None:
        from megatron_sp.cli.model_flags import config_to_flags
        print(f"> fine-tune it with: --load {a.save_dir} --finetune --use-checkpoint-args "
              f"(model flags, stored in the checkpoint: {' '.join(config_to_flags(config))})")


def _convert(a):
    """Run the --loader / --saver pair: the config of a megatron_sp checkpoint written, None for
    an export, False when the saver printed its own closing line."""
    if a.loader == "hf" and a.saver == "megatron_sp":
        config = convert_hf_to_megatron_sp(a.load_dir, a.save_dir)
    elif a.loader == "megatron_sp" and a.saver == "hf":
        hf = convert_megatron_sp_to_hf(a.load_dir, a.save_dir, a.hf_family, a.tokenizer_model,
                                       a.trust_remote_code, a.tokenizer_type)
        print(f"> wrote a {hf['model_type']} model ({hf['architectures'][0]})")
        config = None
    elif a.loader == "megatron_sp" and a.saver == "safetensors":
        from megatron_sp.checkpointing import export_safetensors
        path = export_safetensors(a.load_dir, os.path.join(a.save_dir, "model.safetensors"))
        print(f"> wrote {path}")
        return False
    elif a.loader in MEGATRON_LOADERS or a.saver == "megatron":
        return _convert_megatron_lm(a)
    else:
        raise ConversionError(f"--loader {a.loader} --saver {a.saver} is not a supported pair.")
    return config


def _convert_megatron_lm(a):
    """--loader megatron (core, legacy) and --saver megatron (in
    megatron_sp/cli/megatron_checkpoints.py)."""
    from megatron_sp.cli import megatron_checkpoints as mlm
    if a.saver == "megatron":
        if a.loader not in ("megatron_sp",) + MEGATRON_LOADERS:
            raise ConversionError(f"--saver megatron reads --loader megatron_sp (a checkpoint, an "
                                  f"export or a Hugging Face folder) or megatron, not {a.loader}.")
        folder = mlm.to_megatron(a.load_dir, a.save_dir, loader=a.loader, ckpt_format=a.ckpt_format,
                                 tp=a.target_tensor_parallel_size,
                                 pp=a.target_pipeline_parallel_size,
                                 transformer_impl=a.transformer_impl)
        print(f"> wrote {folder} ({a.ckpt_format}, tp {a.target_tensor_parallel_size} x pp "
              f"{a.target_pipeline_parallel_size}); load it in Megatron-LM with "
              f"{mlm.load_flags(folder, a.ckpt_format)}")
        return False
    if a.saver == "megatron_sp":
        return mlm.megatron_to_megatron_sp(a.load_dir, a.save_dir)
    if a.saver == "safetensors":
        out = os.path.join(a.save_dir, "model.safetensors")
        print(f"> wrote {mlm.megatron_to_safetensors(a.load_dir, out)}")
        return False
    tokenizer = None
    if a.tokenizer_model is not None:
        tokenizer = _export_tokenizer(a.load_dir, a.tokenizer_model, a.tokenizer_type,
                                      a.trust_remote_code, 1 << 30)
    else:
        recorded = mlm.recorded_tokenizer(a.load_dir).get("tokenizer_model")
        print("> no tokenizer exported: pass --tokenizer-model" + (
            f" (the run recorded {recorded})" if recorded else "") + " to export one.")
    hf = mlm.megatron_to_hf(a.load_dir, a.save_dir, a.hf_family, tokenizer)
    if getattr(tokenizer, "built_here", False):
        from megatron_sp.data.sentencepiece_hf import save_hf_tokenizer
        save_hf_tokenizer(tokenizer, a.save_dir)
    elif tokenizer is not None:
        tokenizer.save_pretrained(a.save_dir)
    print(f"> wrote a {hf['model_type']} model ({hf['architectures'][0]})")
    return None


if __name__ == "__main__":
    sys.exit(main())
