"""Activation offload: tensors saved for backward go to host memory and come back for backward.

`offload_saved_tensors()` is a saved_tensors_hooks pair like torch.autograd.graph.save_on_cpu
(pinned host buffers, asynchronous copies on GPU), with two differences: parameters stay where they
are (they are alive anyway), and on a CPU-only run the path is still exercised (the saved tensor is
copied into a fresh host buffer, so correctness tests cover it). With full recompute it wraps the
checkpoint call, so the only tensors it sees are the layer inputs the checkpoint keeps.
"""
from __future__ import annotations

import weakref

import torch

from megatron_sp.memory import accounting


# A tensor saved by several ops (a norm's input, ...) is copied once: (device tensor, host copy) by
# address, layout and version; the weak reference tells a live tensor from a freed one whose address
# was reused.
_COPIES: dict = {}


def _pack(t: torch.Tensor):
    if accounting.is_parameter(t):
        return (None, t)
    key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
           t.dtype, t._version)
    hit = _COPIES.get(key)
    if hit is not None and hit[0]() is t:
        return (t.device, hit[1])
    if len(_COPIES) > 4096:
        for k in [k for k, (ref, _) in _COPIES.items() if ref() is None]:
            del _COPIES[k]
    if t.device.type == "cpu":
        host = t.detach().clone()           # CPU: the same path, a host copy
    else:
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
        host.copy_(t, non_blocking=True)
    accounting.record_host(host, t)
    _COPIES[key] = (weakref.ref(t), host)
    return (t.device, host)


def _unpack(packed):
    device, t = packed
    if device is None or device.type == "cpu":
        return t
    return t.to(device, non_blocking=True)


def offload_saved_tensors():
    """Context manager: tensors saved for backward in the body live on the host until backward."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
