#!/usr/bin/env python
"""Convert checkpoints between Hugging Face (GPT-2, Llama, Mistral, Qwen2/2.5, Qwen3) and megatron_sp.

    python tools/checkpoint/convert.py --loader hf --saver megatron_sp \
        --load-dir ./Llama-3.2-1B --save-dir ./ckpt/llama-1b        # then --load (any layout)
    python tools/checkpoint/convert.py --loader megatron_sp --saver hf \
        --load-dir ./ckpt/run1 --save-dir ./hf-export                 # GPT2LMHeadModel / LlamaForCausalLM
    python tools/checkpoint/convert.py --loader megatron_sp --saver safetensors \
        --load-dir ./ckpt/run1 --save-dir ./export                    # one model.safetensors, our names

HF checkpoints are read from safetensors (or pytorch_model.bin with torch.load(weights_only=True));
nothing is downloaded. A megatron_sp checkpoint written here is a "release" checkpoint (weights only,
iteration 0): train from it with `pretrain_gpt.py --load DIR` (any tp/sp/pp/dp; optionally
--finetune), or load it in Python with `megatron_sp.load_pretrained(DIR)`.

Export picks the family from the model (qk-norm: qwen3; q/k/v bias only: qwen2; a sliding window:
mistral; else llama; GPT-2 shapes: gpt2) unless --hf-family names one, and writes what the family
needs in config.json (rope_parameters with llama3 / yarn scaling, head_dim, tie_word_embeddings).
With --tokenizer-model (a Hugging Face tokenizer folder) the export also holds the tokenizer and
config.json its bos/eos/pad ids.

The name and layout mapping is in megatron_sp/models/families.py.
"""
from __future__ import annotations

import argparse
import os
import sys

from megatron_sp.models.families import (ConversionError, FAMILIES, full_tensors,  # noqa: F401
                                        family_flags, hf_to_megatron_sp, megatron_sp_to_hf,
                                        model_from_full,
                                        read_hf_folder, token_ids_of, write_hf_folder)

build_model_from_full = model_from_full


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
                              tokenizer_model: str | None = None):
    """Write a HF folder of the family; with a HF tokenizer folder, the tokenizer and its ids too."""
    from megatron_sp import load_pretrained
    model = load_pretrained(load_dir)
    tokenizer = _hf_tokenizer(tokenizer_model) if tokenizer_model else None
    hf_config, state = megatron_sp_to_hf(model.config, full_tensors(model), family,
                                         token_ids_of(tokenizer) if tokenizer else None)
    write_hf_folder(save_dir, hf_config, state)
    if tokenizer is not None:
        tokenizer.save_pretrained(save_dir)
    return hf_config


def _hf_tokenizer(path: str):
    if not os.path.isdir(path):
        raise ConversionError(f"--tokenizer-model {path} is not a Hugging Face tokenizer folder.")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--model-type", default="GPT", help="Megatron's flag; only GPT")
    p.add_argument("--loader", required=True, choices=["hf", "megatron_sp"])
    p.add_argument("--saver", required=True, choices=["megatron_sp", "hf", "safetensors"])
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--hf-family", default="auto", choices=("auto",) + FAMILIES,
                   help="--saver hf: the Hugging Face model_type to write (auto: from the model)")
    p.add_argument("--tokenizer-model", default=None,
                   help="--saver hf: a Hugging Face tokenizer folder, saved with the model and its "
                        "bos/eos/pad ids written into config.json")
    a = p.parse_args(argv)
    from megatron_sp.checkpointing import CheckpointError
    try:
        if a.loader == "hf" and a.saver == "megatron_sp":
            config = convert_hf_to_megatron_sp(a.load_dir, a.save_dir)
        elif a.loader == "megatron_sp" and a.saver == "hf":
            hf = convert_megatron_sp_to_hf(a.load_dir, a.save_dir, a.hf_family, a.tokenizer_model)
            print(f"> wrote a {hf['model_type']} model ({hf['architectures'][0]})")
            config = None
        elif a.loader == "megatron_sp" and a.saver == "safetensors":
            from megatron_sp.checkpointing import export_safetensors
            path = export_safetensors(a.load_dir, os.path.join(a.save_dir, "model.safetensors"))
            print(f"> wrote {path}")
            return
        else:
            raise ConversionError(f"--loader {a.loader} --saver {a.saver} is not a supported pair.")
    except (ConversionError, CheckpointError) as err:
        raise SystemExit(f"error: {err}") from None
    print(f"> converted {a.load_dir} ({a.loader}) -> {a.save_dir} ({a.saver})")
    if config is not None:
        from megatron_sp.models.config import config_to_flags
        print(f"> fine-tune it with: --load {a.save_dir} --finetune --use-checkpoint-args "
              f"(model flags, stored in the checkpoint: {' '.join(config_to_flags(config))})")


if __name__ == "__main__":
    sys.exit(main())
