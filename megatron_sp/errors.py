"""User errors: one sentence, said once, no traceback; and an exit that teardown cannot spoil.

A mistake the user can fix (a flag, a file, a layout, a run that diverged) raises a `UserError`
whose message is the whole story: what is wrong, where, and what to do. The training entry point
(`run_main`, used by pretrain_gpt.py) ends such a run with one line on stderr,

    error: <message>

and exit status 1, without a traceback; `--debug` (or MEGATRON_SP_DEBUG=1) prints the traceback
too. Anything else is a bug and keeps its traceback. The error types of the other modules derive
from `UserError`: ConfigError and DataError (here), LayoutError (mesh), PipelineLayoutError
(pipeline.partition), DataFileError (data); NonFiniteLossError and CollectiveFailure are here. The
module is a leaf: it imports nothing of megatron_sp.

Said once under torchrun/srun: ranks usually agree (every rank checks the same flags and files, and
the non-finite loss is reduced over every rank first), so only rank 0 prints. A rank that finds
an error the others do not see says it with its rank: "error: rank 3: ...". The ranks compare
notes through the rendezvous store (key/value, no collective, so it works while the process group
is wedged): each failing rank posts its message; rank 0 prints its own; another rank stays quiet
when rank 0 posted the same sentence within GRACE_S seconds; a CollectiveFailure (a consequence:
a peer died) stays quiet when some rank posted the error that caused it, and never waits (the
launcher ends the other ranks as soon as one failed). Before the process group
exists (argument errors) the ranks cannot compare, but they read the same command line: rank 0
speaks, unless the error is marked `same_on_every_rank = False` (a rendezvous it cannot reach).

Exit (`exit_process`): after the run ends, every rank leaves with os._exit, streams flushed,
skipping the interpreter's finalization. A finished 2-rank run under load died after its last
line with "terminate called without an active exception" (SIGABRT): a C++ thread (gloo's workers
release the last reference to a finished collective's tensors) took the GIL while the interpreter
was finalizing, and CPython ends such a thread with pthread_exit, whose unwinding through a
noexcept destructor calls std::terminate (pytorch/pytorch#38228). Everything the run writes is
closed before (metrics, TensorBoard, checkpoints, asynchronous saves): nothing is left to lose.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback

GRACE_S = 5.0             # how long a rank waits for rank 0's (or everyone's) note
_KEY = "megatron_sp/error"


class UserError(Exception):
    """A mistake the user can fix; the message is one sentence: what, where, what to do.

    `same_on_every_rank`: every rank finds it at the same point (flags, shared files), so rank 0
    alone reports it before the ranks can compare notes. `consequence`: caused by another rank's
    failure (quiet when that rank reported its own error).
    """
    same_on_every_rank = True
    consequence = False


class ConfigError(UserError, ValueError):
    """Model or training flags that do not fit together (sizes, batch sizes, layouts)."""


class DataError(UserError, ValueError):
    """Data flags, files or tokenizers that cannot be used as given."""


class NonFiniteLossError(UserError, RuntimeError):
    """The loss or gradient norm was NaN/inf and --nonfinite-loss is stop (or too many skips)."""


class CollectiveFailure(UserError, RuntimeError):
    """A collective failed during a step: another rank died, hung past the timeout, or vanished."""
    same_on_every_rank = False      # each rank says what it saw, with its rank
    consequence = True              # quiet when the rank that caused it reported its own error


_COMM_ERROR_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe",
                       "timed out", "timeout", "socket", "peer")


def is_collective_failure(err: BaseException) -> bool:
    """True for the errors torch.distributed raises when a peer dies or a collective times out."""
    import torch.distributed as dist
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = f"{type(err).__name__}: {err}".lower()
    return isinstance(err, RuntimeError) and any(m in text for m in _COMM_ERROR_MARKERS)



@contextlib.contextmanager
def reraise_as(error_type, *types, prefix: str = ""):
    """Errors of `types` raised inside are the user's (their message is the sentence): re-raised
    as `error_type` (a UserError), prefixed with where they came from."""
    try:
        yield
    except UserError:
        raise
    except types as err:
        raise error_type(prefix + str(err)) from err


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
    if _store() is not None and _rank_and_world()[1] > 1 and is_collective_failure(err):
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return CollectiveFailure(
            f"rank {_rank_and_world()[0]}: a collective failed outside a training step: another "
            f"rank has probably died or hung; look for the first failing rank in the job log. "
            f"Cause: {type(err).__name__}: {first}")
    return None


# Who speaks ------------------------------------------------------------------------------------

def _distributed():
    """torch.distributed when this process imported it (else no process group can exist, and a
    tool's error line does not wait seconds for torch to import), or None."""
    return sys.modules.get("torch.distributed")


def _rank_and_world() -> tuple[int, int]:
    dist = _distributed()
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    env = os.environ
    rank = env.get("RANK", env.get("SLURM_PROCID", "0"))
    world = env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1"))
    return int(rank), int(world)


def _store():
    """The rendezvous key/value store of the default process group, or None."""
    dist = _distributed()
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def _note(store, rank: int):
    """Rank `rank`'s posted message, or None."""
    key = f"{_KEY}/{rank}"
    return json.loads(store.get(key))["message"] if store.check([key]) else None


def should_print(error: UserError, rank: int, world: int, store) -> bool:
    """Whether this rank prints `error` (see the module docstring). Posts this rank's note."""
    if world == 1:
        return True
    if store is None:
        return rank == 0 or not error.same_on_every_rank
    if error.consequence:   # quiet when a rank reported the cause; one look, no wait: the launcher
        return store.add(f"{_KEY}/causes", 0) == 0     # is about to end this process
    message = str(error)
    store.set(f"{_KEY}/{rank}", json.dumps({"message": message}))
    store.add(f"{_KEY}/causes", 1)
    store.add(f"{_KEY}/posted", 1)
    if rank == 0:
        return True
    return _wait(lambda: _note(store, 0)) != message


def _linger(world: int, store) -> None:
    """Rank 0 stays until every rank posted (or GRACE_S): a store it hosts outlives their posts."""
    _wait(lambda: store.add(f"{_KEY}/posted", 0) >= world)


def _wait(probe):
    """probe() until it gives a true value or GRACE_S passed; its last value."""
    deadline = time.monotonic() + GRACE_S
    while True:
        value = probe()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def report(error: UserError) -> None:
    """Print `error` as one line, once across the ranks (the rank named where it differs)."""
    rank, world = _rank_and_world()
    store = _store()
    try:
        speak = should_print(error, rank, world, store)
    except Exception:      # the store is gone (its host exited): say it, with the rank
        speak, store = True, None
    message = str(error)
    if world > 1 and (rank != 0 or not error.same_on_every_rank or error.consequence) \
            and not message.startswith(f"rank {rank}"):
        message = f"rank {rank}: {message}"
    if speak:
        print(f"error: {message}", file=sys.stderr, flush=True)
    if rank == 0 and store is not None and world > 1 and not error.consequence:
        try:
            _linger(world, store)
        except Exception:
            pass


# Exit -------------------------------------------------------------------------------------------

def exit_process(code: int = 0):
    """Leave now with `code`: streams flushed, no interpreter finalization (see the docstring)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def run_main(main, argv=None):
    """Run `main(argv)` as a program: user errors as one sentence, bugs with their traceback, and
    the process always left through `exit_process` (0 when main returned)."""
    debug = debug_requested(argv)
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
    except KeyboardInterrupt as err:   # pretrain_gpt.py names the checkpoint that survived
        if _rank_and_world()[0] == 0:
            print("interrupted" + (f" {err}" if str(err) else ""), file=sys.stderr, flush=True)
        exit_process(130)
    except BaseException as err:
        error = as_user_error(err)
        if error is None or debug:
            traceback.print_exc()
        if error is not None:
            report(error)
        exit_process(1)
    exit_process(0)
