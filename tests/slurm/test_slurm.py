"""The sbatch scripts of tools/slurm/ on a real (one-node, localhost) SLURM cluster.

It runs wherever SLURM is installed or can be (root with apt-get: Debian's slurm packages, about a
minute), CI included, and is skipped only where neither holds:

    python -m pytest -q tests/slurm

tests/slurm/start_local_cluster.sh installs munge + slurmctld + slurmd when missing and starts a
cluster with this host as its only node (2 fake GPUs); at the end stop_local_cluster.sh stops
every daemon it started (munged included; none that was already running) and one line on the
terminal says what was stopped and what was installed (left installed). Each test submits an unchanged script with
a tiny model on CPU/gloo (two processes), waits for it, and checks the metrics and checkpoints:
- pretrain_1node.sbatch (srun -> torchrun -> 2 ranks);
- pretrain_multinode_srun.sbatch on one node (srun -> 2 tasks reading SLURM_PROCID etc.);
- requeue: a USR1 to the batch shell (what #SBATCH --signal=B:USR1@N sends before the time limit)
  makes the training save and exit, the script requeues the job, and the requeued job resumes
  from the checkpoint to the last iteration (SLURM makes a requeued job eligible cred_expire
  seconds later: 120 by default, 5 in the test cluster's slurm.conf, whose backfill pass runs
  every second to start it then).

Run here (Debian 12, slurm 22.05, 2 CPUs): 3 passed in about 5 minutes plus the apt install.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest


def _slurm_available() -> bool:
    """SLURM's daemons and client are installed, or start_local_cluster.sh can install them (root
    with apt-get, not refused by MEGATRON_SP_SLURM_NO_INSTALL)."""
    if all(shutil.which(tool) for tool in ("sbatch", "slurmctld", "slurmd", "munged")):
        return True
    return (os.geteuid() == 0 and shutil.which("apt-get") is not None
            and not os.environ.get("MEGATRON_SP_SLURM_NO_INSTALL"))


pytestmark = [pytest.mark.skipif(
    not _slurm_available(),
    reason="SLURM is not installed and cannot be installed here (needs root and apt-get; "
           "docs/cluster.md)"),
    pytest.mark.timeout(1200)]   # the first test installs slurm with apt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STATE = os.environ.get("MEGATRON_SP_SLURM_STATE", "/tmp/megatron_sp_slurm")
TINY_MODEL = ("--mock-data --vocab-size 512 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
              "--seq-length 32")


def say(request, line: str) -> None:
    """One line on the terminal, past pytest's capture (what the tests did to the machine)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)
    else:
        print(line, file=sys.stderr)


@pytest.fixture(scope="module")
def slurm_env(request):
    """The local cluster; afterwards every daemon the start script started (munged, slurmctld,
    slurmd) is stopped, and one line says so and what it installed."""
    stop = ["bash", os.path.join(ROOT, "tests/slurm/stop_local_cluster.sh"), STATE]
    request.addfinalizer(lambda: say(request, subprocess.run(
        stop, capture_output=True, text=True, timeout=120).stdout.strip()))
    start = subprocess.run(["bash", os.path.join(ROOT, "tests/slurm/start_local_cluster.sh"), STATE],
                           capture_output=True, text=True, timeout=600)
    assert start.returncode == 0, start.stdout + start.stderr
    env = dict(os.environ, SLURM_CONF=os.path.join(STATE, "slurm.conf"))
    for key in list(env):
        if key.startswith("SLURM_") and key != "SLURM_CONF" or key in ("RANK", "WORLD_SIZE"):
            env.pop(key)
    return env


def job_env(base, run_dir, train_iters, **extra):
    env = dict(base, MODEL_ARGS=TINY_MODEL, DATA_ARGS="", LAYOUT_ARGS="",
               TRAIN_ARGS=(f"--micro-batch-size 1 --global-batch-size 2 --train-iters {train_iters} "
                           "--eval-iters 0 --distributed-timeout-minutes 1"),
               GPUS_PER_NODE="2", RUN_DIR=str(run_dir), SAVE_INTERVAL="4", LOG_INTERVAL="2",
               PYTHON=sys.executable, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def sbatch(env, script, log, *options, wait=True, timeout=300):
    """Submit; with wait, return once the job has ended, returncode 0 if it completed with exit
    code 0 (as `sbatch --wait` says, but polled every 0.2 s: `--wait` polls every 10 s, 6 s lost
    per 4 s job here)."""
    cmd = ["sbatch", "--parsable", f"--output={log}", "--gpus-per-node=2", "--time=10",
           *options, os.path.join(ROOT, "tools/slurm", script)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if not wait or proc.returncode != 0:
        return proc
    job, deadline = proc.stdout.strip().split(";")[0], time.time() + timeout
    while True:
        info = subprocess.run(["scontrol", "-o", "show", "job", job], env=env,
                              capture_output=True, text=True).stdout
        fields = dict(f.split("=", 1) for f in info.split() if "=" in f)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                      "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"):
            ok = fields["JobState"] == "COMPLETED" and fields.get("ExitCode") == "0:0"
            proc.returncode = 0 if ok else 1
            proc.stdout += info
            return proc
        assert time.time() < deadline, f"job {job} still {fields.get('JobState')} after {timeout} s"
        time.sleep(0.2)


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def latest_checkpoint(run_dir):
    with open(os.path.join(run_dir, "checkpoints", "latest_checkpointed_iteration.txt")) as f:
        return f.read().strip()


def read(path):
    return open(path).read() if os.path.exists(path) else "(no log)"


def test_one_node_torchrun(slurm_env, tmp_path):
    run, log = tmp_path / "run", tmp_path / "job.out"
    proc = sbatch(job_env(slurm_env, run, 8), "pretrain_1node.sbatch", log, "--job-name=msp-1node")
    assert proc.returncode == 0, proc.stdout + proc.stderr + read(log)
    out = read(log)
    assert "launcher torchrun" in out and "iteration        8/       8" in out, out
    assert [r["iteration"] for r in metrics(run) if "lm_loss" in r] == [2, 4, 6, 8]
    assert latest_checkpoint(run) == "8"


def test_srun_one_task_per_gpu(slurm_env, tmp_path):
    run, log = tmp_path / "run", tmp_path / "job.out"
    proc = sbatch(job_env(slurm_env, run, 6), "pretrain_multinode_srun.sbatch", log,
                  "--job-name=msp-srun", "--nodes=1", "--ntasks-per-node=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr + read(log)
    out = read(log)
    assert "launcher srun" in out and "ParallelMesh(world=2" in out, out
    records = [r for r in metrics(run) if "lm_loss" in r]
    assert [r["iteration"] for r in records] == [2, 4, 6]
    assert all(r["straggler_rank"] in (0, 1) for r in records)
    assert latest_checkpoint(run) == "6"


def test_signal_saves_and_requeues(slurm_env, tmp_path):
    run, log = tmp_path / "run", tmp_path / "job.out"
    iters = 60      # rank 0 sleeps 100 ms a step: the signal, sent at iteration 5, finds the
    # training running (>= 5 s left; it is handled within an iteration, measured), and the
    # requeued run's 50-odd iterations take ~6 s (200 took 22 s)
    env = job_env(slurm_env, run, iters, SAVE_INTERVAL="1000", LOG_INTERVAL="1",
                  MEGATRON_SP_INJECT_SLEEP_MS="100", MEGATRON_SP_INJECT_RANK="0")
    proc = sbatch(env, "pretrain_1node.sbatch", log, "--job-name=msp-requeue", wait=False)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    deadline = time.time() + 480    # SLURM holds a requeued job for cred_expire (5 s here; 120 s
                                    # where an older test cluster still runs)
    while time.time() < deadline:        # wait until training runs, then signal the batch shell
        if os.path.exists(run / "metrics.jsonl") and len(metrics(run)) >= 5:
            break
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm_env, check=True)
    while time.time() < deadline:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=slurm_env,
                               capture_output=True, text=True).stdout.strip()
        if not state and os.path.exists(run / "metrics.jsonl") and \
                metrics(run)[-1].get("iteration") == iters:
            break
        time.sleep(0.5)
    out = read(log)
    assert "batch script got SIGUSR1" in out and "requeueing job" in out, out[-5000:]
    assert "(restart 1)" in out, out[-5000:]
    iterations = [r["iteration"] for r in metrics(run) if "lm_loss" in r]
    assert iterations[-1] == iters, iterations
    # The second run resumed from the checkpoint written at the signal: no iteration restarted
    # from 1, iterations continue after the saved one.
    assert iterations.count(1) == 1, iterations
    assert sorted(set(iterations)) == list(range(1, iters + 1)), iterations
    assert latest_checkpoint(run) == str(iters)
