"""Blend of several datasets with megatron-core's BlendedDataset indices."""
import os

import numpy as np

from .gpt_dataset import description_hash, save_npy, wait_for


def normalize(weights):
    """Weights divided by their sum (float64, as Megatron)."""
    w = np.asarray(weights, np.float64)
    return (w / w.sum()).tolist()


def build_blending_indices(weights, size):
    """(dataset_index int16, dataset_sample_index int64) by Megatron's greedy rule.

    Sample i goes to the dataset whose weight * max(i, 1) - samples_taken is largest (the first on
    ties). The rule is sequential by nature, so it runs as one tight loop; everything else about
    the blend (per-dataset sample numbers) is vectorised afterwards.
    """
    weights = [float(w) for w in weights]
    n = len(weights)
    choice = bytearray(size) if n < 256 else None
    dataset_index = np.empty(size, np.int16)
    taken = [0.0] * n
    pairs = list(enumerate(weights))
    for i in range(size):
        x = float(i) if i > 1 else 1.0
        best, best_err = 0, weights[0] * x - taken[0]
        for k, w in pairs[1:]:
            err = w * x - taken[k]
            if err > best_err:
                best, best_err = k, err
        taken[best] += 1.0
        if choice is not None:
            choice[i] = best
        else:
            dataset_index[i] = best
    if choice is not None:
        dataset_index[:] = np.frombuffer(bytes(choice), np.uint8)
    return dataset_index, sample_numbers(dataset_index, n)


def sample_numbers(dataset_index, n):
    """For each position, how many earlier positions chose the same dataset (vectorised)."""
    out = np.empty(len(dataset_index), np.int64)
    for k in range(n):
        where = np.flatnonzero(dataset_index == k)
        out[where] = np.arange(len(where))
    return out


class BlendedDataset:
    """Draws sample i from datasets[dataset_index[i]] at position dataset_sample_index[i]."""

    def __init__(self, datasets, weights, size, cache_dir=None, build=True):
        self.datasets, self.weights, self.size = datasets, normalize(weights), size
        self.description = {"class": "BlendedDataset", "weights": self.weights, "size": size,
                            "datasets": [d.description for d in datasets]}
        self.dataset_index, self.dataset_sample_index = self._indices(cache_dir, build)
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for k, (count, ds) in enumerate(zip(counts, datasets)):
            if count > len(ds):
                raise ValueError(f"the blend asks dataset {k} ({ds.description['path']}) for "
                                 f"{count} samples but it has {len(ds)}; raise its num_samples.")

    def _indices(self, cache_dir, build):
        if cache_dir is None:
            return build_blending_indices(self.weights, self.size)
        text, key = description_hash(self.description)
        split = self.datasets[0].split_name
        paths = [os.path.join(cache_dir, f"{key}-BlendedDataset-{split}-{n}.npy")
                 for n in ("dataset_index", "dataset_sample_index")]
        if not all(map(os.path.isfile, paths)):
            if not build:
                wait_for(paths)
            else:
                os.makedirs(cache_dir, exist_ok=True)
                with open(os.path.join(cache_dir, f"{key}-BlendedDataset-{split}.json"), "w") as f:
                    f.write(text)
                for path, array in zip(paths, build_blending_indices(self.weights, self.size)):
                    save_npy(path, array)
        return tuple(np.load(p, mmap_mode="r") for p in paths)

    def __len__(self):
        return len(self.dataset_index)

    def __getitem__(self, idx):
        k = int(self.dataset_index[idx])
        return self.datasets[k][int(self.dataset_sample_index[idx])]
