"""The rendezvous without a launcher (megatron_sp/rendezvous.py, issue 26): within the timeout on
every rank, naming the address; another job's store refused, not joined.

In-process (the store is created in a thread; the checks need no process group), plus one
srun-style pair of pretrain_gpt.py ranks (SLURM_PROCID/SLURM_NTASKS) against a silent listener.
"""
import datetime
import json
import os
import socket
import subprocess
import sys
import threading

import pytest
import torch.distributed as dist

from megatron_sp.rendezvous import (IDENTITY_KEY, JOINED_KEY, RANK_KEY, RendezvousError, connect,
                                    identity, run_id)
from megatron_sp.testing import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--eval-iters", "0", "--train-iters", "1"]
MINUTES = 0.05          # 3 s: the timeout of connections that succeed
GIVE_UP = 0.02          # 1.2 s: the timeout of cases that end in it (nothing answers)


class SilentListener:
    """Accepts connections on a port and never says a word (another program on MASTER_PORT)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self):
        for c in self.conns:
            c.close()
        self.sock.close()


def env_of(rank, world, port, **extra):
    return dict(rank=rank, world_size=world, local_rank=0, master_addr="127.0.0.1",
                master_port=port, **extra)


def foreign_store(world, environ):
    """Another megatron_sp job's store (its rank 0 claimed it), or a bare one (environ None)."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    if environ is not None:
        store.set(IDENTITY_KEY, identity(world, environ))
    return store, port


def test_run_id_and_identity():
    assert run_id({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3"}) == "SLURM_JOB_ID=42.3"
    assert run_id({"TORCHELASTIC_RUN_ID": "abc", "SLURM_JOB_ID": "42"}) == "TORCHELASTIC_RUN_ID=abc"
    assert run_id({"MEGATRON_SP_RUN_ID": "x", "TORCHELASTIC_RUN_ID": "abc"}) == "MEGATRON_SP_RUN_ID=x"
    assert run_id({}) is None
    assert identity(4, {"SLURM_JOB_ID": "7"}) != identity(4, {"SLURM_JOB_ID": "8"})
    assert identity(4, {}) != identity(2, {})


def test_same_job_meets_and_the_store_works():
    port, stores, errors = free_port(), {}, []

    def rank(r):
        try:
            stores[r] = connect(env_of(r, 2, port), 0.2, environ={"SLURM_JOB_ID": "5"})
        except Exception as err:     # noqa: BLE001 - asserted below
            errors.append(err)
    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]   # rank 1 first
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and sorted(stores) == [0, 1], errors
    stores[0].set("hello", "1")
    assert stores[1].get("hello") == b"1"


def test_silent_listener_times_out_on_every_rank_naming_the_address():
    """Rank 0 cannot host (the port is taken): at once; rank 1 connects, gets no answer: after the
    timeout (TCPStore alone would wait in its handshake for good)."""
    listener = SilentListener()
    try:
        address = f"127.0.0.1:{listener.port}"
        with pytest.raises(RendezvousError, match=rf"^rank 0 could not host the rendezvous at "
                                                  rf"{address} \(.*address already in use"):
            connect(env_of(0, 2, listener.port), MINUTES, environ={})
        with pytest.raises(RendezvousError, match=rf"^rank 1 could not reach the rendezvous at "
                                                  rf"{address} within {GIVE_UP} min \(TimeoutError: "
                                                  rf"no answer: something may listen there that "
                                                  rf"is not a rendezvous store\); check "
                                                  rf"MASTER_ADDR/MASTER_PORT"):
            connect(env_of(1, 2, listener.port), GIVE_UP, environ={})
    finally:
        listener.close()


@pytest.mark.parametrize("ours", [{}, {"SLURM_JOB_ID": "78", "SLURM_STEP_ID": "0"}])
def test_another_jobs_store_is_refused(ours):
    """World size 4 and job 77 in the store; this job: world size 2 (no id / job 78.0). Rank 1 and
    torchrun-agent-style rank 0 (a client too) both refuse it; rank 0 does not overwrite it."""
    store, port = foreign_store(4, {"SLURM_JOB_ID": "77"})
    this = "not set" if not ours else "SLURM_JOB_ID=78.0"
    for rank, extra in ((1, {}), (0, {"TORCHELASTIC_USE_AGENT_STORE": "True"})):
        with pytest.raises(RendezvousError, match=(
                rf"^rank {rank}: the rendezvous store at 127.0.0.1:{port} belongs to another job "
                rf"\(world size 4, run id SLURM_JOB_ID=77; this job: world size 2, run id "
                rf"{this}\), so this rank does not join it; give each job its own MASTER_PORT.$")):
            connect(env_of(rank, 2, port), MINUTES, environ={**ours, **extra})
    assert store.get(IDENTITY_KEY).decode() == identity(4, {"SLURM_JOB_ID": "77"})
    # Same world size, another run id: refused as well.
    store, port = foreign_store(2, {"SLURM_JOB_ID": "77"})
    with pytest.raises(RendezvousError, match="belongs to another job"):
        connect(env_of(1, 2, port), MINUTES, environ={"SLURM_JOB_ID": "79"})


def test_waiting_for_every_rank_is_bounded_and_names_the_missing_ranks():
    """init_distributed's wait (wait_for_ranks=True, in Python: the launcher's SIGTERM is handled
    there, unlike in init_process_group): ranks 0 and 2 of 3 came, rank 1 never did: past the
    timeout rank 0 says which ranks are missing; rank 1, the last to take its rank, goes on."""
    store, port = foreign_store(3, {})
    store.set(f"{RANK_KEY}/0/2", json.dumps({"host": "node7", "pid": 4242}))
    store.add(f"{JOINED_KEY}/0", 1)                                     # rank 2 came
    with pytest.raises(RendezvousError, match=rf"^rank 0 could not reach the rendezvous at "
                                              rf"127.0.0.1:{port} within {GIVE_UP} min \(ranks "
                                              rf"\[1\] never joined\)"):
        connect(env_of(0, 3, port), GIVE_UP, environ={"TORCHELASTIC_USE_AGENT_STORE": "True"},
                wait_for_ranks=True)
    connect(env_of(1, 3, port), MINUTES, environ={"TORCHELASTIC_USE_AGENT_STORE": "True"},
            wait_for_ranks=True)


def test_a_rank_already_taken_is_refused():
    """Two hand launches of the same size on one port (no run id): the second job's rank 1 finds
    rank 1 taken (by the first job's process) and is refused before joining its process group."""
    store, port = foreign_store(2, {})
    store.set(f"{RANK_KEY}/0/1", json.dumps({"host": "node7", "pid": 4242}))
    with pytest.raises(RendezvousError, match=rf"^rank 1: the rendezvous store at 127.0.0.1:{port} "
                                              rf"already has a rank 1 \(host node7, pid 4242\): "
                                              rf"another job with the same world size"):
        connect(env_of(1, 2, port), MINUTES, environ={})
    connect(env_of(1, 2, port), MINUTES, environ={"TORCHELASTIC_RESTART_COUNT": "1"})  # a restart


def test_store_without_an_identity_is_not_joined():
    """A store nobody of megatron_sp claimed (another program's, or rank 0 never came): rank 1
    gives up after the timeout, counted nowhere (no worker count added to that store)."""
    store, port = foreign_store(2, None)
    keys = store.num_keys()
    with pytest.raises(RendezvousError, match=rf"^rank 1: the rendezvous store at 127.0.0.1:{port} "
                                              rf"did not receive this job's identity from rank 0 "
                                              rf"within {GIVE_UP} min"):
        connect(env_of(1, 2, port), GIVE_UP, environ={})
    assert store.num_keys() == keys and not store.check([IDENTITY_KEY])


def test_srun_style_ranks_against_a_silent_listener_each_say_one_line(tmp_path):
    """pretrain_gpt.py as 2 srun tasks (no torchrun) whose MASTER_PORT has a silent listener:
    each rank ends with exit 1 and one error line naming the address (rank 1 after the timeout,
    where it used to hang for minutes)."""
    listener = SilentListener()
    environ = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGATRON_SP_DEBUG")
               and not k.startswith(("SLURM_", "MEGATRON_SP_INJECT_", "TORCHELASTIC_"))}
    environ.update(OMP_NUM_THREADS="1", SLURM_NTASKS="2", SLURM_JOB_ID="123",
                   SLURM_JOB_NODELIST="127.0.0.1", MASTER_PORT=str(listener.port))
    try:
        procs = [subprocess.Popen([sys.executable, "pretrain_gpt.py", *TINY,
                                   "--distributed-timeout-minutes", str(GIVE_UP)], cwd=ROOT,
                                  env={**environ, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
                 for r in range(2)]
        results = [p.communicate(timeout=180) for p in procs]
    finally:
        listener.close()
    address = f"127.0.0.1:{listener.port}"
    for r, (proc, (out, err)) in enumerate(zip(procs, results)):
        assert proc.returncode == 1, (r, err[-3000:])
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "Traceback" not in err, (r, err[-3000:])
        verb = "host" if r == 0 else "reach"
        assert lines[0].startswith(f"error: rank {r} could not {verb} the rendezvous at {address}")
    assert f"within {GIVE_UP} min" in results[1][1]
