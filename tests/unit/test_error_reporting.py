"""Who says a user error under torchrun (megatron_sp.errors.should_print), with an in-memory store
standing in for the rendezvous store; and which exceptions are user errors."""
import pytest

from megatron_sp import errors
from megatron_sp.errors import ConfigError, UserError, as_user_error, should_print
from megatron_sp.errors import CollectiveFailure


class FakeStore:
    """The few c10d Store calls should_print makes (set, get, check, add)."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def add(self, key, n):
        self.data[key] = str(int(self.data.get(key, b"0")) + n).encode()
        return int(self.data[key])


@pytest.fixture(autouse=True)
def short_grace(monkeypatch):
    monkeypatch.setattr(errors, "GRACE_S", 0.2)


def test_one_rank_and_before_the_process_group():
    assert should_print(ConfigError("x."), 0, 1, None)
    assert should_print(ConfigError("x."), 0, 4, None)          # same flags everywhere: rank 0
    assert not should_print(ConfigError("x."), 3, 4, None)

    class Unreachable(UserError):
        same_on_every_rank = False
    assert should_print(Unreachable("rank 3 could not reach."), 3, 4, None)


def test_agreeing_ranks_say_it_once_and_a_differing_rank_says_its_own():
    store = FakeStore()
    assert should_print(ConfigError("same."), 0, 3, store)
    assert not should_print(ConfigError("same."), 1, 3, store)  # rank 0 posted the same sentence
    assert should_print(ConfigError("only mine."), 2, 3, store)  # another sentence: said (0.2 s)


def test_rank_zero_silent_leaves_others_to_speak():
    store = FakeStore()
    assert should_print(ConfigError("rank 1 alone."), 1, 2, store)   # no note from rank 0 in time


def test_collective_failures_are_quiet_when_their_cause_was_reported():
    store = FakeStore()
    assert should_print(CollectiveFailure("rank 0: a collective failed."), 0, 2, store)  # no cause
    store = FakeStore()
    assert should_print(ConfigError("rank 1's data file is bad."), 1, 2, store)
    assert not should_print(CollectiveFailure("rank 0: a collective failed."), 0, 2, store)


def test_what_counts_as_a_user_error(monkeypatch):
    assert isinstance(as_user_error(SystemExit("error: --seq-length is required.")), UserError)
    assert str(as_user_error(SystemExit("error: --seq-length is required."))) == \
        "--seq-length is required."
    assert as_user_error(SystemExit(2)) is None                 # argparse already said it
    assert as_user_error(ZeroDivisionError("a bug")) is None     # bugs keep their traceback
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert as_user_error(gloo) is None          # no process group here: not a peer's death
    monkeypatch.setattr(errors, "_store", FakeStore)
    monkeypatch.setattr(errors, "_rank_and_world", lambda: (1, 2))
    raw = as_user_error(gloo)
    assert isinstance(raw, CollectiveFailure) and raw.consequence
    assert str(raw).startswith("rank 1: a collective failed outside a training step")
    with pytest.raises(ConfigError, match="^where: bad value$"):
        with errors.reraise_as(ConfigError, ValueError, prefix="where: "):
            raise ValueError("bad value")
    with pytest.raises(KeyError):                                # other types pass through
        with errors.reraise_as(ConfigError, ValueError):
            raise KeyError("x")
