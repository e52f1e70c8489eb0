"""The files around a preprocessing run: its input (compressed or not), its temporary folder, the
leftovers of a run that was killed, and the signals that stop it.

Every file a run writes before it is complete lives in one temporary folder next to the output,
`.preprocess.{name}.{pid}@{host}` (name: the output prefix's file name): the .bin/.idx being
written, the pool workers' spill files and a decompressed input. Removing that folder removes
everything; the outputs are renamed out of it when complete (same file system). A run killed with
SIGKILL (or a machine that went down) leaves its folder: the next run with the same output prefix
on the same host removes it once its pid is not running any more, and says so in one line.
SIGTERM and SIGINT are turned into exceptions while a run is in progress, so the same cleanup
runs as for an error (`stop_on_signals`).
"""
import bz2
import contextlib
import gzip
import lzma
import os
import re
import shutil
import signal
import socket
import threading
import zlib

from megatron_sp.fileutil import pid_running

from .indexed_dataset import DataError

COPY_BYTES = 1 << 22                # decompression buffer
_FORMATS = (    # (magic bytes, name, how to open it for reading as bytes)
    (b"\x1f\x8b", "gzip", gzip.open),
    (b"BZh", "bzip2", bz2.open),
    (b"\xfd7zXZ\x00", "xz", lzma.open),
    (b"\x28\xb5\x2f\xfd", "zstd", None),            # zstandard, when it is installed
)
_SUFFIXES = {"gzip": ".gz", "bzip2": ".bz2", "xz": ".xz", "zstd": ".zst"}


class Stopped(BaseException):
    """SIGTERM arrived while preprocessing (a BaseException: nothing catches it on its way up to
    the cleanup); the tool reports it as one line and exits 1."""

    def __init__(self, signum):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


# The temporary folder and the leftovers of killed runs ------------------------------------------

def _host():
    return socket.gethostname()




def temp_folder_name(output_prefix: str, pid: int | None = None) -> str:
    folder, name = os.path.split(os.path.abspath(output_prefix))
    return os.path.join(folder, f".preprocess.{name}.{pid or os.getpid()}@{_host()}")


def remove_leftovers(output_prefix: str, json_keys, log) -> list[str]:
    """Remove what killed runs with this output prefix left on this host (their pid is not
    running): their temporary folders, and the `{output}.tmp{pid}` files of earlier versions.
    Says so in one line; returns the paths removed."""
    folder, name = os.path.split(os.path.abspath(output_prefix))
    ours = re.compile(rf"^\.preprocess\.{re.escape(name)}\.(\d+)@{re.escape(_host())}$")
    outputs = tuple(f"{name}_{k}_document{ext}" for k in json_keys for ext in (".bin", ".idx"))
    older = re.compile(rf"^(?:{'|'.join(map(re.escape, outputs))})\.tmp(\d+)$")
    removed, pids = [], set()
    for entry in sorted(os.listdir(folder)):
        match = ours.match(entry) or older.match(entry)
        if match is None or int(match.group(1)) == os.getpid() or pid_running(match.group(1)):
            continue
        path = os.path.join(folder, entry)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        removed.append(path)
        pids.add(match.group(1))
    if removed and log is not None:
        print(f"note: removed what an earlier preprocessing run with this output prefix left when "
              f"it was killed (pid {', '.join(sorted(pids))}, no longer running): "
              f"{', '.join(removed)}", file=log, flush=True)
    return removed


def make_temp_folder(path: str) -> str:
    """Create this run's temporary folder `path` (temp_folder_name); one that is there already,
    with our pid and host, can only be a dead run's."""
    shutil.rmtree(path, ignore_errors=True)
    os.mkdir(path, 0o700)
    return path


# The input ------------------------------------------------------------------------------------

def compression_of(path: str) -> str | None:
    """'gzip', 'bzip2', 'xz', 'zstd' from the file's first bytes (not its name), or None."""
    with open(path, "rb") as f:
        head = f.read(8)
    return next((name for magic, name, _ in _FORMATS if head.startswith(magic)), None)


def _opener(kind: str, path: str):
    if kind != "zstd":
        return next(opener for _, name, opener in _FORMATS if name == kind)
    try:
        import zstandard
    except ImportError:
        raise DataError(f"{path} is zstd-compressed but the zstandard package is not installed; "
                        f"install it (pip install zstandard) or decompress the file first "
                        f"(zstd -d).") from None
    return lambda p, mode: zstandard.ZstdDecompressor().stream_reader(open(p, "rb"),
                                                                      closefd=True)


def readable_input(path: str, temp_folder: str, log) -> str:
    """The path of `path`'s text: itself, or its decompressed copy in `temp_folder` (a compressed
    input is recognised by its first bytes; one not named for its format is said so)."""
    kind = compression_of(path)
    if kind is None:
        return path
    opener = _opener(kind, path)
    if not path.endswith(_SUFFIXES[kind]) and log is not None:
        print(f"note: {path} is {kind}-compressed (its name does not end in {_SUFFIXES[kind]}): "
              f"reading it decompressed.", file=log, flush=True)
    plain = os.path.join(temp_folder, "input.jsonl")
    try:
        with opener(path, "rb") as src, open(plain, "wb") as dst:
            shutil.copyfileobj(src, dst, COPY_BYTES)
    except Exception as err:     # noqa: BLE001 - the decompressors' own errors, told apart below
        if not _damaged(err):
            raise
        raise DataError(f"{path}: the {kind} data is damaged or incomplete ({err}); recompress "
                        f"it or pass the uncompressed file.") from None
    return plain


def _damaged(err: Exception) -> bool:
    """Whether `err` says the compressed data is bad (not the disk: an OSError with an errno)."""
    if isinstance(err, OSError):
        return err.errno is None            # gzip.BadGzipFile, bz2's "Invalid data stream"
    return isinstance(err, (EOFError, lzma.LZMAError, zlib.error)) or \
        type(err).__module__.startswith("zstandard")


# Signals --------------------------------------------------------------------------------------

def _raise_stopped(signum, frame):
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_signals():
    """SIGTERM raises Stopped (SIGINT raises KeyboardInterrupt, Python's default) in this
    process while the block runs; the previous handlers come back after. Only in the main
    thread (signal handlers can be set nowhere else)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_held():
    """SIGTERM and SIGINT wait while the block runs (the cleanup is not interrupted halfway);
    one that came meanwhile is delivered after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGTERM, signal.SIGINT}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def quiet_worker():
    """A pool worker's signals: Ctrl-C (sent to the whole process group) is the parent's to
    handle, and SIGTERM (the parent's pool.terminate) ends the worker at once, without a
    traceback; the parent removes what it wrote."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
