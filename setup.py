"""Packaging for megatron-sp.

Three import names from three folders: megatron_sp (the parallel core), megatron_sp.models (models/)
and megatron_sp.data (data/). torch is required but never replaced: a torch that is already importable
satisfies ">=2.4"; on a machine without one, install the build you want first (README).
"""
from setuptools import setup

setup(
    name="megatron-sp",
    version="0.1.0",
    description="Pretrain GPT models at million-token contexts with tensor, Ulysses sequence, "
                "pipeline and data parallelism on one device mesh.",
    python_requires=">=3.10",
    packages=[
        "megatron_sp", "megatron_sp.tensor_parallel", "megatron_sp.ulysses", "megatron_sp.attention",
        "megatron_sp.pipeline", "megatron_sp.memory", "megatron_sp.models", "megatron_sp.data",
        "megatron_sp.checkpointing", "megatron_sp.sharding", "megatron_sp.training", "megatron_sp.cli",
        "megatron_sp.context_parallel", "megatron_sp.hf",
    ],
    package_dir={"megatron_sp.models": "models", "megatron_sp.data": "data"},
    install_requires=["torch>=2.4", "numpy", "sentencepiece", "tqdm",
                      "protobuf",  # sentencepiece's model file: scores rounded, export (data/)
                      "xxhash"],   # checkpoint checksums (XXH3); CRC-32 without it
    extras_require={
        # Test-only: megatron-core is the reference for dataset indices, transformers for conversion.
        "test": ["pytest", "pytest-timeout", "megatron-core==0.16.1", "transformers>=4.40",
                 "tokenizers", "safetensors", "tensorboard",
                 "trl", "accelerate", "datasets"],   # megatron_sp.hf.trainer (deepspeed: bench only)
        "hf": ["transformers>=4.40", "tokenizers", "safetensors", "accelerate"],
        "tensorboard": ["tensorboard"],
        # GPU fast paths: source builds against CUDA, install them yourself (README):
        #   transformer-engine[pytorch], flash-attn, NVIDIA apex.
    },
    py_modules=[],
)
