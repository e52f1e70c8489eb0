"""Who says a user error under a launcher (megatron_sp.reporting.Notes, report), with an in-memory
store standing in for the rendezvous store, ranks as threads; and which exceptions are user errors."""
import os
import signal
import threading
import time

import pytest

from megatron_sp import reporting
from megatron_sp.errors import (CollectiveFailure, ConfigError, Terminated, UsageError, UserError,
                                reraise_as)
from megatron_sp.reporting import Notes, as_user_error


class FakeStore:
    """The few c10d Store calls the reporting makes (set, get, check, add); thread-safe."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    lock = threading.Lock()

    def add(self, key, n):
        with self.lock:
            self.data[key] = str(int(self.data.get(key, b"0")) + n).encode()
            return int(self.data[key])


@pytest.fixture(autouse=True)
def short_grace(monkeypatch):
    monkeypatch.setattr(reporting, "GRACE_S", 0.3)


def line_of(error, rank, world, store):
    """What rank `rank` prints for `error` on `store` (None: quiet), the said mark made as
    report() makes it."""
    notes = Notes(store, rank, world, environ={})
    line, slot = notes.line(error)
    if line is not None:
        notes.mark_said(slot)
    return line


def in_parallel(*calls):
    """Run each (error, rank, world, store) as its own rank, concurrently: {rank: line}."""
    out = {}
    threads = [threading.Thread(target=lambda c=c: out.__setitem__(c[1], line_of(*c)))
               for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_one_rank_and_without_a_store():
    assert reporting._line_without_store(ConfigError("x."), 0, 1) == "x."
    assert reporting._line_without_store(ConfigError("x."), 0, 4) == "x."   # the same everywhere
    assert reporting._line_without_store(ConfigError("x."), 3, 4) is None   # rank 0 says it

    class Unreachable(UserError):
        same_on_every_rank = False
    assert reporting._line_without_store(Unreachable("could not reach."), 3, 4) == \
        "rank 3: could not reach."


def test_the_first_rank_says_an_agreed_sentence_once_without_its_rank():
    store = FakeStore()
    # whichever posts first speaks (unprefixed: the other agrees); the other stays quiet
    out = in_parallel((ConfigError("same."), 1, 2, store), (ConfigError("same."), 0, 2, store))
    assert sorted(map(str, out.values())) == ["None", "same."], out
    # four ranks, in any order: exactly one line
    store = FakeStore()
    out = in_parallel(*[(ConfigError("four."), r, 4, store) for r in (3, 1, 0, 2)])
    assert [v for v in out.values() if v is not None] == ["four."], out


def test_a_quiet_rank_waits_until_the_sentence_was_said():
    store = FakeStore()
    notes = Notes(store, 1, 2, environ={})
    notes._count("causes", 1)                          # rank 0 posted and claimed, not yet said
    notes._count(f"claims/{slot_of('late.')}", 1)
    t0 = time.monotonic()
    assert line_of(ConfigError("late."), 1, 2, store) is None
    assert time.monotonic() - t0 >= 2 * reporting.GRACE_S - 0.05   # waited (bounded) for it


def slot_of(message):
    import hashlib
    return hashlib.sha1(message.encode()).hexdigest()[:16]


def test_a_sentence_no_other_rank_finds_carries_its_rank():
    store = FakeStore()
    assert line_of(ConfigError("only rank 1's file is missing."), 1, 2, store) == \
        "rank 1: only rank 1's file is missing."        # nobody agreed within GRACE_S
    store = FakeStore()
    out = in_parallel((ConfigError("mine."), 0, 2, store), (ConfigError("yours."), 1, 2, store))
    assert out == {0: "rank 0: mine.", 1: "rank 1: yours."}   # both posted: no wait


def test_an_error_found_together_is_said_at_once_without_a_rank():
    """A non-finite global loss is decided from values reduced over every rank: the first rank to
    post says it at once and unprefixed, even when the others are slow (loaded) to post theirs;
    a late rank then stays quiet."""
    from megatron_sp.errors import NonFiniteLossError
    store = FakeStore()
    t0 = time.monotonic()
    assert line_of(NonFiniteLossError("iteration 2: nan."), 1, 2, store) == "iteration 2: nan."
    assert time.monotonic() - t0 < reporting.GRACE_S                  # no wait for agreement
    assert line_of(NonFiniteLossError("iteration 2: nan."), 0, 2, store) is None


def test_checkpoint_refusals_agreed_by_a_collective_are_found_together():
    """A --save lock refusal, a save's failure or a load's refusal reaches every rank through a
    collective (checkpointing.comm.agree_on_error, io._agree_on_save) before any raises: rank 0
    says it unprefixed at once, though rank 1 (loaded: seconds behind) has not posted yet
    (seen under the full suite: "error: rank 0: --save ... is locked by another run")."""
    from megatron_sp.checkpointing.format import AgreedCheckpointError
    message = "--save /ck is locked by another run (host h, pid 1): wait for that run to end."
    store = FakeStore()
    t0 = time.monotonic()
    assert line_of(AgreedCheckpointError(message), 0, 2, store) == message
    assert time.monotonic() - t0 < reporting.GRACE_S
    assert line_of(AgreedCheckpointError(message), 1, 2, store) is None


def test_consequences_are_quiet_after_a_cause_and_said_once_otherwise():
    store = FakeStore()
    assert line_of(ConfigError("rank 1's data file is bad."), 1, 2, store)
    assert line_of(CollectiveFailure("a collective failed."), 0, 2, store) is None
    store = FakeStore()
    out = in_parallel(*[(CollectiveFailure("a collective failed."), r, 3, store) for r in range(3)])
    said = [v for v in out.values() if v is not None]
    assert len(said) == 1 and said[0].endswith(": a collective failed."), out
    store = FakeStore()                     # another attempt of torchrun: its own keys
    assert Notes(store, 0, 2, environ={"TORCHELASTIC_RESTART_COUNT": "1"}).prefix.endswith("/1")


def test_report_prints_once_and_fills_the_launchers_error_file(tmp_path, monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    store = FakeStore()
    monkeypatch.setattr(reporting, "_reporting", False)     # report() sets it: restored after
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setattr(reporting, "_store", lambda error=None: store)
    monkeypatch.setattr(reporting, "rank_and_world", lambda: (1, 2))
    reporting.report(ConfigError("--split 0,0,0 leaves no training data."))
    assert capsys.readouterr().err == "error: rank 1: --split 0,0,0 leaves no training data.\n"
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.message["extraInfo"]["py_callstack"] == \
        "rank 1: --split 0,0,0 leaves no training data."    # torchrun's report shows it
    usage = UsageError("unrecognized argument --seq-len; did you mean --seq-length?",
                              usage="usage: pretrain_gpt.py [flags]\n")
    monkeypatch.setattr(reporting, "rank_and_world", lambda: (0, 2))
    reporting.report(usage)
    assert capsys.readouterr().err.startswith("usage: pretrain_gpt.py [flags]\nerror: rank 0: ")
    assert usage.exit_code == 2


def test_sigterm_raises_terminated_except_while_reporting(monkeypatch):
    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(reporting, "_reporting", False)
    try:
        reporting.hold_sigterm()
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        monkeypatch.setattr(reporting, "_reporting", True)
        os.kill(os.getpid(), signal.SIGTERM)             # held off: the report goes on
        time.sleep(0.05)
    finally:
        signal.signal(signal.SIGTERM, previous)
    stopped = Terminated("after iteration 2; nothing was saved (no --save).",
                                where="iteration 3")
    assert stopped.sentence(0).startswith("rank 0: stopped by SIGTERM at iteration 3 (")
    assert stopped.sentence(0).endswith("; after iteration 2; nothing was saved (no --save).")


def test_what_counts_as_a_user_error(monkeypatch):
    assert isinstance(as_user_error(SystemExit("error: --seq-length is required.")), UserError)
    assert str(as_user_error(SystemExit("error: --seq-length is required."))) == \
        "--seq-length is required."
    assert as_user_error(SystemExit(2)) is None                 # argparse already said it
    assert as_user_error(ZeroDivisionError("a bug")) is None     # bugs keep their traceback
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert as_user_error(gloo) is None          # no process group here: not a peer's death
    monkeypatch.setattr(reporting, "_initialized", lambda: True)
    monkeypatch.setattr(reporting, "rank_and_world", lambda: (1, 2))
    raw = as_user_error(gloo)
    assert isinstance(raw, CollectiveFailure) and raw.consequence
    assert str(raw).startswith("rank 1: a collective failed outside a training step")
    with pytest.raises(ConfigError, match="^where: bad value$"):
        with reraise_as(ConfigError, ValueError, prefix="where: "):
            raise ValueError("bad value")
    with pytest.raises(KeyError):                                # other types pass through
        with reraise_as(ConfigError, ValueError):
            raise KeyError("x")
