"""Packaging for megatron-sp.

Three import names from three folders: megatron_sp (the parallel core), megatron_sp.models (models/)
and megatron_sp.data (data/). torch is required but never replaced: a torch that is already importable
satisfies ">=2.4"; on a machine without one, install the build you want first (README).
"""
from setuptools import find_packages, setup


def _sub(folder):
    """The package suffixes of a folder: '' for itself, then '.x', '.x.y' for the packages under it."""
    return [""] + ["." + p for p in find_packages(where=folder)]


setup(
    name="megatron-sp",
    version="0.1.0",
    description="Pretrain GPT models at million-token contexts with tensor, Ulysses sequence, "
                "pipeline and data parallelism on one device mesh.",
    python_requires=">=3.10",
    # Found, not listed: every package under megatron_sp/, plus models/ and data/ installed as
    # megatron_sp.models and megatron_sp.data (a hand-written list missed megatron_sp.moe once).
    packages=(find_packages(include=["megatron_sp", "megatron_sp.*"])
              + [f"megatron_sp.models{p}" for p in _sub("models")]
              + [f"megatron_sp.data{p}" for p in _sub("data")]),
    package_dir={"megatron_sp.models": "models", "megatron_sp.data": "data"},
    install_requires=["torch>=2.4", "numpy", "sentencepiece", "tqdm",
                      "protobuf",  # sentencepiece's model file: scores rounded, export (data/)
                      "xxhash"],   # checkpoint checksums (XXH3); CRC-32 without it
    extras_require={
        # Test-only: megatron-core is the reference for dataset indices, transformers for conversion.
        "test": ["pytest", "pytest-timeout", "megatron-core==0.16.1", "transformers>=4.40",
                 "tokenizers", "safetensors", "tensorboard",
                 "trl", "accelerate", "datasets",   # megatron_sp.hf.trainer (deepspeed: bench only)
                 "torchao>=0.18"],                  # FP8 without Transformer Engine
        "fp8": ["torchao>=0.18"],   # --fp8-format without Transformer Engine (torchao's float8)
        "hf": ["transformers>=4.40", "tokenizers", "safetensors", "accelerate"],
        "tensorboard": ["tensorboard"],
        # GPU fast paths: source builds against CUDA, install them yourself (README):
        #   transformer-engine[pytorch], flash-attn, NVIDIA apex.
    },
)
