"""Activation offload: tensors saved for backward go to host memory and come back for backward.

`offload_saved_tensors()` is a saved_tensors_hooks pair like torch.autograd.graph.save_on_cpu
(pinned host buffers, asynchronous copies on GPU), with two differences: parameters stay where they
are (they are alive anyway), and on a CPU-only run the path is still exercised (the saved tensor is
copied into a fresh host buffer, so correctness tests cover it). With full recompute it wraps the
checkpoint call, so the only tensors it sees are the layer inputs the checkpoint keeps.

With `pool` (a megatron_sp.memory.host_pool.HostPool) the host copies are blocks of the pool's slab
(pinned once, exact sizes) instead of torch's caching host allocator's buffers (each rounded up to a
power of two); a block returns to the pool when autograd frees the saved tensor after its backward.
"""
from __future__ import annotations

import weakref

import torch

from megatron_sp.memory import accounting


def offload_saved_tensors(pool=None):
    """Context manager: tensors saved for backward in the body live on the host until backward.

    pool: a HostPool to hold the host copies (None: a fresh buffer each, pinned on CUDA).

    A tensor saved by several ops in the body (a norm's input, ...) is copied once. The map of
    copies belongs to this context only: once the body has run, the host copies are held by the
    autograd graph alone and are freed with it after backward.
    """
    copies: dict = {}   # (address, layout, version) -> (weak ref to the device tensor, host copy)

    def pack(t: torch.Tensor):
        if accounting.is_parameter(t):
            return (None, t)
        if accounting.derived_from_parameters(t):   # a weight copy: as cheap to keep as to move
            accounting.record_weight_copy(t)
            return (None, t)
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               t.stride(), t.dtype, t._version)
        hit = copies.get(key)
        if hit is not None and hit[0]() is t:   # the weak ref tells a reused address apart
            return (t.device, hit[1])
        # Same strides as the saved tensor (a checkpoint's recompute checks the layout of what it
        # gets back: a sequence tile is a strided view; a contiguous copy takes another kernel path).
        if pool is not None:
            host = pool.empty(t.size(), t.dtype, t.stride())
        else:
            host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype,
                                       pin_memory=t.device.type != "cpu")
        host.copy_(t, non_blocking=t.device.type != "cpu")
        accounting.record_host(host, t, None if pool is None or host.numel() == 0
                               else pool.block(host))
        copies[key] = (weakref.ref(t), host)
        return (t.device, host)

    return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)


def _unpack(packed):
    device, t = packed
    if device is None or device.type == "cpu":
        return t
    out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
    return out.copy_(t, non_blocking=True)
