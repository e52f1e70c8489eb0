"""How a user error is said: one sentence, once across the ranks, no traceback; and an exit that
teardown cannot spoil (the error types: megatron_sp/errors.py; docs/design.md §12).

Said once under torchrun/srun, whoever the launcher ends first (the ranks compare notes on a
key/value store, no collective, so it works while the process group is wedged):

- the store: the process group's once it exists; before it, torchrun's agent store (every rank is
  its client, and it outlives the workers) or, launched by hand / srun, the store rank 0 hosts once
  its own start-up checks passed (a rank that cannot reach it within GRACE_S says nothing when the
  error is the same on every rank: rank 0 found it too, and says it without a store);
- a cause (any UserError but a consequence): each failing rank posts its sentence; the first rank
  to post a sentence says it, the others stay quiet but do not exit before it has been said (the
  launcher ends the other ranks as soon as one exits: the sentence would be lost with the rank
  that was about to print it). The speaker waits up to GRACE_S for another rank to find the same:
  a sentence no other rank agrees with carries its rank ("error: rank 3: ..."), so does an error
  marked `same_on_every_rank = False`;
- a consequence (CollectiveFailure: a peer died; Terminated: the launcher's SIGTERM) is quiet when
  some rank posted a cause, and said once, by the first rank to claim it, otherwise;
- while a rank reports, the launcher's SIGTERM is held off (torchrun's grace is 30 s; a report
  under torchrun takes at most 2 x GRACE_S); at any other time it raises Terminated (a
  KeyboardInterrupt: saves clean up as for Ctrl-C) and the rank reports that as a consequence;
- the rank hosting the store (rank 0 launched by hand) stays until every reporting rank is done
  with it (at most 2 x GRACE_S more): a rank still waiting on a dead store says its line again;
- under torchrun each reporting rank also writes its sentence to TORCHELASTIC_ERROR_FILE, so the
  launcher's closing "Root Cause" block shows it as the failure's "traceback" (our `error:` line
  stands above the block).

Exit (`exit_process`): after the run ends, every rank leaves with os._exit, streams flushed,
skipping the interpreter's finalization. A finished 2-rank run under load died after its last
line with "terminate called without an active exception" (SIGABRT): a C++ thread (gloo's workers
release the last reference to a finished collective's tensors) took the GIL while the interpreter
was finalizing, and CPython ends such a thread with pthread_exit, whose unwinding through a
noexcept destructor calls std::terminate (pytorch/pytorch#38228). Everything the run writes is
closed before (metrics, TensorBoard, checkpoints, asynchronous saves): nothing is left to lose.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
import traceback

from megatron_sp.errors import CollectiveFailure, Terminated, UserError, is_collective_failure

GRACE_S = 5.0             # how long a speaker waits for agreement (a quiet rank: 2x)
_KEY = "megatron_sp/error"


def debug_requested(argv=None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return "--debug" in argv or os.environ.get("MEGATRON_SP_DEBUG", "") not in ("", "0")


def as_user_error(err: BaseException) -> UserError | None:
    """The UserError that `err` stands for, or None for a bug (keeps its traceback).

    SystemExit("error: ...") is the older form of the same sentence; a raw collective error of a
    multi-rank run (a peer died outside a training step) becomes a CollectiveFailure."""
    if isinstance(err, UserError):
        return err
    if isinstance(err, SystemExit) and isinstance(err.code, str):
        message = err.code[len("error: "):] if err.code.startswith("error: ") else err.code
        return UserError(message)
    if _initialized() and rank_and_world()[1] > 1 and is_collective_failure(err):
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return CollectiveFailure(
            f"rank {rank_and_world()[0]}: a collective failed outside a training step: another "
            f"rank has probably died or hung; look for the first failing rank in the job log. "
            f"Cause: {type(err).__name__}: {first}")
    return None


class _Stopped(UserError):
    """A Terminated, reported as a consequence."""
    same_on_every_rank = False
    consequence = True


def _distributed():
    """torch.distributed when this process imported it (else no process group can exist, and a
    tool's error line does not wait seconds for torch to import), or None."""
    return sys.modules.get("torch.distributed")


def _initialized() -> bool:
    dist = _distributed()
    return dist is not None and dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """(rank, world size): the process group's, else the launcher's (torchrun's RANK / WORLD_SIZE,
    srun's SLURM_PROCID / SLURM_NTASKS), else (0, 1)."""
    if _initialized():
        dist = _distributed()
        return dist.get_rank(), dist.get_world_size()
    env = os.environ
    rank = env.get("RANK", env.get("SLURM_PROCID", "0"))
    world = env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1"))
    return int(rank), int(world)


def _store(error: UserError | None = None):
    """The store the ranks compare notes on about `error` (see the module docstring), or None."""
    if _initialized():
        try:
            return _distributed().distributed_c10d._get_default_store()
        except Exception:
            return None
    return _launcher_store(error)


def _launcher_store(error: UserError | None = None):
    """Before the process group: torchrun's agent store, or (rank > 0) the one rank 0 hosts at
    the launcher's address (torchrun's, srun's: mesh.distributed_env); not for a rank-specific
    error without torchrun (it is said anyway, and nobody ends the others)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    rank, world = rank_and_world()
    if world < 2 or _distributed() is None \
            or (not agent and (rank == 0 or (error is not None and not error.same_on_every_rank))):
        return None
    import datetime
    from megatron_sp.mesh import distributed_env      # torch only when a store is needed
    from megatron_sp.rendezvous import open_store
    env = distributed_env()
    if env is None:
        return None
    store = open_store(env["master_addr"], env["master_port"], rank, world,
                       datetime.timedelta(seconds=GRACE_S), agent)
    return None if isinstance(store, BaseException) else store


class Notes:
    """One rank's side of the protocol on `store` (module docstring): who says a sentence.

    Keys live under megatron_sp/error/<attempt>/ (torchrun's restart count: its agent store
    outlives a restarted worker group)."""

    def __init__(self, store, rank: int, world: int, environ=os.environ):
        self.store, self.rank, self.world = store, rank, world
        self.prefix = f"{_KEY}/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def _count(self, name: str, n: int = 0) -> int:
        return self.store.add(f"{self.prefix}/{name}", n)

    def _said(self, slot: str) -> bool:
        return self.store.check([f"{self.prefix}/said/{slot}"])

    def line(self, error: UserError) -> tuple[str | None, str]:
        """(the line this rank prints, or None to stay quiet; the slot to mark said after it)."""
        self._count("reported", 1)
        if error.consequence:
            return self._consequence(error)
        message = str(error)
        slot = hashlib.sha1(message.encode()).hexdigest()[:16]
        self._count("causes", 1)                     # ranks that posted a cause
        if self._count(f"claims/{slot}", 1) > 1:     # another rank says it: stay until it has
            _wait(lambda: self._said(slot), 2 * GRACE_S)
            return None, slot
        if error.same_on_every_rank and error.found_together:
            return message, slot                     # every rank found it: no need to compare
        if error.same_on_every_rank:                 # does another rank find the same?
            _wait(lambda: self._count(f"claims/{slot}") > 1 or self._count("causes") >= self.world)
            if self._count(f"claims/{slot}") > 1:
                return message, slot
        return _with_rank(message, self.rank), slot

    def _consequence(self, error: UserError) -> tuple[str | None, str]:
        if self._count("causes") > 0:                # its cause was said by the rank that had it
            return None, "consequence"
        if self._count("claims/consequence", 1) > 1:
            _wait(lambda: self._said("consequence"), 2 * GRACE_S)
            return None, "consequence"
        return _with_rank(str(error), self.rank), "consequence"

    def mark_said(self, slot: str) -> None:
        self.store.set(f"{self.prefix}/said/{slot}", "1")

    def finish(self) -> None:
        """This rank is done with the store (said its line, or saw it said)."""
        self._count("done", 1)

    def linger(self) -> None:
        """The rank hosting the store (rank 0 launched by hand) stays until every rank reported
        and finished (or 2 x GRACE_S): the store dies with it, and a rank still waiting on it
        would say its line again, with its rank."""
        _wait(lambda: self._count("reported") >= self.world
              and self._count("done") >= self._count("reported"), 2 * GRACE_S)


def _with_rank(message: str, rank: int) -> str:
    return message if message.startswith(f"rank {rank}") else f"rank {rank}: {message}"


def _wait(probe, seconds: float | None = None):
    """probe() until it gives a true value or `seconds` (GRACE_S) passed; its last value."""
    deadline = time.monotonic() + (GRACE_S if seconds is None else seconds)
    while True:
        value = probe()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def _line_without_store(error: UserError, rank: int, world: int) -> str | None:
    """No store to compare on: rank 0 speaks for what every rank finds."""
    if world == 1:
        return str(error)
    if error.same_on_every_rank and not error.consequence:
        return str(error) if rank == 0 else None
    return _with_rank(str(error), rank)


def _hosts_store(store) -> bool:
    return store is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" \
        and rank_and_world()[0] == 0


def _write_launcher_error_file(line: str) -> None:
    """torchrun's error file: its report then shows our sentence as this rank's "traceback"."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                         "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:
        pass


_reporting = False      # this process is reporting: the launcher's SIGTERM waits (see docstring)


def _on_sigterm(signum, frame):
    if not _reporting:
        raise Terminated()


def hold_sigterm() -> None:
    """SIGTERM raises Terminated, except while a report is being made (run_main, multi-rank)."""
    signal.signal(signal.SIGTERM, _on_sigterm)


def report(error: UserError) -> None:
    """Print `error` as one line, once across the ranks (the rank named where it differs)."""
    global _reporting
    _reporting = True
    rank, world = rank_and_world()
    store = _store(error) if world > 1 else None
    slot = None
    try:
        if store is None:
            line = _line_without_store(error, rank, world)
        else:
            notes = Notes(store, rank, world)
            line, slot = notes.line(error)
    except Exception:      # the store is gone (its host exited): say it, with the rank
        line, store = _with_rank(str(error), rank) if world > 1 else str(error), None
    if line is not None:
        print(f"{getattr(error, 'usage', '')}error: {line}", file=sys.stderr, flush=True)
    _write_launcher_error_file(line or str(error))
    if store is None:
        return
    try:
        if line is not None:
            notes.mark_said(slot)
        notes.finish()
        if _hosts_store(store):
            notes.linger()
    except Exception:
        pass


def exit_process(code: int = 0):
    """Leave now with `code`: streams flushed, no interpreter finalization (see the docstring)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def say_user_errors() -> None:
    """For library entry points inside a user's own script (megatron_sp.hf's trainers and
    sequence_parallel): an uncaught UserError ends the script as run_main ends ours, one `error:`
    line said once across the ranks, exit status 1, no traceback (MEGATRON_SP_DEBUG=1 keeps it).
    A sys.excepthook, installed once: the script can still catch the error itself, and anything
    else reaches the previous hook unchanged."""
    previous = sys.excepthook
    if getattr(previous, "_megatron_sp", False):
        return

    def hook(kind, value, tb):
        error = as_user_error(value) if isinstance(value, BaseException) else None
        if error is None or debug_requested([]):
            return previous(kind, value, tb)
        report(error)
        exit_process(getattr(error, "exit_code", 1))

    hook._megatron_sp = True
    sys.excepthook = hook


def run_main(main, argv=None):
    """Run `main(argv)` as a program: user errors as one sentence, bugs with their traceback, and
    the process always left through `exit_process` (0 when main returned). In a multi-rank run
    SIGTERM raises Terminated (said once, as a consequence) except while a rank reports."""
    debug = debug_requested(argv)
    if rank_and_world()[1] > 1:
        hold_sigterm()
    try:
        main(argv)
    except SystemExit as err:
        error = as_user_error(err)
        if error is None:          # argparse (--help, usage errors) or sys.exit(n)
            exit_process(err.code if isinstance(err.code, int) else 0)
        if debug:
            traceback.print_exc()
        report(error)
        exit_process(1)
    except Terminated as err:          # the launcher's (or the scheduler's) SIGTERM
        report(_Stopped(err.sentence(rank_and_world()[0])))
        exit_process(128 + signal.SIGTERM)
    except KeyboardInterrupt as err:   # pretrain_gpt.py names the checkpoint that survived
        if rank_and_world()[0] == 0:
            print("interrupted" + (f" {err}" if str(err) else ""), file=sys.stderr, flush=True)
        exit_process(130)
    except BaseException as err:
        error = as_user_error(err)
        if error is None or debug:
            traceback.print_exc()
        if error is not None:
            report(error)
        exit_process(getattr(error, "exit_code", 1))
    exit_process(0)
