"""Pipeline schedules: 1F1B and interleaved 1F1B (virtual stages), as in Megatron-LM.

Both have the signature of `megatron_sp.training.schedules.forward_backward_no_pipelining`:

    schedule(model_chunks, micro_batches, mesh, *, num_tokens, grad_sync=None, autocast=...,
             forward_only=False) -> this rank's summed normalised loss (float64; 0 off the last stage)

Every stage receives all micro-batches (each rank of a data-parallel replica loads them): the first
stage reads the tokens, the last the labels and loss mask, every stage the positions and document
ids. Each micro-batch's loss is sum(per-token loss * mask) / global unmasked tokens, exactly as
without pipelining, so the summed gradients equal the single-device mean.

1F1B (PipeDream-flush): stage r runs min(p-r-1, m) warm-up forwards, then alternates one forward
and one backward, then cools down with the remaining backwards; at most p-r micro-batches' activations
are alive. Interleaved: each stage holds v model chunks (virtual stages) and runs Megatron-LM's
schedule over m*v virtual micro-batches (m must be a multiple of p), shrinking the bubble by v.
The bucketed gradient all-reduce is armed (grad_sync.start_last_backward()) right before the last
backward pass of the stage; the Trainer calls grad_sync.finish().

Memory and wire (as Megatron-LM): once a stage output has been sent, its data is freed
(deallocate_output_tensor): backward only needs its autograd graph, not its values, so a stage
keeps no copy of the activations it passed on. Under bf16 autocast activations and gradients cross
stages in bf16.
"""
from __future__ import annotations

import contextlib

import torch

from megatron_sp.training.schedules import forward_backward_no_pipelining

from .p2p import P2PCommunicator, PendingRecv
from .partition import check_num_microbatches


def activation_shape(model, micro_batch: dict, mesh) -> tuple[int, int, int]:
    """[b, s/(sp*cp), H] (s/(sp*cp*tp) under --sequence-parallel) of the tensors crossing stages."""
    b, s = micro_batch["tokens"].shape[:2]
    shards = mesh.dims.sequence_shards(getattr(model, "sequence_parallel", False))
    return (b, s // shards, model.config.hidden_size)


def wire_dtype(autocast) -> torch.dtype | None:
    """The autocast dtype when `autocast()` enables autocast (bf16 under --bf16), else None."""
    with autocast():
        for device in ("cuda", "cpu"):
            if torch.is_autocast_enabled(device):
                return torch.get_autocast_dtype(device)
    return None


def _communicator(model_chunks, micro_batches, mesh, autocast=contextlib.nullcontext) -> P2PCommunicator:
    shape = activation_shape(model_chunks[0], micro_batches[0], mesh)
    return P2PCommunicator(mesh, shape, device=micro_batches[0]["tokens"].device,
                           wire_dtype=wire_dtype(autocast))


def deallocate_output_tensor(out) -> None:
    """Free a sent stage output's data (Megatron's deallocate_output_tensor).

    Its grad_fn keeps what backward needs; the values themselves live on in the next stage. Views
    share their base's storage and are left alone.
    """
    if out is None or out._base is not None or out.grad_fn is None:
        return
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def forward_step(model, mb: dict, input_tensor, num_tokens, autocast):
    """Run one chunk on one micro-batch: hidden states out, or (post_process) the loss scalar."""
    with autocast():
        out = model(input_ids=mb["tokens"], position_ids=mb.get("position_ids"),
                    labels=mb["labels"] if model.post_process else None,
                    document_ids=mb.get("document_ids"), hidden_states=input_tensor)
        if not model.post_process:
            return out                                                  # [b, s/sp, H]
        mask = model.shard_sequence(mb["loss_mask"]).to(out.dtype)      # [b, s/sp]
        return (out * mask).sum() / num_tokens


def backward_step(input_tensor, output, output_grad):
    """Backward through one chunk; returns the gradient of its input (None for the first chunk)."""
    if output_grad is None:                      # the loss: the start of backward
        output.backward()
    else:   # the engine directly: `output` may have been deallocated (its shape is [1] now)
        torch.autograd.Variable._execution_engine.run_backward(
            tensors=(output,), grad_tensors=(output_grad.to(output.dtype),), keep_graph=False,
            create_graph=False, inputs=(), allow_unreachable=True, accumulate_grad=True)
    return None if input_tensor is None else input_tensor.grad


def _resolve(t):
    """A received tensor, waiting for it first if its receive was posted without waiting."""
    return t.get() if isinstance(t, PendingRecv) else t


def _as_input(t):
    """A received activation becomes a leaf whose .grad is the gradient to send back."""
    return None if t is None else t.requires_grad_(True)


def forward_backward_pipelining_without_interleaving(model_chunks, micro_batches, mesh, *, num_tokens,
                                                     grad_sync=None, autocast=contextlib.nullcontext,
                                                     forward_only=False):
    """1F1B over the micro-batches of one global batch; returns this rank's summed loss."""
    if len(model_chunks) != 1:
        raise ValueError(f"1F1B takes one model chunk per stage, got {len(model_chunks)}; use the "
                         f"interleaved schedule for virtual stages.")
    (model,) = model_chunks
    m, p, r = len(micro_batches), mesh.pp_size, mesh.pp_rank
    check_num_microbatches(m, p)
    comm = _communicator(model_chunks, micro_batches, mesh, autocast)
    first, last = mesh.is_first_stage, mesh.is_last_stage
    total = torch.zeros((), dtype=torch.float64, device=num_tokens.device)   # no host sync per micro-batch
    grad_ctx = torch.no_grad if forward_only else contextlib.nullcontext

    def run_forward(i, inp):
        nonlocal total
        with grad_ctx():
            out = forward_step(model, micro_batches[i], _as_input(inp) if not forward_only else inp,
                               num_tokens, autocast)
        if last:
            total += out.detach().double()
        return out

    def run_backward(i, inp, out, out_grad):
        if grad_sync is not None and i == m - 1:
            grad_sync.start_last_backward()      # bucketed all-reduce overlaps this backward
        return backward_step(inp, out, out_grad)

    num_warmup = m if forward_only else min(p - r - 1, m)
    num_remaining = m - num_warmup
    inputs, outputs = [], []

    for i in range(num_warmup):
        inp = comm.recv_forward(recv=not first)
        out = run_forward(i, inp)
        comm.send_forward(None if last else out)
        if not last:
            deallocate_output_tensor(out)
        if not forward_only:
            inputs.append(inp)
            outputs.append(out)

    inp = comm.recv_forward(recv=not first) if num_remaining > 0 else None
    for j in range(num_remaining):
        i = num_warmup + j
        out = run_forward(i, inp)
        out_grad = comm.send_forward_recv_backward(None if last else out, recv=not last)
        if not last:
            deallocate_output_tensor(out)
        inputs.append(inp)
        outputs.append(out)
        in_grad = run_backward(j, inputs.pop(0), outputs.pop(0), out_grad)   # oldest: micro-batch j
        send = None if first else in_grad
        if j == num_remaining - 1:
            inp = None
            comm.send_backward(send)
        else:
            inp = comm.send_backward_recv_forward(send, recv=not first)

    if not forward_only:
        for j in range(num_remaining, m):
            out_grad = comm.recv_backward(recv=not last)
            in_grad = run_backward(j, inputs.pop(0), outputs.pop(0), out_grad)
            comm.send_backward(None if first else in_grad)
    return total


def forward_backward_pipelining_with_interleaving(model_chunks, micro_batches, mesh, *, num_tokens,
                                                  grad_sync=None, autocast=contextlib.nullcontext,
                                                  forward_only=False, overlap_p2p_comm=True):
    """Interleaved 1F1B (Megatron-LM's schedule) over v model chunks per stage.

    overlap_p2p_comm (Megatron's --overlap-p2p-communication, on here by default): exchanges are
    posted without waiting and each receive is waited for only when its compute needs it; False
    waits for every exchange as it is posted (one combined exchange per steady-state step).
    """
    chunks = list(model_chunks)
    v, m, p, r = len(chunks), len(micro_batches), mesh.pp_size, mesh.pp_rank
    check_num_microbatches(m, p, v)
    comm = _communicator(chunks, micro_batches, mesh, autocast)
    first_stage, last_stage = mesh.is_first_stage, mesh.is_last_stage
    total_k = m * v
    total = torch.zeros((), dtype=torch.float64, device=num_tokens.device)   # no host sync per micro-batch
    grad_ctx = torch.no_grad if forward_only else contextlib.nullcontext

    def chunk_id(k, forward=True):
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def micro_batch_id(k):
        return (k // (p * v)) * p + k % p

    def pre(c):            # this chunk embeds (stage 0, chunk 0)
        return first_stage and c == 0

    def post(c):           # this chunk computes the loss (last stage, last chunk)
        return last_stage and c == v - 1

    inputs = [[] for _ in range(v)]
    outputs = [[] for _ in range(v)]
    out_grads = [[] for _ in range(v)]

    def forward_k(k):
        nonlocal total
        c = chunk_id(k, True)
        if pre(c) and len(inputs[c]) == len(outputs[c]):
            inputs[c].append(None)
        inputs[c][-1] = inp = _resolve(inputs[c][-1])
        with grad_ctx():
            out = forward_step(chunks[c], micro_batches[micro_batch_id(k)],
                               inp if forward_only else _as_input(inp), num_tokens, autocast)
        outputs[c].append(out)
        if post(c):
            total += out.detach().double()
        if forward_only:         # nothing to keep for backward
            inputs[c].pop()
            outputs[c].pop()
        return None if post(c) else out

    def backward_k(k):
        c = chunk_id(k, False)
        if post(c) and len(out_grads[c]) == 0:
            out_grads[c].append(None)
        inp, out, og = inputs[c].pop(0), outputs[c].pop(0), _resolve(out_grads[c].pop(0))
        if grad_sync is not None and k == total_k - 1:
            grad_sync.start_last_backward()
        in_grad = backward_step(inp, out, og)
        return None if pre(c) else in_grad

    all_warmup = False
    if forward_only:
        num_warmup = total_k
    elif m == p:
        num_warmup, all_warmup = total_k, True
    else:
        num_warmup = min((p - r - 1) * 2 + (v - 1) * p, total_k)
    num_remaining = total_k - num_warmup

    inputs[0].append(comm.recv_forward(recv=not first_stage))
    for k in range(num_warmup):
        out = forward_k(k)
        next_c = chunk_id(k + 1, True)
        recv_prev = not (first_stage and next_c == 0) and k != total_k - 1
        if k == num_warmup - 1 and not forward_only and not all_warmup:
            inp, og = comm.communicate(send_next=out, recv_prev=recv_prev,
                                       recv_next=not last_stage, wait=not overlap_p2p_comm)
            out_grads[v - 1].append(og)
        else:   # overlapped: the next forward waits for its input, nobody for the send
            inp = comm.communicate(send_next=out, recv_prev=recv_prev,
                                   wait=not overlap_p2p_comm)[0]
        deallocate_output_tensor(out)
        inputs[next_c].append(inp)

    # Steady state, as Megatron's overlap_p2p_comm: the output is sent (and the next input
    # posted for) right after the forward, the input gradient right after the backward; each
    # receive is waited for only when its forward / backward needs it.
    for k in range(num_remaining):
        fk, bk = k + num_warmup, k
        out = forward_k(fk)
        recv_prev = True
        if first_stage:     # the first stage is p-1 virtual steps ahead of the last
            next_fc = chunk_id(fk - (p - 1), True)
            if next_fc == v - 1:
                recv_prev = False
            next_fc += 1
        else:
            next_fc = chunk_id(fk + 1, True)
        recv_next = True
        if last_stage:      # the last stage is p-1 virtual steps ahead of the first, backward
            next_bc = chunk_id(bk - (p - 1), False)
            if next_bc == 0:
                recv_next = False
            next_bc -= 1
        else:
            next_bc = chunk_id(bk + 1, False)
        if k == num_remaining - 1:
            recv_prev = False
        if overlap_p2p_comm:
            inp = comm.communicate(send_next=out, recv_prev=recv_prev, wait=False)[0]
            deallocate_output_tensor(out)
            in_grad = backward_k(bk)
            og = comm.communicate(send_prev=in_grad, recv_next=recv_next, wait=False)[1]
        else:
            in_grad = backward_k(bk)
            inp, og = comm.send_forward_backward_recv_forward_backward(
                out, in_grad, recv_prev=recv_prev, recv_next=recv_next)
            deallocate_output_tensor(out)
        if recv_prev:
            inputs[next_fc].append(inp)
        if recv_next:
            out_grads[next_bc].append(og)

    if not forward_only:
        if all_warmup:
            out_grads[v - 1].append(comm.recv_backward(recv=not last_stage))
        for k in range(num_remaining, total_k):
            in_grad = backward_k(k)
            next_bc = chunk_id(k + 1, False)
            recv_next = not (last_stage and next_bc == v - 1) and k != total_k - 1
            out_grads[next_bc].append(comm.communicate(send_prev=in_grad, recv_next=recv_next,
                                                       wait=not overlap_p2p_comm)[1])
    comm.wait_sends()
    return total


def get_forward_backward_func(pp_size: int, num_chunks: int = 1):
    """The schedule for a layout: no pipelining, 1F1B, or interleaved 1F1B (virtual stages)."""
    if pp_size == 1:
        if num_chunks != 1:
            raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size > 1.")
        return forward_backward_no_pipelining
    if num_chunks > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving
