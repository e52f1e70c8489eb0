"""Random tokens for --mock-data: the same sample i in every layout (seeded by the sample
index), in the GPT dataset's sample format."""
from __future__ import annotations

import numpy as np


class MockDataset:
    """Random tokens, the same sample i in every layout (seeded by the sample index)."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, num_samples: int):
        self.vocab, self.seq, self.seed, self.n = vocab_size, seq_length, seed, num_samples

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rng = np.random.default_rng([self.seed, i])
        text = rng.integers(0, self.vocab, self.seq + 1, dtype=np.int64)
        return {"tokens": text[:-1], "labels": text[1:],
                "loss_mask": np.ones(self.seq, dtype=np.float32),
                "position_ids": np.arange(self.seq, dtype=np.int64)}
