"""Blend of several datasets with megatron-core's BlendedDataset indices."""

import numpy as np

from .gpt_dataset import cached_indices


def normalize(weights):
    """Weights divided by their sum (float64, as Megatron)."""
    w = np.asarray(weights, np.float64)
    return (w / w.sum()).tolist()


def _greedy(weights, start, stop, taken, dataset_index, sample_index, until=None):
    """Megatron's greedy rule, one step at a time, for steps [start, stop) from the counts `taken`.

    With until=(block_start, reference counts at block_start), it stops as soon as its counts equal
    the ones the block-parallel pass had at the same step (from there on that pass is exact) and
    returns the step it stopped at; otherwise it returns stop. `taken` is updated in place.
    """
    pairs = list(enumerate(weights))[1:]
    w0 = weights[0]
    diff, nonzero = None, 0
    if until is not None:
        diff = [a - b for a, b in zip(taken, until)]
        nonzero = sum(1 for v in diff if v)
        if not nonzero:
            return start
    for i in range(start, stop):
        x = float(i) if i > 1 else 1.0
        best, best_err = 0, w0 * x - taken[0]
        for k, w in pairs:
            err = w * x - taken[k]
            if err > best_err:
                best, best_err = k, err
        if diff is not None:
            old = int(dataset_index[i])
            if old != best:
                for k, step in ((best, 1), (old, -1)):
                    before = diff[k]
                    diff[k] = before + step
                    nonzero += (diff[k] != 0) - (before != 0)
        dataset_index[i] = best
        sample_index[i] = taken[best]
        taken[best] += 1.0
        if diff is not None and not nonzero:
            return i + 1
    return stop


def _guess_counts(w, steps):
    """Per-dataset counts near w * steps summing to steps (largest remainders), shape [n, B]."""
    n = len(w)
    ideal = w[:, None] * steps[None, :]
    counts = np.floor(ideal)
    short = steps - counts.sum(0)
    order = np.argsort(counts - ideal, axis=0, kind="stable")      # largest remainder first
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(n)[:, None], order.shape), axis=0)
    counts += rank < short
    return counts


class _Step:
    """One greedy step for all blocks at once; counts C and errors E are [n, B], so every numpy
    call runs over the B blocks. x is held tiled as X [n, B] and advanced in place (x + 1 is
    exact), so the products w * x come from one same-shape multiply. The first maximum (Megatron's
    tie rule): the largest error, the rows equal to it, the highest rank (n for row 0) among them.
    """

    def __init__(self, w, counts, first):
        n, B = counts.shape
        self.C, self.n = counts, n
        self.W = np.repeat(w[:, None], B, axis=1)       # [n, B]
        self.X = np.repeat(first[None, :], n, axis=0)   # [n, B]: x of each block, every row
        self.X[:, 0] = 1.0                              # Megatron uses max(i, 1)
        self.E, self.best = np.empty((n, B)), np.empty(B)
        rank_dtype = np.int8 if n < 127 else np.int16
        self.rank = np.arange(n, 0, -1, dtype=rank_dtype)[:, None]   # row d -> n - d
        self.equal, self.scores = np.empty((n, B), bool), np.empty((n, B), rank_dtype)
        self.top, self.idx = np.empty(B, rank_dtype), np.empty(B, np.intp)

    def pick(self, t):
        """The dataset each block takes at its step t (x advanced first, except at steps 0, 1)."""
        X, E = self.X, self.E
        if t > 0:
            X += 1.0
            if t == 1:
                X[:, 0] = 1.0                           # step 1 of block 0: x = max(1, 1)
        np.multiply(self.W, X, out=E)                   # [n, B]
        np.subtract(E, self.C, out=E)
        np.max(E, axis=0, out=self.best)
        np.equal(E, self.best, out=self.equal)          # [n, B]
        np.multiply(self.equal, self.rank, out=self.scores)
        np.max(self.scores, axis=0, out=self.top)
        return np.subtract(self.n, self.top, out=self.idx)


def _blocks(w, size, L, W, K=32):
    """Block-parallel greedy: B blocks of L steps run side by side, one numpy step over all blocks
    at a time, each from guessed counts W steps before its start (the rule forgets its start
    quickly, so the guess has almost always been corrected by the block start; block 0 starts from
    the exact zeros and needs no warm-up). Per step and block: the n errors w * max(i, 1) - counts
    (the helper's float64 arithmetic), their first maximum, one count incremented. Returns the
    outputs (block-major) and, per block, the counts at its start and at its end.
    """
    B = -(-size // L)
    first = np.arange(B, dtype=np.float64) * L - W
    first[0] = 0.0
    C = _guess_counts(w, first)                         # [n, B] counts of each block
    C[:, 0] = 0.0
    step = _Step(w, C, first)
    counts = C.reshape(-1)                              # counts[d * B + b]
    lanes = np.arange(B, dtype=np.intp)
    T = W + L
    dataset_index = np.empty((B, L), np.int16)
    sample_index = np.empty((B, L), np.int64)
    head = (np.empty(L, np.int16), np.empty(L, np.int64))   # block 0's steps [0, L)
    picks, taken = np.empty((K, B), np.int16), np.empty((K, B))
    flat = np.empty(B, np.intp)
    start = end0 = None
    for t in range(T):
        if t == W:
            start = C.copy()
        if t == L:
            end0 = C[:, 0].copy()
        idx = step.pick(t)
        r = t % K
        picks[r] = idx
        np.multiply(idx, B, out=flat)
        flat += lanes
        row = taken[r]
        np.take(counts, flat, out=row, mode="clip")     # the count before this pick
        counts[flat] = row + 1.0
        if t < L:
            head[0][t], head[1][t] = idx[0], row[0]
        if r == K - 1 or t == T - 1:                    # write the chunk out, block-major
            lo = max(t - r, W)
            if lo <= t:
                rows = slice(lo - (t - r), r + 1)
                dataset_index[:, lo - W:t + 1 - W] = picks[rows].T
                sample_index[:, lo - W:t + 1 - W] = taken[rows].T
    if start is None:
        start = C.copy()
    if end0 is None:
        end0 = C[:, 0].copy()
    start[:, 0] = 0.0
    end = C.copy()
    end[:, 0] = end0
    dataset_index[0], sample_index[0] = head
    return dataset_index.reshape(-1)[:size], sample_index.reshape(-1)[:size], start, end


def build_blending_indices(weights, size):
    """(dataset_index int16, dataset_sample_index int64) by Megatron's greedy rule.

    Sample i goes to the dataset whose weight * max(i, 1) - samples_taken is largest (the first on
    ties), with the same float64 arithmetic as megatron-core's helper, so the result is identical.
    The rule is sequential, but it forgets where it started within a few dozen steps: blocks of
    steps are run side by side from guessed counts with a warm-up, and each block's counts at its
    start are checked against the previous block's counts at its end. Blocks whose check fails
    are redone exactly, one step at a time, until they rejoin the block-parallel result.
    """
    w = np.asarray(weights, np.float64).reshape(-1)
    wl = w.tolist()
    n = len(wl)
    size = int(size)
    W = int(min(256, max(16, 2 * n, np.ceil(2.0 / max(float(w.min()), 1e-9)))))
    lanes = min(10000, max(64, 2 ** 15 // n))              # the [n, lanes] arrays stay in cache
    L = max(W + 1, 2 * W, -(-size // lanes))
    if size < 4 * L or n >= 2 ** 15:
        dataset_index = np.empty(size, np.int16)
        sample_index = np.empty(size, np.int64)
        _greedy(wl, 0, size, [0.0] * n, dataset_index, sample_index)
        return dataset_index, sample_index
    dataset_index, sample_index, start, end = _blocks(w, size, L, W)
    B = start.shape[1]
    ok = np.ones(B, bool)
    ok[1:] = np.all(end[:, :-1] == start[:, 1:], axis=0)
    todo = np.flatnonzero(~ok).tolist()
    j, b, state = 0, 0, None
    while True:
        if state is None:                   # the previous block ended with the right counts
            if j == len(todo):
                break
            b = todo[j]
            j += 1
            state = end[:, b - 1].tolist()
        else:                               # carry the exact counts into the next block
            b += 1
            if b == B:
                break
            while j < len(todo) and todo[j] <= b:
                j += 1
        lo, hi = b * L, min(b * L + L, size)
        stop = _greedy(wl, lo, hi, state, dataset_index, sample_index, until=start[:, b].tolist())
        if stop < hi or state == end[:, b].tolist():
            state = None
    return dataset_index, sample_index


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
        split = self.datasets[0].split_name
        return cached_indices(cache_dir, self.description, f"BlendedDataset-{split}",
                              ("dataset_index", "dataset_sample_index"),
                              lambda: build_blending_indices(self.weights, self.size), build)

    def __len__(self):
        return len(self.dataset_index)

    def locate(self, idx):
        """Where sample idx comes from: the blended sample and its dataset's own description."""
        k = int(self.dataset_index[idx])
        inner = self.datasets[k]
        where = getattr(inner, "locate", lambda i: f"sample {i} of dataset {k}")
        return f"blended sample {idx}: {where(int(self.dataset_sample_index[idx]))}"

    def __getitem__(self, idx):
        k = int(self.dataset_index[idx])
        return self.datasets[k][int(self.dataset_sample_index[idx])]
