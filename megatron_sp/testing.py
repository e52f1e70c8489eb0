"""Helpers for the distributed tests: run a function on N gloo ranks on CPU.

Each rank is a fresh process with one thread, a file:// store (no port collisions between
concurrent jobs) and a short collective timeout, so a failing rank never hangs the suite. Ranks are
forked from a forkserver that imported torch and megatron_sp once per pytest run (a spawned rank
re-imports them: ~3.5 s of CPU each, 2-9 s per job on a loaded 2-core machine); each rank gets
the caller's current environment. MEGATRON_SP_TEST_START_METHOD=spawn restores fresh interpreters.
Put many checks into one `run_distributed` call all the same.
"""
from __future__ import annotations

import datetime
import functools
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# Imported once by the forkserver, before it forks any rank (a name that fails to import is
# skipped by multiprocessing); the tests' own modules are imported by each rank.
_PRELOAD = ["torch", "torch.distributed", "numpy", "megatron_sp.config", "megatron_sp.mesh",
            "megatron_sp.models", "megatron_sp.training", "megatron_sp.checkpointing",
            "megatron_sp.sharding.fsdp", "megatron_sp.sharding.distributed_optimizer",
            "megatron_sp.hf", "layout_utils",
            # the Hugging Face tests' ranks: the model classes and trainers (~3 s each to import)
            "transformers.models.llama.modeling_llama", "transformers.models.qwen3.modeling_qwen3",
            "transformers.models.qwen2.modeling_qwen2", "transformers.models.mistral.modeling_mistral",
            "transformers.models.gpt2.modeling_gpt2", "transformers.trainer", "trl"]


def _context():
    """forkserver (torch and megatron_sp preloaded), or MEGATRON_SP_TEST_START_METHOD."""
    method = os.environ.get("MEGATRON_SP_TEST_START_METHOD", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(rank, world_size, init_file, fn, args, results, timeout_s, environ=None):
    if environ is not None:      # the forkserver's environment is the one it started with
        os.environ.clear()
        os.environ.update(environ)
    torch.set_num_threads(1)
    os.environ["MEGATRON_SP_TEST_RANK"] = str(rank)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException:  # report every failure to the parent, including assertion errors
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout_s: float = 240.0,
                    collective_timeout_s: float = 60.0) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return each rank's result.

    `fn` must be a module-level (picklable) function. Any rank's exception is re-raised here with
    its traceback; a run longer than `timeout_s` is killed and reported.
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, world_size, init_file, fn, args, results, collective_timeout_s,
                                   dict(os.environ)))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        outputs, errors = {}, {}
        try:
            for _ in range(world_size):
                rank, ok, out = results.get(timeout=timeout_s)
                (outputs if ok else errors)[rank] = out
                if errors:
                    break
        except queue.Empty:
            errors[-1] = f"timed out after {timeout_s} s waiting for the ranks"
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
    if errors:
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise AssertionError(f"distributed run failed:\n{msg}")
    return [outputs[r] for r in range(world_size)]


def free_port() -> int:
    """A TCP port that is free right now on the loopback (for a torchrun --master-port)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finish_process(proc: subprocess.Popen, limit_s: float = 240.0) -> tuple[int, str]:
    """(exit status, combined output) of a script a test started in its own session
    (start_new_session=True); past limit_s its whole process group is killed and the test fails
    with the output's tail (a hang, never a stalled suite)."""
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"still running after {limit_s} s (a hang?):\n{out[-4000:]}") from None
    return proc.returncode, out


def metrics_losses(path) -> tuple[list[float], list[float]]:
    """(train lm_loss per logged iteration, valid_lm_loss per evaluation) of a --metrics-jsonl file."""
    import json
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return ([r["lm_loss"] for r in records if "lm_loss" in r],
            [r["valid_lm_loss"] for r in records if "valid_lm_loss" in r])


def assert_same_curve(reference, candidate, train: int, valid: int, rel: float = 1e-5) -> None:
    """Two --metrics-jsonl files log `train` training and `valid` validation losses that agree to
    `rel` relative (a layout against one rank)."""
    train1, valid1 = metrics_losses(reference)
    train2, valid2 = metrics_losses(candidate)
    assert (len(train1), len(valid1)) == (len(train2), len(valid2)) == (train, valid), \
        (train1, valid1, train2, valid2)
    for a, b in zip(train1 + valid1, train2 + valid2):
        assert abs(a - b) <= rel * abs(a), (train1 + valid1, train2 + valid2)


def load_script(relative_path: str):
    """A repository script (pretrain_gpt.py, tools/...) imported as a module by its path from the
    checkout root (scripts are not installed as packages)."""
    import importlib.util
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    name = os.path.splitext(os.path.basename(relative_path))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, relative_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module



def _script_rank(rank, world, port, path, argv, environ, log):
    """One rank of run_script: the launcher's environment by hand (RANK/WORLD_SIZE, as srun's
    tasks see it), output to `log`, the script's main under run_main (it leaves via exit_process)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))  # read at import by a fresh interpreter
    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.chdir(root)
    sys.argv = [os.path.join(root, path), *argv]
    install_faults(environ)
    from megatron_sp.reporting import run_main
    run_main(load_script(path).main, argv)


def run_script(path: str, argv: list[str], world: int = 1, timeout_s: float = 240.0,
               **env) -> tuple[list[int], str]:
    """(each rank's exit status, their output in rank order) of a repository script (e.g.
    "pretrain_gpt.py") run as `world` processes forked from run_distributed's forkserver, the
    environment set by hand as srun sets it for its tasks (no torchrun): what the script computes
    is what it computes under a launcher, without ~3.5 s of imports per rank. Tests of the
    launchers themselves (torchrun's SIGTERM, its exit codes) start real launchers instead.
    `env`: more environment variables (OMP_NUM_THREADS=1 by default)."""
    ctx = _context()
    environ = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
               and not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{k: str(v) for k, v in env.items()})
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        logs = [os.path.join(tmp, f"rank{r}.log") for r in range(world)]
        procs = [ctx.Process(target=_script_rank, daemon=True,
                             args=(r, world, port, path, list(argv), environ, logs[r]))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        out = "".join(open(log).read() for log in logs if os.path.exists(log))
    if hung:
        raise AssertionError(f"{path}: ranks {hung} still running after {timeout_s} s (a hang?):"
                             f"\n{out[-4000:]}")
    return [p.exitcode for p in procs], out


# Fault injection (a Trainer step hook) ----------------------------------------------------------

class FaultInjection:
    """Test-only faults as a Trainer step hook, from MEGATRON_SP_INJECT_* (read once):

      MEGATRON_SP_INJECT_NAN_AT_ITER=3[,5]   the loss (and so every gradient) becomes NaN at those
                                             iterations on rank MEGATRON_SP_INJECT_RANK (default 0);
                                             "3-12" is a range
      MEGATRON_SP_INJECT_INF_GRAD_AT_ITER=3  one gradient becomes inf (the loss stays finite)
      MEGATRON_SP_INJECT_KILL_AT_ITER=3      that rank sends itself MEGATRON_SP_INJECT_SIGNAL (KILL,
                                             or STOP for a hang) after its forward+backward
      MEGATRON_SP_INJECT_KILL_IN_EVAL_AT_ITER=4  the same during the evaluation after iteration 4
      MEGATRON_SP_INJECT_SLEEP_MS=200        that rank sleeps so long every step (a straggler)

    `from_env(rank)` gives None when none is set; install_faults adds it to every Trainer.
    """

    VARIABLES = ("MEGATRON_SP_INJECT_NAN_AT_ITER", "MEGATRON_SP_INJECT_INF_GRAD_AT_ITER",
                 "MEGATRON_SP_INJECT_KILL_AT_ITER", "MEGATRON_SP_INJECT_KILL_IN_EVAL_AT_ITER",
                 "MEGATRON_SP_INJECT_SLEEP_MS")

    @classmethod
    def from_env(cls, rank: int, environ=os.environ) -> "FaultInjection | None":
        return cls(rank, environ) if any(environ.get(v) for v in cls.VARIABLES) else None

    def __init__(self, rank: int, environ=os.environ):
        def ints(name):
            out = set()
            for x in environ.get(name, "").replace(" ", "").split(","):
                lo, _, hi = x.partition("-")
                out.update(range(int(lo), int(hi or lo) + 1) if x else ())
            return out
        target = int(environ.get("MEGATRON_SP_INJECT_RANK", "0"))
        mine = rank == target
        self.nan_iters = ints("MEGATRON_SP_INJECT_NAN_AT_ITER") if mine else set()
        self.inf_grad_iters = ints("MEGATRON_SP_INJECT_INF_GRAD_AT_ITER") if mine else set()
        self.kill_iters = ints("MEGATRON_SP_INJECT_KILL_AT_ITER") if mine else set()
        self.eval_kill_iters = ints("MEGATRON_SP_INJECT_KILL_IN_EVAL_AT_ITER") if mine else set()
        self.signal = getattr(signal, "SIG" + environ.get("MEGATRON_SP_INJECT_SIGNAL", "KILL").upper())
        self.sleep_s = float(environ.get("MEGATRON_SP_INJECT_SLEEP_MS", "0")) / 1000 if mine else 0.0
        self.rank = rank

    def before_forward(self, iteration: int, chunks) -> list:
        """Forward hooks making the last chunk's output NaN (loss, then every gradient, follow);
        or a gradient hook making one parameter's gradient inf (the loss stays finite)."""
        hooks = []
        if iteration in self.nan_iters:
            def poison(module, inputs, output):
                return output * float("nan") if torch.is_tensor(output) else output
            hooks.append(chunks[-1].register_forward_hook(poison))
        if iteration in self.inf_grad_iters:
            param = next(p for p in chunks[-1].parameters() if p.requires_grad)
            hooks.append(param.register_hook(lambda grad: torch.full_like(grad, float("inf"))))
        return hooks

    def after_compute(self, iteration: int, evaluating: bool = False):
        if self.sleep_s and not evaluating:
            time.sleep(self.sleep_s)
        if iteration in (self.eval_kill_iters if evaluating else self.kill_iters):
            print(f"[fault injection] rank {self.rank} sends itself {self.signal.name} "
                  f"{'in the evaluation after' if evaluating else 'at'} iteration {iteration} "
                  f"(t={time.time():.3f})", file=sys.stderr, flush=True)
            os.kill(os.getpid(), self.signal)


def install_faults(environ=None, trainer_module=None) -> bool:
    """Test-only faults in this process, from MEGATRON_SP_INJECT_* (nothing without them): every
    Trainer built here gets its rank's FaultInjection step hook, and
    MEGATRON_SP_INJECT_REPORT_DELAY_S=2 slows rank MEGATRON_SP_INJECT_RANK (default 0) before it
    reports a user error (the launcher's SIGTERM held off meanwhile, as while reporting), so that a
    test forces the launcher's race (another rank exits first); MEGATRON_SP_INJECT_GRACE_S sets
    reporting.GRACE_S (a test whose other rank is stopped need not wait 2 x 5 s for its word). The
    production code knows nothing
    of it; the tests' processes get it from tests/faults/sitecustomize.py (any script under any
    launcher: tests/conftest.py puts that folder on PYTHONPATH), run_script's ranks, or
    `python -m megatron_sp.testing SCRIPT ARGS...`. Returns whether faults were asked for."""
    environ = os.environ if environ is None else environ
    if not any(k.startswith("MEGATRON_SP_INJECT_") for k in environ):
        return False
    if trainer_module is None:
        from megatron_sp.training import trainer as trainer_module
    init = trainer_module.Trainer.__init__
    if not getattr(init, "_with_faults", False):
        @functools.wraps(init)
        def with_faults(self, *args, **kwargs):
            init(self, *args, **kwargs)
            faults = FaultInjection.from_env(self.mesh.rank, environ)
            if faults:
                self.step_hooks.append(faults)
        with_faults._with_faults = True
        trainer_module.Trainer.__init__ = with_faults
    delay = environ.get("MEGATRON_SP_INJECT_REPORT_DELAY_S")
    from megatron_sp import reporting
    if delay and not getattr(reporting.report, "_with_faults", False):
        report = reporting.report

        def delayed(error):
            if reporting.rank_and_world()[0] == int(environ.get("MEGATRON_SP_INJECT_RANK", "0")):
                held = signal.signal(signal.SIGTERM, lambda signum, frame: None)
                try:
                    time.sleep(float(delay))
                finally:
                    signal.signal(signal.SIGTERM, held)
            report(error)
        delayed._with_faults = True
        reporting.report = delayed
    grace = environ.get("MEGATRON_SP_INJECT_GRACE_S")
    if grace:                    # a shorter wait for agreement where no other rank can answer
        reporting.GRACE_S = float(grace)
    return True


def main(argv=None) -> None:
    """`python -m megatron_sp.testing SCRIPT ARGS...`: SCRIPT run as __main__ with the faults of
    MEGATRON_SP_INJECT_* installed (install_faults)."""
    import runpy
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        raise SystemExit("usage: python -m megatron_sp.testing SCRIPT [ARGS...]")
    install_faults()
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def packed_document_ids(kind: str, gen: torch.Generator, b: int, s: int, rate: float = 0.1,
                        device=None):
    """[b, s] int64 document ids of one kind, for the attention tests (None for "none"):
    "one-token" (a run of one-token documents, then one long one), "whole-row" (one document per
    row, spanning every rank's chunks), "hundreds" (~3-token documents), "random" (a document
    starts at each token with probability `rate`; the last row differs from the others)."""
    if kind == "none":
        return None
    if kind == "one-token":
        ids = torch.arange(s).expand(b, s).clone()
        ids[:, s // 2:] = s
    elif kind == "whole-row":
        ids = torch.full((b, s), 3)
    elif kind == "hundreds":
        ids = (torch.rand(b, s, generator=gen) < 0.3).long().cumsum(1)
    elif kind == "random":
        ids = (torch.rand(b, s, generator=gen) < rate).long().cumsum(1)
        ids[-1, : s // 3] = -1
    else:
        raise ValueError(f"unknown kind of documents {kind!r}.")
    return ids.to(device)


if __name__ == "__main__":
    main()
