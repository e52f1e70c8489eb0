"""The rendezvous of a run launched from environment variables (torchrun, srun, or by hand): the
key/value store every rank meets at, bounded by --distributed-timeout-minutes, and refused when it
belongs to another job.

torch's tcp:// rendezvous has two gaps this closes (docs/design.md §12):

- A rank that connects to MASTER_ADDR:MASTER_PORT where something else listens and never answers
  (another program, a wedged job) waits in TCPStore's handshake regardless of its timeout (seen:
  180 s and counting with a 12 s timeout). The store is created here in a helper thread that is
  given the timeout; past it the rank raises RendezvousError naming the address, and the process
  ends (the thread is a daemon).
- A rank that reaches another job's store (two jobs given the same port) joins it: its keys and
  worker count mix with the other job's. Here rank 0 writes this job's identity into the store
  (world size and run id: MEGATRON_SP_RUN_ID, TORCHELASTIC_RUN_ID or SLURM_JOB_ID.SLURM_STEP_ID,
  whichever is set) with compare_set, so it also sees an identity already there; the other ranks
  wait for it (within the timeout) and compare before anything else touches the store. The store
  is created with wait_for_workers=False, so a refused rank is never counted as the other job's
  worker. Each rank then takes its rank in the store (compare_set of host and pid): a second
  process for a rank already taken (another job of the same size, no run id, same port) is
  refused instead of joining. Only then does init_process_group(store=...) run.

init_distributed (wait_for_ranks=True) then waits here, in Python, until every rank has taken its
rank, before init_process_group: a rank waiting there for a peer that never comes (one that
failed its start-up checks) sits in C++, where the launcher's SIGTERM is not handled; torchrun
then killed it only after its 30 s shutdown wait. Polled, it stops within POLL_S.

Under torchrun with its agent store (TORCHELASTIC_USE_AGENT_STORE=True) every rank is a client of
the agent's store, as in torch's own tcp:// handler; otherwise rank 0 hosts it (multi-tenant).
The process group gets the store behind the "default_pg" prefix, as init_method would give it.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time

import torch.distributed as dist

from megatron_sp.errors import UserError

IDENTITY_KEY = "megatron_sp/rendezvous/identity"
RANK_KEY = "megatron_sp/rendezvous/rank"          # /<torchrun attempt>/<rank>: who holds it
JOINED_KEY = "megatron_sp/rendezvous/joined"      # /<torchrun attempt>: ranks that took theirs
POLL_S = 0.05
RUN_ID_VARIABLES = ("MEGATRON_SP_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


class RendezvousError(UserError, RuntimeError):
    """This rank cannot reach the rendezvous (each rank says so with its rank)."""
    same_on_every_rank = False


def run_id(environ=os.environ) -> str | None:
    """This job's id as the launcher set it ("SLURM_JOB_ID=123.0", ...), or None."""
    for name in RUN_ID_VARIABLES:
        value = environ.get(name)
        if value:
            if name == "SLURM_JOB_ID" and environ.get("SLURM_STEP_ID"):
                value = f"{value}.{environ['SLURM_STEP_ID']}"
            return f"{name}={value}"
    return None


def identity(world_size: int, environ=os.environ) -> str:
    """What rank 0 writes into the store: this job's world size and run id (JSON)."""
    return json.dumps({"world_size": int(world_size), "run_id": run_id(environ)}, sort_keys=True)


def _first_line(err: BaseException) -> str:
    """The first line of a (C++) error message, without its trailing dot."""
    text = str(err).strip()
    return text.splitlines()[0].rstrip(".") if text else "no message"


def _describe(text: str) -> str:
    try:
        found = json.loads(text)
        return f"world size {found['world_size']}, run id {found['run_id'] or 'not set'}"
    except (ValueError, KeyError, TypeError):
        return f"a value not written by megatron_sp ({text[:60]!r})"


def open_store(host: str, port: int, rank: int, world_size: int,
                timeout: datetime.timedelta, agent_store: bool):
    """TCPStore at host:port (rank 0 hosts it unless torchrun's agent does), in a helper thread
    bounded by `timeout`: a silent listener never completes TCPStore's handshake."""
    result = {}

    def connect():
        try:
            result["store"] = dist.TCPStore(host, port, world_size,
                                            is_master=rank == 0 and not agent_store,
                                            timeout=timeout, wait_for_workers=False,
                                            multi_tenant=not agent_store)
        except Exception as err:   # noqa: BLE001 - reported by the caller, with the address
            result["error"] = err

    thread = threading.Thread(target=connect, name="megatron_sp-rendezvous", daemon=True)
    thread.start()
    thread.join(timeout.total_seconds() + 1.0)     # TCPStore's own timeout first, if it fires
    if "store" in result:
        return result["store"]
    error = result.get("error")
    return TimeoutError("no answer: something may listen there that is not a rendezvous store") \
        if error is None else error


def _wait_for_key(store, key: str, timeout: datetime.timedelta) -> bool:
    """Whether `key` appeared in the store within `timeout` (polled: store.wait would print
    c10d's own timeout warnings besides our sentence)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check([key]):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def _check_identity(store, rank: int, mine: str, address: str, timeout: datetime.timedelta,
                    minutes: float) -> None:
    """Rank 0 claims the store for this job; the others wait for the claim and compare."""
    if rank == 0:
        found = store.compare_set(IDENTITY_KEY, "", mine).decode()
    else:
        if not _wait_for_key(store, IDENTITY_KEY, timeout):
            raise RendezvousError(
                f"rank {rank}: the rendezvous store at {address} did not receive this job's "
                f"identity from rank 0 within {minutes} min: rank 0 is not running, or the store "
                f"belongs to another program or job; check that rank 0 runs with the same "
                f"MASTER_ADDR/MASTER_PORT, or pick a free MASTER_PORT.")
        found = store.get(IDENTITY_KEY).decode()
    if found != mine:
        raise RendezvousError(
            f"rank {rank}: the rendezvous store at {address} belongs to another job "
            f"({_describe(found)}; this job: {_describe(mine)}), so this rank does not join it; "
            f"give each job its own MASTER_PORT.")


def connect(env: dict, timeout_minutes: float, environ=os.environ, wait_for_ranks: bool = False):
    """The store this job's ranks meet at (for init_process_group(store=...)), checked to be
    this job's; RendezvousError naming the address when it cannot be reached within the timeout
    or belongs to another job. `env`: megatron_sp.mesh.distributed_env(). wait_for_ranks: also
    wait (polling, signals handled) until every rank has taken its rank, within the timeout;
    past it RendezvousError names the ranks missing."""
    rank, world = env["rank"], env["world_size"]
    host, port = env["master_addr"], env["master_port"]
    address = f"{host}:{port}"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    deadline = time.monotonic() + timeout.total_seconds()
    store = open_store(host, port, rank, world, timeout, agent_store)
    if isinstance(store, BaseException):
        hosting = rank == 0 and not agent_store
        within = f" within {timeout_minutes} min" if isinstance(store, TimeoutError) else ""
        raise RendezvousError(
            f"rank {rank} could not {'host' if hosting else 'reach'} the rendezvous at {address}"
            f"{within} ({type(store).__name__}: {_first_line(store)}); check "
            f"MASTER_ADDR/MASTER_PORT, that the port is free (no other job or program listens "
            f"there) and that rank 0 is running.") from store
    left = datetime.timedelta(seconds=max(0.0, deadline - time.monotonic()))   # one timeout in all
    _check_identity(store, rank, identity(world, environ), address, left, timeout_minutes)
    _claim_rank(store, rank, address, environ)
    store.add(f"{JOINED_KEY}/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", 1)
    if wait_for_ranks:
        _wait_for_ranks(store, rank, world, address, deadline, timeout_minutes, environ)
    return dist.PrefixStore("default_pg", store)


def _wait_for_ranks(store, rank: int, world: int, address: str, deadline: float,
                    minutes: float, environ=os.environ) -> None:
    """Until every rank of this attempt has taken its rank (see the module docstring): one
    counter polled (one key per poll whatever the world size), the missing ranks looked up once,
    past the deadline."""
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    while store.add(f"{JOINED_KEY}/{attempt}", 0) < world:
        if time.monotonic() > deadline:
            missing = [r for r in range(world) if not store.check([f"{RANK_KEY}/{attempt}/{r}"])]
            raise RendezvousError(
                f"rank {rank} could not reach the rendezvous at {address} within {minutes} min "
                f"(ranks {missing} never joined); check MASTER_ADDR/MASTER_PORT and that every "
                f"rank is running.")
        time.sleep(POLL_S)


def _claim_rank(store, rank: int, address: str, environ=os.environ) -> None:
    """This process takes its rank in the store (per torchrun attempt); a rank already taken
    means another running job of the same size and run id met here (two hand launches given
    the same port): refused before it joins that job's process group."""
    mine = json.dumps({"host": socket.gethostname(), "pid": os.getpid()})
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    found = store.compare_set(f"{RANK_KEY}/{attempt}/{rank}", "", mine).decode()
    if found == mine:
        return
    try:
        holder = json.loads(found)
        holder = f"host {holder['host']}, pid {holder['pid']}"
    except (ValueError, KeyError, TypeError):
        holder = "a process not started by megatron_sp"
    raise RendezvousError(
        f"rank {rank}: the rendezvous store at {address} already has a rank {rank} ({holder}): "
        f"another job with the same world size uses this port, so this rank does not join it; "
        f"give each job its own MASTER_PORT (or its own MEGATRON_SP_RUN_ID).")
