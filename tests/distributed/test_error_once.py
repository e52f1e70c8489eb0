"""A mistake is said exactly once under a launcher, whoever the launcher ends first (errors.py).

torchrun ends every other rank (SIGTERM) as soon as one exits non-zero. Before the fix, a rank that
stayed quiet (rank 0 speaks for what every rank finds) could exit first, and rank 0 was ended
before it printed: no `error:` line at all (measured: 1 run in 5 had the line). Here the race is
forced: rank 0 is slowed before it reports (MEGATRON_SP_INJECT_REPORT_DELAY_S), so another rank
always gets there first, and every launch must still print exactly one `error:` line with the
sentence. The launches run concurrently (their waits overlap; the load they make is part of the
test).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from megatron_sp.testing import finish_process, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "1", "--eval-iters", "0"]
ERROR_LINE = re.compile(r"^(\[[^\]]*\]:?)?\s*error: (.*)$", re.M)


def env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith("MEGATRON_SP_INJECT_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
         and not k.startswith("SLURM_") and not k.startswith("TORCHELASTIC_")}
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.update({k: str(v) for k, v in extra.items()})
    return e


def torchrun(nproc: int, script_args: list[str], no_python: bool = False, **extra):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                "--master-port", str(free_port())]
    target = script_args if no_python else ["pretrain_gpt.py", *script_args]
    return subprocess.Popen(launcher + (["--no-python"] if no_python else []) + target, cwd=ROOT,
                            env=env(**extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def by_hand(world: int, args: list[str], slurm: bool = False, **extra) -> list[subprocess.Popen]:
    """RANK/WORLD_SIZE set by hand, or srun's SLURM_PROCID/SLURM_NTASKS (slurm=True, the address
    from the node list): no launcher ends anybody."""
    port = free_port()

    def rank_env(r):
        if slurm:
            return env(SLURM_PROCID=r, SLURM_LOCALID=r, SLURM_NTASKS=world, SLURM_JOB_ID=77,
                       SLURM_JOB_NODELIST="127.0.0.1", MASTER_PORT=port, **extra)
        return env(RANK=r, LOCAL_RANK=r, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, **extra)
    return [subprocess.Popen([sys.executable, "pretrain_gpt.py", *args], cwd=ROOT, env=rank_env(r),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True) for r in range(world)]


def error_lines(out: str) -> list[str]:
    return [m.group(2) for m in ERROR_LINE.finditer(out)]


@pytest.mark.timeout(420)
def test_each_mistake_is_said_exactly_once_whoever_exits_first(tmp_path):
    """Two mistakes every rank finds before the rendezvous, one after it, one rank alone with a
    bad file, an unknown flag; rank 0 slowed by 2 s in each (the race forced); and the first case
    again at 4 ranks and launched by hand, and one found after the rendezvous of 4 ranks launched
    by hand (rank 0 hosts the store the others wait on). (A third start-up mistake, sizes 3 x 2
    for cp 2, took the same path as "a2a+p2p without sizes": its sentence is checked in
    tests/unit/test_megatron_compat.py.)"""
    slow = dict(MEGATRON_SP_INJECT_REPORT_DELAY_S=2, MEGATRON_SP_INJECT_RANK=0)
    missing = str(tmp_path / "missing" / "corpus_text_document")
    alone = tmp_path / "alone.sh"      # rank 1's node lacks the file rank 0 has (here: mock data)
    alone.write_text(textwrap.dedent(f"""\
        if [ "$LOCAL_RANK" = 1 ]; then data="--data-path {missing} --tokenizer-type NullTokenizer"
        else data=--mock-data; fi
        exec {sys.executable} pretrain_gpt.py {' '.join(TINY)} $data
        """))
    mock = ["--mock-data", *TINY]
    cases = {   # name: (process(es), words of the sentence, the rank it must name or None)
        "a2a+p2p without sizes": (torchrun(2, [*mock, "--context-parallel-size", "2",
                                               "--cp-comm-type", "a2a+p2p"], **slow),
                                  "needs --hierarchical-context-parallel-sizes", None),
        "missing --data-path": (torchrun(2, [*TINY, "--data-path", missing, "--tokenizer-type",
                                             "NullTokenizer"], **slow), missing, None),
        "after the rendezvous": (torchrun(2, [*mock, "--sequence-parallel-size", "2",
                                              "--seq-length", "33"], **slow), "33", None),
        "one rank's bad file": (torchrun(2, ["bash", str(alone)], no_python=True, **slow),
                                missing, 1),
        "unknown flag": (torchrun(2, [*mock, "--seq-len", "64"], **slow),
                         "did you mean --seq-length?", None),
        "4 ranks": (torchrun(4, [*mock, "--context-parallel-size", "4", "--cp-comm-type",
                                 "a2a+p2p"]), "needs --hierarchical-context-parallel-sizes", None),
        "by hand": (by_hand(2, [*mock, "--context-parallel-size", "2", "--cp-comm-type",
                                "a2a+p2p"], **slow),
                    "needs --hierarchical-context-parallel-sizes", None),
        "srun-style": (by_hand(2, ["--mock-data", *TINY, "--seq-len", "64"], slurm=True, **slow),
                       "did you mean --seq-length?", None),
        "by hand, 4 ranks, after the rendezvous": (   # rank 0 hosts the store: it must outlive
            by_hand(4, [*mock, "--sequence-parallel-size", "2", "--seq-length", "33"]),   # the
            "33", None),                                                                  # rest
    }
    failures = []
    for name, (procs, words, rank) in cases.items():
        procs = procs if isinstance(procs, list) else [procs]
        results = [finish_process(p, 240) for p in procs]
        out = "\n".join(o for _, o in results)
        lines = error_lines(out)
        # (an agreed sentence is said without a rank unless the ranks reached it more than
        # GRACE_S apart, which a loaded machine can make: the count is what is asserted)
        ok = (all(rc != 0 for rc, _ in results) and len(lines) == 1 and words in lines[0]
              and (rank is None or lines[0].startswith(f"rank {rank}: ")))
        if not ok:
            failures.append(f"--- {name}: exit {[rc for rc, _ in results]}, error lines "
                            f"{lines}\n{out[-2500:]}")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(180)
def test_a_cancelled_job_says_where_it_stopped_once():
    """SIGTERM to torchrun (scancel, a pre-emption without --exit-signal-handler): it ends every
    rank with SIGTERM at the same moment; one line says where training stopped."""
    proc = torchrun(2, ["--mock-data", *TINY, "--train-iters", "100000", "--log-interval", "1"])
    seen = []
    try:
        for line in proc.stdout:          # until training is under way
            seen.append(line)
            if re.match(r"^\s*iteration\s+2/", line):
                break
        proc.send_signal(signal.SIGTERM)      # torchrun forwards it to every rank
        rc, out = finish_process(proc, 60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(seen) + out
    lines = error_lines(out)
    assert rc != 0 and len(lines) == 1, out[-3000:]
    assert re.match(r"rank [01]: stopped by SIGTERM (at iteration \d+ )?\(the launcher ends every "
                    r"rank when one fails.*after iteration \d+; nothing was saved \(no --save\)",
                    lines[0]), lines
