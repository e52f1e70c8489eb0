"""The trainer's data loader: Megatron's MegatronPretrainingSampler order, resumable."""
import numpy as np

from .indexed_dataset import DataError

INT_KEYS = ("tokens", "labels", "position_ids", "document_ids")


def collate(items):
    """List of item dicts -> dict of torch tensors [batch, s] (int64, loss_mask float32)."""
    import torch    # here: preprocessing imports megatron_sp.data and must not load torch
    out = {}
    for key in items[0]:
        arr = np.stack([np.asarray(it[key]) for it in items])
        out[key] = torch.from_numpy(arr.astype(np.int64 if key in INT_KEYS else np.float32))
    return out


class PretrainingDataLoader:
    """Yields this data-parallel rank's micro-batches.

    Global step t covers sample indices [c + t*m*d, c + (t+1)*m*d) with c = consumed_samples,
    m = micro_batch_size, d = dp_size; rank r takes [r*m, (r+1)*m) of that chunk.
    """

    def __init__(self, dataset, consumed_samples, micro_batch_size, dp_rank, dp_size,
                 drop_last=True, vocab_size=None, num_workers=0, cyclic=False, seed=0):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size}); pass the rank's index "
                             f"in its data-parallel group.")
        if consumed_samples > len(dataset) and not cyclic:
            raise ValueError(f"consumed_samples {consumed_samples} exceeds the dataset's "
                             f"{len(dataset)} samples; build the dataset with more samples.")
        self.dataset, self.consumed_samples = dataset, consumed_samples
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.drop_last, self.vocab_size = drop_last, vocab_size
        # Megatron's --num-workers, and --dataloader-type cyclic: the sample sequence runs on past
        # the end, epoch e visiting the samples in a permutation seeded by (seed, e).
        self.num_workers, self.cyclic, self.seed = num_workers, cyclic, seed

    def index_batches(self):
        """Sample indices of each micro-batch of this rank."""
        if self.cyclic:
            yield from self._cyclic_batches()
            return
        n, m, step = len(self.dataset), self.micro_batch_size, self.micro_batch_size * self.dp_size
        start = self.consumed_samples
        while start + step <= n:
            yield range(start + self.dp_rank * m, start + (self.dp_rank + 1) * m)
            start += step
        if not self.drop_last and start < n:
            mine = range(start + self.dp_rank * m, min(start + (self.dp_rank + 1) * m, n))
            if len(mine):
                yield mine

    def __len__(self):
        step = self.micro_batch_size * self.dp_size
        full, rest = divmod(len(self.dataset) - self.consumed_samples, step)
        return full + (0 if self.drop_last or rest <= self.dp_rank * self.micro_batch_size else 1)

    def _cyclic_batches(self):
        n, m, step = len(self.dataset), self.micro_batch_size, self.micro_batch_size * self.dp_size
        start, epoch, order = self.consumed_samples, None, None
        while True:
            mine = range(start + self.dp_rank * m, start + (self.dp_rank + 1) * m)
            batch = []
            for position in mine:
                if position // n != epoch:
                    epoch = position // n
                    order = np.random.default_rng([self.seed, epoch]).permutation(n)
                batch.append(int(order[position % n]))
            yield batch
            start += step

    def __iter__(self):
        if self.num_workers > 0:
            import torch.utils.data
            batches = torch.utils.data.DataLoader(self.dataset, batch_sampler=_Batches(self),
                                                  num_workers=self.num_workers, collate_fn=collate,
                                                  persistent_workers=False)
        else:
            batches = (collate([self.dataset[i] for i in indices])
                       for indices in self.index_batches())
        if self.vocab_size is None:
            yield from batches
            return
        for indices, batch in zip(self.index_batches(), batches):
            check_vocab(batch, list(indices), self.dataset, self.vocab_size)
            yield batch


class _Batches:
    """index_batches as a batch sampler for torch's DataLoader (--num-workers)."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        return iter(self.loader.index_batches())


def check_vocab(batch, indices, dataset, vocab_size):
    """Every token id of the micro-batch in [0, vocab_size) (one min and max per field), else a
    DataError naming the dataset, the sample and the id (the embedding would fail on it)."""
    for key in ("tokens", "labels"):
        ids = batch[key]
        lo, hi = ids.aminmax()
        if lo >= 0 and hi < vocab_size:
            continue
        bad = (ids < 0) | (ids >= vocab_size)                # [batch, s]
        row = int(bad.any(dim=1).nonzero()[0])
        value = int(ids[row][bad[row]][0])
        where = getattr(dataset, "locate", lambda i: f"sample {i}")(indices[row])
        raise DataError(f"{where} holds token id {value}, outside the vocabulary of {vocab_size} "
                        f"ids; preprocess the data with the tokenizer used for training "
                        f"(tools/preprocess_data.py) or pass that tokenizer.")
