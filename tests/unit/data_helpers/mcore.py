"""Build megatron-core's reference datasets for the compatibility tests (used as shipped)."""
import warnings

import numpy as np


class RefTokenizer:
    """The minimum megatron-core's GPTDataset asks of a tokenizer."""

    def __init__(self, vocab_size, eod, pad):
        self.vocab_size, self.eod, self.pad = vocab_size, eod, pad
        self.unique_identifiers = {"class": "RefTokenizer", "vocab_size": vocab_size}


def mcore_gpt_datasets(data_path, split, seq_length, seed, num_samples, eod, pad, cache_dir,
                       vocab_size=1000, **flags):
    """megatron-core's (train, valid, test) through its BlendedMegatronDatasetBuilder.

    No cache: its BlendedDataset cache needs torch.distributed; its GPTDataset then caches under
    the data prefix, which lives in a temporary folder.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder)
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        from megatron.core.datasets.utils import get_blend_from_list
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=get_blend_from_list(data_path),
        split=split, path_to_cache=None, tokenizer=RefTokenizer(vocab_size, eod, pad),
        reset_position_ids=flags.get("reset_position_ids", False),
        reset_attention_mask=flags.get("reset_attention_mask", False),
        eod_mask_loss=flags.get("eod_mask_loss", False), create_attention_mask=False)
    return BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), lambda: True,
                                         config).build()


def random_corpus(rng, n_docs, max_len, vocab, eod, empty_frac=0.05):
    """Random documents ending with eod; some empty."""
    docs = []
    for _ in range(n_docs):
        n = int(rng.integers(1, max_len))
        if rng.random() < empty_frac:
            docs.append(np.zeros(0, np.int64))
        else:
            d = rng.integers(0, vocab, n)
            d[-1] = eod
            docs.append(d)
    return docs
