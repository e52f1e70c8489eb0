"""Blending indices identical to megatron-core's C++ helper (its greedy rule, ties to the first
dataset): random weights, equal and integer-ratio weights (exact ties in float64), 50 and 200
datasets at 1M samples and 50 at 10M (the float32 running errors and their certification), skewed
weights, sizes around the block-parallel path's thresholds and sizes that divide nothing."""
import numpy as np
import pytest

from megatron_sp.data.blended_dataset import build_blending_indices

from megatron.core.datasets import helpers_cpp as helpers


def reference(weights, size):
    w = np.asarray(weights, np.float64)
    di, dsi = np.zeros(size, np.int16), np.zeros(size, np.int64)
    helpers.build_blending_indices(di, dsi, w, len(w), size, False)
    return di, dsi


def check(weights, size):
    ours, ref = build_blending_indices(list(weights), size), reference(weights, size)
    assert ours[0].dtype == np.int16 and ours[1].dtype == np.int64
    np.testing.assert_array_equal(ours[0], ref[0])
    np.testing.assert_array_equal(ours[1], ref[1])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_weights(seed):
    rng = np.random.default_rng(seed)
    for _ in range(12):
        n = int(rng.choice([1, 2, 3, 4, 5, 7, 9, 16, 33]))
        w = rng.random(n) + (0.001 if rng.random() < 0.3 else 0.05)
        size = int(rng.choice([1, 7, 300, 5000, 40_000, 200_000]))
        check(w / w.sum(), size)


@pytest.mark.parametrize("weights", [
    [0.5, 0.5], [1 / 3] * 3, [0.25] * 4, [1 / 7] * 7, [0.5, 0.25, 0.25], [0.25, 0.25, 0.5],
    [0.2, 0.4, 0.4], [0.1] * 10, [0.6, 0.2, 0.2], [1 / 50] * 50])
def test_tie_weights(weights):
    """Equal and integer-ratio weights give exact float64 ties, broken toward the lower index."""
    w = np.asarray(weights) / np.sum(weights)
    for size in (999, 123_457):
        check(w, size)


@pytest.fixture
def paths(monkeypatch):
    """How many block steps ran on running errors and on exact errors, and how many blocks had
    their pick resolved from exact errors (near-ties of the running errors)."""
    from megatron_sp.data import blended_dataset
    seen = {"running": 0, "exact": 0, "resolved": 0}
    step, resolve = blended_dataset._Step.step, blended_dataset._Step.resolve

    def counting_step(self, *args):
        step(self, *args)
        seen["running" if self.running else "exact"] += 1

    def counting_resolve(self, t):
        before = self.flagged
        resolve(self, t)
        seen["resolved"] += self.flagged - before
    monkeypatch.setattr(blended_dataset._Step, "step", counting_step)
    monkeypatch.setattr(blended_dataset._Step, "resolve", counting_resolve)
    return seen


@pytest.mark.parametrize("n, size", [(50, 1_000_000), (200, 1_000_000),
                                     (50, 10_000_000)])
def test_many_datasets_on_running_errors(paths, n, size):
    """Many datasets run on float32 running errors; the picks they certify, and the near-ties
    resolved exactly, equal the helper's. Fails if the certification gap is too small (checked
    with the gap at 1% of its bound: 200 datasets at 1M and 50 at 10M then differ)."""
    rng = np.random.default_rng(n)
    w = rng.random(n) + 0.05
    check(w / w.sum(), size)
    assert paths["exact"] == 0 and paths["running"] > 0 and paths["resolved"] > 0


@pytest.mark.parametrize("size", [77_777, 1_000_003])
def test_skewed_weights(paths, size):
    """One dataset at 0.9 and 49 tiny ones: random tiny weights stay on running errors, equal tiny
    weights (exact ties among them) switch to exact errors; both equal the helper."""
    rng = np.random.default_rng(size)
    for tiny in (rng.random(49) * 0.1 / 49 + 1e-4, np.full(49, 0.1 / 49)):
        check(np.r_[0.9, tiny] / (0.9 + tiny.sum()), size)
    assert paths["running"] > 0 and paths["exact"] > 0


@pytest.mark.parametrize("n", [50, 200])
def test_equal_weights_switch_to_exact_errors(paths, n):
    """Equal weights tie exactly all the time: the running errors flag near-ties in every block,
    so the steps switch to exact errors (ties to the first dataset), identical to the helper."""
    check(np.full(n, 1.0 / n), 123_457)
    assert paths["exact"] > 0


@pytest.mark.parametrize("n, size", [(17, 99_991), (64, 250_001), (300, 250_001)])
def test_sizes_that_divide_nothing(n, size):
    """Odd sizes and dataset counts (300: ranks in int16, near-tie counts in uint16)."""
    rng = np.random.default_rng(size + n)
    w = rng.random(n) + 0.01
    check(w / w.sum(), size)


def test_blocks_redone_when_the_warm_up_does_not_converge(monkeypatch):
    """A weight of 1e-4 among 5 and 20 datasets: some blocks start from wrong counts (checked at
    their start against the previous block's end) and are redone exactly; the result is identical."""
    from megatron_sp.data import blended_dataset
    failed, blocks = [], blended_dataset._blocks

    def counting(*args, **kwargs):
        out = blocks(*args, **kwargs)
        start, end = out[2], out[3]
        failed.append(int((~np.all(end[:, :-1] == start[:, 1:], axis=0)).sum()))
        return out
    monkeypatch.setattr(blended_dataset, "_blocks", counting)
    rng = np.random.default_rng(0)
    for n in (2, 3, 5, 20):
        for tiny in (1e-4, 1e-3, 0.01):
            w = rng.random(n) + 0.05
            w[0] = tiny * w.sum()
            check(w / w.sum(), 300_000)
    assert sum(failed) >= 1


@pytest.mark.parametrize("n", [50, 200])
def test_running_errors_stay_within_their_slack(monkeypatch, n):
    """The premise of the certification: after every step, the float32 running errors differ from
    the helper's float64 errors w * max(i, 1) - counts by at most their block's `slack` (until the
    next refresh)."""
    from megatron_sp.data import blended_dataset
    step, ratios = blended_dataset._Step.step, []

    def checking(self, t, top, taken):
        step(self, t, top, taken)
        if self.running and t % self.R:                 # the next step reads these errors
            exact = self.exact(t + 1)
            ratios.append(float((np.abs(self.E - exact).max(axis=0) / self.slack).max()))
    monkeypatch.setattr(blended_dataset._Step, "step", checking)
    rng = np.random.default_rng(n)
    w = rng.random(n) + 0.05
    check(w / w.sum(), 200_000)
    assert ratios and max(ratios) <= 1.0              # about 0.2-0.3 in practice


def test_weights_that_do_not_sum_to_one_use_exact_errors(paths):
    """The helper takes any weights; the running errors' bound needs a sum of 1, so other sums
    run on exact errors and still equal the helper."""
    rng = np.random.default_rng(7)
    for scale in (0.5, 3.0):
        check(scale * rng.dirichlet(np.ones(20)), 60_001)
    assert paths["running"] == 0 and paths["exact"] > 0
