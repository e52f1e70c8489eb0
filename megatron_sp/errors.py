"""User errors: the types of a mistake the user can fix, each one sentence (said once, without a
traceback, by megatron_sp/reporting.py).

A mistake the user can fix (a flag, a file, a layout, a run that diverged) raises a `UserError`
whose message is the whole story: what is wrong, where, and what to do. The training entry point
(`reporting.run_main`, used by pretrain_gpt.py) ends such a run with one line on stderr,

    error: <message>

and exit status 1, without a traceback; `--debug` (or MEGATRON_SP_DEBUG=1) prints the traceback
too. Anything else is a bug and keeps its traceback. The error types of the other modules derive
from `UserError`: ConfigError and DataError (here), LayoutError (mesh), PipelineLayoutError
(pipeline.partition), DataFileError (data); NonFiniteLossError and CollectiveFailure are here. This
module holds the error types only and imports nothing of megatron_sp (every module may import it);
how an error is said, once across the ranks, is megatron_sp/reporting.py's.
"""
from __future__ import annotations

import contextlib


class UserError(Exception):
    """A mistake the user can fix; the message is one sentence: what, where, what to do.

    `same_on_every_rank`: every rank finds it at the same point (flags, shared files), so rank 0
    alone reports it before the ranks can compare notes. `found_together`: every rank decides it
    from the same reduced values (a non-finite global loss), so the first to post says it
    without waiting for agreement (a loaded rank seconds behind does not make it "rank N: ..."). `consequence`: caused by another rank's
    failure (quiet when that rank reported its own error).
    """
    same_on_every_rank = True
    found_together = False
    consequence = False


class ConfigError(UserError, ValueError):
    """Model or training flags that do not fit together (sizes, batch sizes, layouts)."""


class DataError(UserError, ValueError):
    """Data flags, files or tokenizers that cannot be used as given."""


class UsageError(ConfigError):
    """argparse's complaint in a multi-rank run: reported like any UserError (said once), after
    the usage line, with argparse's exit status 2."""
    exit_code = 2

    def __init__(self, message: str, usage: str = ""):
        super().__init__(message)
        self.usage = usage


class NonFiniteLossError(UserError, RuntimeError):
    """The loss or gradient norm was NaN/inf and --nonfinite-loss is stop (or too many skips):
    decided from the loss and norm reduced over every rank, so found by all together."""

    found_together = True


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


class Terminated(KeyboardInterrupt):
    """SIGTERM on a rank of a multi-rank run: the launcher ending the job because another rank
    failed, or the scheduler (pre-emption, scancel) without --exit-signal-handler. A
    KeyboardInterrupt, so every path that cleans up after Ctrl-C (partial saves) does so here;
    `where` ("iteration 3") is filled in by the training loop."""

    def __init__(self, message: str = "", where: str | None = None):
        super().__init__(message)
        self.where = where

    def sentence(self, rank: int) -> str:
        where = f" at {self.where}" if self.where else ""
        tail = f"; {self}" if str(self) else "."
        return (f"rank {rank}: stopped by SIGTERM{where} (the launcher ends every rank when one "
                f"fails, and its report names the first; or the job was cancelled or pre-empted: "
                f"--exit-signal-handler saves a checkpoint first){tail}")
