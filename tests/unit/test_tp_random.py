"""RNGTracker on one process: forked stream differs by tp rank, default stream restored, state
round-trips; get/set_rng_state restores python, numpy and torch."""
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_sp.tensor_parallel import RNGTracker, get_rng_state, set_rng_state


def _mask():
    return F.dropout(torch.ones(64), p=0.5, training=True) != 0


def test_seeds_follow_megatron_conventions():
    t = RNGTracker(1234, tp_rank=3, pp_rank=2, sp_rank=1, device="cpu", seed_default=False)
    assert t.default_seed == 1234 + 200 + 1009
    assert t.tp_seed == t.default_seed + 2718 + 3


def test_fork_switches_stream_and_restores_default():
    tracker = RNGTracker(7, tp_rank=1, device="cpu")  # seeds the default stream with 7
    with tracker.fork():
        forked = _mask()
    after = _mask()
    # The default stream continues as if the fork had not happened.
    torch.manual_seed(7)
    assert torch.equal(after, _mask())
    # The forked stream depends on tp_rank and continues across forks.
    tracker0 = RNGTracker(7, tp_rank=0, device="cpu", seed_default=False)
    with tracker0.fork():
        forked0 = _mask()
    assert not torch.equal(forked, forked0)
    with tracker.fork():
        second = _mask()
    assert not torch.equal(forked, second)
    with tracker.fork(), pytest.raises(RuntimeError, match="do not nest"):
        with tracker.fork():
            pass


def test_state_dict_round_trip():
    tracker = RNGTracker(3, tp_rank=0, device="cpu")
    with tracker.fork():
        _mask()
    saved = tracker.state_dict()
    with tracker.fork():
        first = _mask()
    tracker.load_state_dict(saved)
    with tracker.fork():
        again = _mask()
    assert torch.equal(first, again)


def test_process_rng_state_round_trip():
    tracker = RNGTracker(5, tp_rank=0, device="cpu")
    state = get_rng_state(tracker)
    draws = (random.random(), np.random.rand(), torch.rand(3))
    with tracker.fork():
        forked = torch.rand(3)
    set_rng_state(state, tracker)
    assert random.random() == draws[0] and np.random.rand() == draws[1]
    assert torch.equal(torch.rand(3), draws[2])
    with tracker.fork():
        assert torch.equal(torch.rand(3), forked)
