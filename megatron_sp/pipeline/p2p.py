"""Point-to-point communication between pipeline stages: every pipeline `dist.` call lives here.

Forward: activations [b, s/sp, H] ([b, s/(sp*tp), H] with --sequence-parallel) go to the next
stage; backward: their gradients (same shape) go to the previous stage. Every exchange of one
schedule step is posted together (one `dist.batch_isend_irecv` on NCCL, the isend/irecv ops in
order on gloo, which does the same there) and then waited, so two neighbours that both send and
receive never deadlock.

Neighbours form a ring over the pp group (stage p-1's "next" is stage 0) because interleaved
schedules pass activations from the last stage's chunk c to the first stage's chunk c+1; the
schedules decide when the ring edge is used. Two messages can travel between the same pair in the
same step (with pp=2 and virtual stages a peer is both previous and next), so messages are told
apart by tag (activations 0, gradients 1) and posted in a canonical order (activation ops, then
gradient ops) on both sides, which also keeps them matched on backends that ignore tags.

Bytes sent are counted as "pp/send" in megatron_sp.comm_stats. Under --bf16 tensors cross the
wire in bf16 (wire_dtype, as Megatron's pipeline_dtype): half the bytes; the receiver gets them back
in the compute dtype, so the residual stream of every stage keeps its dtype.
"""
from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from megatron_sp import comm_stats

ACTIVATION_TAG = 0
GRADIENT_TAG = 1


def posts_batched(group) -> bool:
    """NCCL needs the ops of one exchange grouped (batch_isend_irecv); gloo posts each op on its
    own anyway, so there they are posted directly, without the P2POp / coalescing wrappers (~0.1 ms
    of CPU per op, on the schedule's critical path)."""
    return dist.get_backend(group) != "gloo"


class PendingRecv:
    """A posted receive (communicate(wait=False)): get() waits for it and returns the tensor."""

    def __init__(self, work, buffer, dtype):
        self.work, self.buffer, self.dtype = work, buffer, dtype

    def get(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.buffer.to(self.dtype)


class P2PCommunicator:
    """Send/receive of one fixed-shape tensor between this stage and its pipeline neighbours.

    shape: the activation shape [b, s_local, H]; dtype: the dtype of the residual stream (fp32,
    also under bf16 autocast), which received tensors are returned in; wire_dtype: the dtype on the
    wire (default dtype; bf16 under --bf16). Tensors are cast to it on send.
    """

    def __init__(self, mesh, shape, dtype=torch.float32, device=None, wire_dtype=None):
        self.mesh = mesh
        self.shape = tuple(shape)
        self.dtype = dtype
        self.wire_dtype = wire_dtype or dtype
        self.device = device or torch.device("cpu")
        self.group = mesh.pp_group
        pp, r = mesh.pp_size, mesh.pp_rank
        self.next_rank = mesh.stage_rank((r + 1) % pp)
        self.prev_rank = mesh.stage_rank((r - 1) % pp)
        self._sends = collections.deque()   # (work, tensor) of sends posted with wait=False
        self._batched = posts_batched(self.group)

    def _empty(self):
        return torch.empty(self.shape, dtype=self.wire_dtype, device=self.device)

    def _send_op(self, tensor, peer, tag):
        tensor = tensor.detach().to(self.wire_dtype).contiguous()
        if tuple(tensor.shape) != self.shape:
            raise RuntimeError(f"pipeline send of shape {tuple(tensor.shape)}, expected {self.shape} "
                               f"(micro-batch shape changed inside one step?).")
        comm_stats.record("pp/send", tensor.numel() * tensor.element_size())
        return dist.isend, tensor, peer, tag

    def _post(self, ops):
        """Post (isend | irecv, tensor, peer, tag) ops in order; their works, one per op (None
        each when the backend returns one work for the batch)."""
        if not ops:
            return []
        if not self._batched:
            return [fn(tensor, peer, self.group, tag) for fn, tensor, peer, tag in ops]
        works = dist.batch_isend_irecv([dist.P2POp(*op[:3], self.group, op[3]) for op in ops])
        return works if len(works) == len(ops) else [*works, *[None] * (len(ops) - len(works))]

    def communicate(self, *, send_next=None, send_prev=None, recv_prev=False, recv_next=False,
                    wait=True):
        """One batched exchange. send_next: activation to the next stage; send_prev: gradient to
        the previous stage; recv_prev: receive an activation from the previous stage; recv_next:
        receive a gradient from the next stage. Returns (from_prev, from_next) (None if not asked).

        wait=False (Megatron's overlap_p2p_comm): the ops are posted and not waited for; the
        results are PendingRecv handles, waited for when the schedule needs them; a send's buffer
        is released by the first exchange that finds it completed (never waited for early), the
        rest by wait_sends() at the end of the step. On every link the ops of each kind (tag)
        keep their order, so they match as before, and no wait comes earlier than with
        wait=True: no new deadlock.
        """
        while self._sends and self._sends[0][0].is_completed():   # release the sent, in order
            self._sends.popleft()
        from_prev = self._empty() if recv_prev else None
        from_next = self._empty() if recv_next else None
        ops = []
        # Activations (travel downstream), then gradients (travel upstream): the same order on
        # both ends of every link.
        if send_next is not None:
            ops.append(self._send_op(send_next, self.next_rank, ACTIVATION_TAG))
        if from_prev is not None:
            ops.append((dist.irecv, from_prev, self.prev_rank, ACTIVATION_TAG))
        if send_prev is not None:
            ops.append(self._send_op(send_prev, self.prev_rank, GRADIENT_TAG))
        if from_next is not None:
            ops.append((dist.irecv, from_next, self.next_rank, GRADIENT_TAG))
        works = self._post(ops)
        if wait or None in works:   # (a backend that coalesces the batch: wait now)
            for work in works:
                if work is not None:
                    work.wait()
            if wait:
                return self._received(from_prev), self._received(from_next)
            works = [None] * len(ops)
        pending = {}
        for (fn, tensor, *_), work in zip(ops, works):
            if fn is dist.irecv:
                pending[id(tensor)] = PendingRecv(work, tensor, self.dtype)
            elif work is not None:
                self._sends.append((work, tensor))   # the tensor lives until the send is done
        return (pending.get(id(from_prev)) if from_prev is not None else None,
                pending.get(id(from_next)) if from_next is not None else None)

    def wait_sends(self) -> None:
        """Wait for every send posted with wait=False (their buffers are released)."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def _received(self, t):
        return None if t is None else t.to(self.dtype)

    # Megatron's named exchanges ---------------------------------------------------------------
    def recv_forward(self, recv=True):
        return self.communicate(recv_prev=recv)[0]

    def send_forward(self, output):
        self.communicate(send_next=output)

    def recv_backward(self, recv=True):
        return self.communicate(recv_next=recv)[1]

    def send_backward(self, input_grad):
        self.communicate(send_prev=input_grad)

    def send_forward_recv_backward(self, output, recv=True):
        return self.communicate(send_next=output, recv_next=recv)[1]

    def send_backward_recv_forward(self, input_grad, recv=True):
        return self.communicate(send_prev=input_grad, recv_prev=recv)[0]

    def send_forward_recv_forward(self, output, recv_prev):
        return self.communicate(send_next=output, recv_prev=recv_prev)[0]

    def send_backward_recv_backward(self, input_grad, recv_next):
        return self.communicate(send_prev=input_grad, recv_next=recv_next)[1]

    def send_forward_backward_recv_forward_backward(self, output, input_grad, recv_prev, recv_next):
        return self.communicate(send_next=output, send_prev=input_grad, recv_prev=recv_prev,
                                recv_next=recv_next)
