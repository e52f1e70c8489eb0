"""megatron_sp.data: Megatron-LM compatible data pipeline (indexed datasets, GPT samples, blending,
tokenizers, preprocessing, the trainer's data loader and the embedded default corpus)."""
from .indexed_dataset import (DataError, DataFileError, IndexedDataset, IndexedDatasetBuilder,
                              optimal_dtype)
from .gpt_dataset import GPTDataset, GPTDatasetConfig
from .blended_dataset import BlendedDataset
from .builder import build_gpt_datasets
from .tokenizers import build_tokenizer, train_sentencepiece
from .preprocess import preprocess
from .loader import PretrainingDataLoader
from .corpus import build_default_corpus, default_corpus_files, default_corpus_ready
