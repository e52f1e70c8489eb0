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
    order = np.argsort(counts - ideal, axis=0)      # largest remainder first (ties: any order)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(n)[:, None], order.shape), axis=0)
    counts += rank < short
    return counts


class _Step:
    """One greedy step for all blocks at once; counts C are [n, B] (float64, exact), so every
    numpy call runs over the B blocks. Each step's pick is the first maximum (Megatron's tie rule)
    of the errors w * x - C: the rows at the largest error, the highest rank (n for row 0) among
    them. Two ways to get the errors, both giving the helper's picks exactly:

    exact: recomputed each step as w * x - C, the helper's float64 arithmetic (two products and
      subtractions per element), ties broken by rank.
    running: kept in `dtype` (float32 by default) and updated in place, + w per step and - 1 at the
      pick, recomputed exactly every R steps (refresh). They differ from the helper's errors by at
      most `slack` (rounding, bounded in refresh). A pick is certified when it is the only running
      error within 2 * slack of its block's maximum: every other error is then below the pick's by
      more than 2 * slack, so its exact error is strictly below the pick's too, and the helper
      makes the same pick (no tie to break). Blocks with several errors that close (near-ties, or
      exact ties of tie-prone weights) are picked from their exact errors (resolve). Weights that
      tie often switch to `exact` for good.
    """

    def __init__(self, w, counts, first, R=16, dtype=np.float32, running=True):
        n, B = counts.shape
        self.n, self.B, self.R, self.running = n, B, R, running
        self.w, self.w_max = w[:, None], float(w.max())           # [n, 1] float64
        self.C, self.flat_C = counts, counts.reshape(-1)          # flat_C[d * B + b]
        self.first = first
        self.W = np.repeat(w.astype(dtype)[:, None], B, axis=1)   # [n, B]
        self.E, self.E64 = np.empty((n, B), dtype), np.empty((n, B))
        self.best, self.best64, self.thr = np.empty(B, dtype), np.empty(B), np.empty(B, dtype)
        self.u = float(np.finfo(dtype).eps) / 2                     # unit roundoff of dtype
        self.near = np.empty((n, B), bool)
        rank_dtype = np.int8 if n < 127 else np.int16
        self.rank = np.arange(n, 0, -1, dtype=rank_dtype)[:, None]  # row d -> n - d
        self.scores = np.empty((n, B), rank_dtype)
        self.base = n * B + np.arange(B, dtype=np.intp)             # flat index of row n - top
        self.flat, self.flat_E = np.empty(B, np.intp), self.E.reshape(-1)   # flat_E[d * B + b]
        self.one = np.ones(1, dtype)
        self.count_dtype = np.uint8 if n < 255 else np.uint16
        self.flagged = 0

    def x(self, t):
        """x = max(i, 1) of each block at its step t, float64 [B]."""
        x = self.first + t
        x[0] = max(x[0], 1.0)
        return x

    def exact(self, t):
        """The helper's errors at step t, float64 [n, B]."""
        np.multiply(self.w, self.x(t), out=self.E64)
        return np.subtract(self.E64, self.C, out=self.E64)

    def refresh(self, t):
        """Running errors from the exact ones; per block, `slack` (the most they can differ from
        the helper's errors over the next R steps) and `gap` (2 * slack, plus room for the rounding
        of best - gap). Both kinds of errors are compared with the real ones, w * x - counts:

        - the helper's product and difference round by at most u64 * x and u64 * V (w <= 1),
          V bounding every |error| until the next refresh;
        - V: errors grow by at most w_max a step from at most max E, and only the pick drops, by 1.
          The pick is its block's largest error, >= -1e-4, as a block's errors sum to
          x * sum(w) - i, within 1e-4 of 0 (the caller runs on running errors only for such
          weights). So V = max(max E + R * w_max, -min E, 1) + 1e-3 (the margin also covers the
          ~1e-6 by which the running errors, used here for max E and min E, differ);
        - the running errors round by at most u * V when cast, then per step by at most u * V for
          the + w, u * V for the - 1 and u * w_max for w held in `dtype`, for at most R - 1 steps.
        """
        E = self.E
        E[...] = self.exact(t)
        u, R, w_max = self.u, self.R, self.w_max
        V = np.maximum(E.max(axis=0) + R * w_max, -E.min(axis=0))           # [B], per block
        V = np.maximum(V, 1.0) + 1e-3
        x_max = self.first + (t + R)
        u64 = float(np.finfo(np.float64).eps) / 2
        slack = u * ((2 * R - 1) * V + R * w_max) + 2 * u64 * (x_max + V)
        self.slack, self.gap = slack, (2 * slack + 2 * u * V).astype(E.dtype)

    def step(self, t, top, taken):
        """Picks of all blocks at step t: `top` [B] gets n - index of each pick, `taken` [B] the
        count before it; counts (and running errors) are updated."""
        near = self.near_running(t) if self.stay_running(t) else self.near_exact(t)
        np.multiply(near.view(np.int8), self.rank, out=self.scores)   # same dtypes: fast
        np.max(self.scores, axis=0, out=top)                          # first of the near rows
        flat = self.flat
        np.multiply(top, self.B, out=flat, dtype=np.intp)
        np.subtract(self.base, flat, out=flat)                  # d * B + b of each pick
        np.take(self.flat_C, flat, out=taken)
        np.add.at(self.flat_C, flat, 1.0)                         # flat holds each block once
        if self.running:
            np.subtract.at(self.flat_E, flat, self.one)            # one of dtype: the fast loop
            np.add(self.E, self.W, out=self.E)

    def stay_running(self, t):
        """Whether step t runs on running errors: refreshed every R steps from step 1 (block 0
        repeats x = 1 at steps 0 and 1), given up when more than 1 in 256 block steps of the last
        R needed resolving (weights that tie exactly, over and over)."""
        if self.running and (t <= 1 or (t - 1) % self.R == 0):
            if t > 1 and self.flagged * 256 > self.R * self.B:
                self.running = False
            else:
                self.refresh(t)
            self.flagged = 0
        return self.running

    def near_running(self, t):
        """[n, B] bool: per block, the one row the helper picks (certified, or resolved)."""
        near = self.near
        np.max(self.E, axis=0, out=self.best)
        np.subtract(self.best, self.gap, out=self.thr)
        np.greater_equal(self.E, self.thr, out=near)
        if np.count_nonzero(near) > self.B:                     # some block has several
            self.resolve(t)
        return near

    def near_exact(self, t):
        """[n, B] bool: per block, the rows at the largest of the helper's errors (ties: several)."""
        E = self.exact(t)
        np.max(E, axis=0, out=self.best64)
        return np.equal(E, self.best64, out=self.near)

    def resolve(self, t):
        """Blocks with several running errors within `gap` of their maximum: their pick from the
        exact errors (first maximum), written back as the only `near` row."""
        count = np.add.reduce(self.near.view(np.uint8), axis=0, dtype=self.count_dtype)
        several = np.flatnonzero(count > 1)
        self.flagged += len(several)
        E = self.w * self.x(t)[several] - self.C[:, several]     # [n, F], the helper's arithmetic
        self.near[:, several] = np.arange(self.n)[:, None] == np.argmax(E, axis=0)


def _blocks(w, size, L, W, K=32, running=True):
    """Block-parallel greedy: B blocks of L steps run side by side, one numpy step over all blocks
    at a time, each from guessed counts W steps before its start (the rule forgets its start
    quickly, so the guess has almost always been corrected by the block start; block 0 starts from
    the exact zeros and needs no warm-up). Per step and block: the pick the helper makes from the
    counts (_Step, on running or exact errors), one count incremented. Picks and counts are
    buffered for K steps ([K, B]) and written out block-major. Returns the outputs and, per block,
    the counts at its start and at its end.
    """
    B = -(-size // L)
    first = np.arange(B, dtype=np.float64) * L - W
    first[0] = 0.0
    C = _guess_counts(w, first)                         # [n, B] counts of each block
    C[:, 0] = 0.0
    step = _Step(w, C, first, running=running)
    T = W + L
    dataset_index = np.empty((B, L), np.int16)
    sample_index = np.empty((B, L), np.int64)
    head = (np.empty(L, np.int16), np.empty(L, np.int64))   # block 0's steps [0, L)
    picks, taken = np.empty((K, B), step.rank.dtype), np.empty((K, B))
    start = end0 = None
    n = len(w)
    for t in range(T):
        if t == W:
            start = C.copy()
        if t == L:
            end0 = C[:, 0].copy()
        r = t % K
        step.step(t, picks[r], taken[r])
        if r == K - 1 or t == T - 1:                    # write the chunk out, block-major
            if t - r < L:                               # block 0 from its step 0
                hi = min(t + 1, L)
                np.subtract(n, picks[:hi - (t - r), 0], out=head[0][t - r:hi])
                head[1][t - r:hi] = taken[:hi - (t - r), 0]
            lo = max(t - r, W)
            if lo <= t:
                rows = slice(lo - (t - r), r + 1)             # .T: [steps, B] -> [B, steps]
                np.subtract(n, picks[rows].T, out=dataset_index[:, lo - W:t + 1 - W])
                sample_index[:, lo - W:t + 1 - W] = taken[rows].T
    if start is None:
        start = C.copy()
    if end0 is None:
        end0 = C[:, 0].copy()
    start[:, 0] = 0.0
    end = C.copy()
    end[:, 0] = end0
    dataset_index[0], sample_index[0] = head
    # [B, L] -> [B * L]: block-major is sample order
    return dataset_index.reshape(-1)[:size], sample_index.reshape(-1)[:size], start, end


# Warm-up steps at most (a block that has not converged is redone exactly, and quickly); blocks
# such that n * blocks <= LANE_BYTES (the [n, B] float32 errors and byte masks stay in cache).
WARM_MAX, LANE_BYTES, LANES_MAX = 32, 2 ** 17, 10000


def build_blending_indices(weights, size):
    """(dataset_index int16, dataset_sample_index int64) by Megatron's greedy rule.

    Sample i goes to the dataset whose weight * max(i, 1) - samples_taken is largest (the first on
    ties), with the same float64 arithmetic as megatron-core's helper, so the result is identical.
    The rule is sequential, but it forgets where it started within a few dozen steps: blocks of
    steps are run side by side from guessed counts with a warm-up, and each block's counts at its
    start are checked against the previous block's counts at its end. Blocks whose check fails
    are redone exactly, one step at a time, until they rejoin the block-parallel result. Weights
    that sum to 1 (as BlendedDataset passes them) run on float32 running errors whose every pick
    is certified against the helper's float64 errors (_Step); other weights on exact errors.
    """
    w = np.asarray(weights, np.float64).reshape(-1)
    wl = w.tolist()
    n = len(wl)
    size = int(size)
    W = int(min(WARM_MAX, max(16, 2 * n, np.ceil(2.0 / max(float(w.min()), 1e-9)))))
    lanes = min(LANES_MAX, max(64, LANE_BYTES // n))    # the [n, lanes] arrays stay in cache
    L = max(W + 1, 2 * W, -(-size // lanes))
    if size < 4 * L or n >= 2 ** 15:
        dataset_index = np.empty(size, np.int16)
        sample_index = np.empty(size, np.int64)
        _greedy(wl, 0, size, [0.0] * n, dataset_index, sample_index)
        return dataset_index, sample_index
    running = w.min() >= 0 and abs(float(w.sum()) - 1.0) * size <= 1e-4   # see _Step.refresh
    dataset_index, sample_index, start, end = _blocks(w, size, L, W, running=running)
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
                              lambda: build_blending_indices(self.weights, self.size), build,
                              check=self._check_indices)

    def _check_indices(self, arrays):
        """(name, problem) when cached indices cannot be this blend's (shapes and ids)."""
        for name, array in zip(("dataset_index", "dataset_sample_index"), arrays):
            if array.shape != (self.size,):
                return name, f"its shape is {array.shape}, not ({self.size},) for the blend's size"
        if self.size and not 0 <= int(arrays[0].min()) <= int(arrays[0].max()) < len(self.datasets):
            return "dataset_index", f"it names datasets outside the blend's {len(self.datasets)}"
        return None

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
