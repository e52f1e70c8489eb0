#!/usr/bin/env python
"""Measured pipeline bubble of 1F1B and interleaved 1F1B against the textbook formulas.

Method: every stage's compute is a fixed delay, forward t_f and backward t_b = 2 t_f per micro-batch
and stage (split evenly over the v chunks when interleaved), run through the real schedule code
(megatron_sp.pipeline.schedules) in two ways:
- simulated: p threads, each a stage with a virtual clock; the delays advance the clock and the p2p
  exchanges are rendezvous (a batch completes when every one of its sends and receives has met its
  peer's, at the later of the two posting times), so the step time is exact and independent of the
  machine's load: it shows what the schedule itself achieves.
- measured: p gloo ranks on CPU with the real batched p2p (tiny [1, 8, 16] fp32 activations) and
  the delays as sleeps; this adds p2p latency and OS wake-up jitter (large on a loaded machine).
A step's time T (max over ranks; measured: median of several steps after a barrier) is compared
with the ideal T_ideal = m (t_f + t_b) of a stage with no bubble, and (gloo) with the time each
rank actually spent in its delays, `busy` (a sleep on a loaded machine oversleeps: that is compute
taking longer, not pipeline idle time). The measured bubble is then the idle fraction of the step,
1 - mean over ranks of busy / T, Megatron's definition of the bubble (stages idle, waiting):

    bubble fraction of the step   (T - T_ideal) / T     vs (p-1)/(m+p-1)      (1F1B)
                                                            (p-1)/(v m+p-1)    (interleaved)
    Megatron's bubble ratio       (T - T_ideal) / T_ideal  vs (p-1)/m  and (1/v)(p-1)/m

(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", section 2.2: interleaving divides the bubble time by v.)

    python bench/pipeline.py                          # pp=4, m = 4, 8, 16, v = 1, 2  (~1 min)
    python bench/pipeline.py --no-gloo --micro-batches 4 8 16 32 --chunks 2 4   # simulation only
    python bench/pipeline.py --pp 4 --micro-batches 4 8 16 32 --chunks 2 4 --tf-ms 10
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import statistics
import sys
import threading
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sp import comm_stats  # noqa: E402
from megatron_sp.mesh import ParallelMesh  # noqa: E402
from megatron_sp.testing import run_distributed  # noqa: E402

from megatron_sp.pipeline import p2p as pp_p2p  # noqa: E402
from megatron_sp.pipeline import schedules as pp_schedules  # noqa: E402

B, S, H = 1, 8, 16
_local = threading.local()     # simulation: this stage's virtual clock (seconds)


def _delay(seconds):
    if getattr(_local, "simulated", False):
        _local.clock += seconds
    else:
        start = time.perf_counter()
        time.sleep(seconds)
        _local.busy = getattr(_local, "busy", 0.0) + time.perf_counter() - start   # as slept


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t_f, t_b):
        ctx.t_b = t_b
        _delay(t_f)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _delay(ctx.t_b)
        return grad, None, None


class SleepChunk(nn.Module):
    """A model chunk with the GPTModel stage interface whose compute is a sleep."""

    def __init__(self, t_f, t_b, pre_process, post_process):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))
        self.config = SimpleNamespace(hidden_size=H)
        self.sequence_parallel = False
        self.t_f, self.t_b = t_f, t_b
        self.pre_process, self.post_process = pre_process, post_process

    def shard_sequence(self, t):
        return t

    def forward(self, input_ids=None, position_ids=None, labels=None, document_ids=None,
                hidden_states=None):
        x = self.weight * torch.ones(B, S, H) if self.pre_process else hidden_states   # [b, s, H]
        x = _Sleep.apply(x, self.t_f, self.t_b)
        return x.mean(-1) if self.post_process else x          # per-token "loss" [b, s] on the last


class _Fabric:
    """Rendezvous point-to-point between simulated stages, on virtual clocks."""

    def __init__(self):
        self.cond = threading.Condition()
        self.sends = collections.defaultdict(collections.deque)   # (src, dst, tag) -> posted sends
        self.recvs = collections.defaultdict(collections.deque)   # (src, dst, tag) -> posted recvs

    def exchange(self, me, ops, timeout=60.0):
        """ops: [("send"|"recv", peer, tag, tensor)]; returns received tensors; advances the clock."""
        posted = self.post(me, ops)
        self.wait(me, posted, timeout)
        return [o["tensor"] for (kind, *_), o in zip(ops, posted) if kind == "recv"]

    def wait(self, me, posted, timeout=60.0):
        """Block until the posted ops have met their peers; the clock moves to the latest."""
        with self.cond:
            if not self.cond.wait_for(lambda: all(o["done"] is not None for o in posted), timeout):
                raise RuntimeError(f"simulated stage {me}: exchange never matched (schedule deadlock)")
        _local.clock = max([_local.clock] + [o["done"] for o in posted])

    def post(self, me, ops):
        """Post ops at this stage's clock, matching those the peers posted before; no waiting."""
        posted = []
        with self.cond:
            for kind, peer, tag, tensor in ops:
                op = {"time": _local.clock, "tensor": tensor, "done": None}
                key, mine, theirs = ((me, peer, tag), self.sends, self.recvs) if kind == "send" else \
                    ((peer, me, tag), self.recvs, self.sends)
                if theirs[key]:
                    other = theirs[key].popleft()
                    t = max(op["time"], other["time"])
                    if kind == "send":
                        other["tensor"] = tensor
                    else:
                        op["tensor"] = other["tensor"]
                    op["done"] = other["done"] = t
                    self.cond.notify_all()
                else:
                    mine[key].append(op)
                posted.append(op)
        return posted


class _SimPendingRecv(pp_p2p.PendingRecv):
    """A receive posted on the simulated fabric; get() waits for it on the virtual clock."""

    def __init__(self, fabric, me, op):
        self.fabric, self.me, self.op = fabric, me, op

    def get(self):
        self.fabric.wait(self.me, [self.op])
        return self.op["tensor"]


class _SimComm:
    """P2PCommunicator's interface over the simulated fabric (same ring, tags and order)."""

    def __init__(self, fabric, rank, pp):
        self.fabric, self.rank = fabric, rank
        self.next, self.prev = (rank + 1) % pp, (rank - 1) % pp

    def communicate(self, *, send_next=None, send_prev=None, recv_prev=False, recv_next=False,
                    wait=True):
        ops = []
        if send_next is not None:
            ops.append(("send", self.next, 0, send_next.detach().clone()))
        if recv_prev:
            ops.append(("recv", self.prev, 0, None))
        if send_prev is not None:
            ops.append(("send", self.prev, 1, send_prev.detach().clone()))
        if recv_next:
            ops.append(("recv", self.next, 1, None))
        if not wait:      # posted now, each receive waited for by its user (sends: never)
            posted = iter(o for (kind, *_), o in zip(ops, self.fabric.post(self.rank, ops))
                          if kind == "recv")
            return (_SimPendingRecv(self.fabric, self.rank, next(posted)) if recv_prev else None,
                    _SimPendingRecv(self.fabric, self.rank, next(posted)) if recv_next else None)
        received = iter(self.fabric.exchange(self.rank, ops))
        from_prev = next(received) if recv_prev else None
        from_next = next(received) if recv_next else None
        return from_prev, from_next

    def wait_sends(self):
        pass

    recv_forward = lambda self, recv=True: self.communicate(recv_prev=recv)[0]
    send_forward = lambda self, out: self.communicate(send_next=out)
    recv_backward = lambda self, recv=True: self.communicate(recv_next=recv)[1]
    send_backward = lambda self, g: self.communicate(send_prev=g)
    send_forward_recv_backward = lambda self, out, recv=True: self.communicate(
        send_next=out, recv_next=recv)[1]
    send_backward_recv_forward = lambda self, g, recv=True: self.communicate(
        send_prev=g, recv_prev=recv)[0]
    send_forward_recv_forward = lambda self, out, recv_prev: self.communicate(
        send_next=out, recv_prev=recv_prev)[0]
    send_backward_recv_backward = lambda self, g, recv_next: self.communicate(
        send_prev=g, recv_next=recv_next)[1]
    send_forward_backward_recv_forward_backward = lambda self, out, g, recv_prev, recv_next: \
        self.communicate(send_next=out, send_prev=g, recv_prev=recv_prev, recv_next=recv_next)


def _micro_batches(m):
    return [{"tokens": torch.zeros(B, S, dtype=torch.long), "labels": torch.zeros(B, S, dtype=torch.long),
             "loss_mask": torch.ones(B, S)} for _ in range(m)]


def _schedule(p, v, overlap):
    """The schedule of (p, v); interleaved with or without Megatron's p2p overlap."""
    fn = pp_schedules.get_forward_backward_func(p, v)
    return fn if overlap is None else functools.partial(fn, overlap_p2p_comm=overlap)


def simulate(p, m, v, t_f, overlap=None):
    """Step time of the real schedule code on p simulated stages (virtual clocks)."""
    fabric, times, errors = _Fabric(), [0.0] * p, []

    def stage(rank):
        try:
            _local.simulated, _local.clock = True, 0.0
            mesh = SimpleNamespace(pp_size=p, pp_rank=rank, is_first_stage=rank == 0,
                                   is_last_stage=rank == p - 1, sp_size=1, tp_size=1)
            _local.comm = _SimComm(fabric, rank, p)
            chunks = [SleepChunk(t_f / v, 2 * t_f / v, rank == 0 and c == 0, rank == p - 1 and c == v - 1)
                      for c in range(v)]
            _schedule(p, v, overlap)(chunks, _micro_batches(m), mesh,
                                                          num_tokens=torch.tensor(float(m * B * S)))
            times[rank] = _local.clock
        except BaseException as err:  # report in the main thread
            errors.append(err)

    original = pp_schedules._communicator
    pp_schedules._communicator = lambda chunks, mbs, mesh, *rest: _local.comm
    try:
        threads = [threading.Thread(target=stage, args=(r,)) for r in range(p)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        pp_schedules._communicator = original
    if errors:
        raise errors[0]
    return max(times)


def _precise_sleeps():
    """Linux wakes a sleeping thread up to its timer slack (50 us by default) late; 1 us here, so
    that a delay lasts what the compute it stands for would (the schedule is what is measured)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)      # PR_SET_TIMERSLACK, in nanoseconds
    except (OSError, AttributeError):
        pass


def _measure(rank, world, configs, t_f, steps):
    """Per config: (m, v, median step time, median idle fraction, p2p messages and bytes sent per
    step by this rank in fp32 and under bf16 autocast)."""
    mesh = ParallelMesh.from_sizes(pp=world)
    _precise_sleeps()
    rows = []
    for m, v, overlap in configs:
        chunks = [SleepChunk(t_f / v, 2 * t_f / v, mesh.is_first_stage and c == 0,
                             mesh.is_last_stage and c == v - 1) for c in range(v)]
        schedule = _schedule(world, v, overlap)
        mbs = _micro_batches(m)
        num_tokens = torch.tensor(float(m * B * S))
        times, idle = [], []
        for step in range(steps + 1):                   # the first step warms up the p2p pairs
            dist.barrier()
            _local.busy = 0.0
            start = time.perf_counter()
            schedule(chunks, mbs, mesh, num_tokens=num_tokens)
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            busy = torch.tensor(_local.busy, dtype=torch.float64)
            dist.all_reduce(busy)                        # summed over ranks
            if step:
                times.append(elapsed.item())
                idle.append(1.0 - busy.item() / world / elapsed.item())
        wire = {}
        for name, autocast in (("fp32", contextlib.nullcontext),
                               ("bf16", lambda: torch.autocast("cpu", dtype=torch.bfloat16))):
            comm_stats.reset()
            schedule(chunks, mbs, mesh, num_tokens=num_tokens, autocast=autocast)
            wire[name] = (comm_stats.calls()["pp/send"], comm_stats.snapshot()["pp/send"])
        rows.append((m, v, overlap, statistics.median(times), statistics.median(idle), wire))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--chunks", type=int, nargs="+", default=[2], help="virtual stages v > 1")
    parser.add_argument("--tf-ms", type=float, default=20.0, help="forward sleep per micro-batch and stage")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-gloo", action="store_true", help="only the simulation (instant)")
    args = parser.parse_args()
    p, t_f = args.pp, args.tf_ms / 1000
    configs = [(m, v, overlap) for m in args.micro_batches for v in [1] + args.chunks
               if v == 1 or m % p == 0 for overlap in ((None,) if v == 1 else (True, False))]
    simulated = {c: simulate(p, *c[:2], t_f, c[2]) for c in configs}
    measured = {} if args.no_gloo else {
        (m, v, o): row for m, v, o, *row in run_distributed(_measure, p, configs, t_f, args.steps,
                                                           timeout_s=1800,
                                                           collective_timeout_s=600)[0]}
    print(f"pipeline bubble, pp={p}, stage compute as delays: t_f={args.tf_ms:g} ms, "
          f"t_b={2 * args.tf_ms:g} ms per micro-batch and stage (split over the v chunks); "
          f"sim = virtual clocks, gloo = {p} gloo ranks on CPU with sleeps (median of {args.steps} steps)")
    print(f"{'schedule':<19}{'m':>4}{'v':>3}{'ideal ms':>10}{'sim ms':>9}{'gloo ms':>9} | "
          f"{'bubble/step: sim':>16}{'gloo':>7}{'idle':>7}{'formula':>9} | "
          f"{'bubble/ideal: sim':>17}{'gloo':>7}{'formula':>9}")
    nan = float("nan")
    for m, v, overlap in configs:
        ideal = m * 3 * t_f
        name = "1F1B" if v == 1 else "interleaved" + ("" if overlap else " (sync)")
        sim = simulated[(m, v, overlap)]
        wall, idle, _ = measured.get((m, v, overlap), (nan, nan, None))
        frac_f, ratio_f = (p - 1) / (v * m + p - 1), (p - 1) / (v * m)
        print(f"{name:<19}{m:>4}{v:>3}{1000 * ideal:>10.1f}{1000 * sim:>9.1f}{1000 * wall:>9.1f} | "
              f"{(sim - ideal) / sim:>16.3f}{(wall - ideal) / wall:>7.3f}{idle:>7.3f}{frac_f:>9.3f} | "
              f"{(sim - ideal) / ideal:>17.3f}{(wall - ideal) / ideal:>7.3f}{ratio_f:>9.3f}")
    print("bubble/step gloo: (T - T_ideal)/T, the delays at their nominal length; idle: 1 - busy/T, "
          "the time ranks spent waiting (delays as actually slept); interleaved: p2p overlapped "
          "(the default), (sync): every exchange waited for as posted (the schedule before)")
    if measured:
        print(f"\np2p messages sent per step by stage 0, [{B}, {S}, {H}] activations / gradients:")
        print(f"{'schedule':<12}{'m':>4}{'v':>3} | {'messages':>8} {'fp32 B/msg':>10} {'bf16 B/msg':>10}")
        for m, v, overlap in configs:
            if overlap is False:
                continue
            wire = measured[(m, v, overlap)][2]
            (n32, b32), (n16, b16) = wire["fp32"], wire["bf16"]
            print(f"{'1F1B' if v == 1 else 'interleaved':<12}{m:>4}{v:>3} | {n32:>8} "
                  f"{b32 // n32:>10} {b16 // n16:>10}")


if __name__ == "__main__":
    main()
