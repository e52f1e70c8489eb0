"""Model-state bytes per rank, measured from the tensors themselves (--report-memory, DESIGN 11).

Parameters, gradients and optimizer state, each split into "device" and "host". A DTensor counts
its local shard only (what this rank holds). Host means: a CPU tensor while the model computes on
a GPU, or the sharded state that --optimizer-cpu-offload keeps on the host (on a CPU-only run the
host is the device, so the offload policy decides the column).
"""
from __future__ import annotations

import torch

KINDS = ("params", "grads", "optim")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (unpadded), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def _where(t: torch.Tensor, compute_device: str, offloaded: bool) -> str:
    if t.device.type == "cpu" and (compute_device != "cpu" or offloaded):
        return "host"
    return "device"


def model_state_bytes(chunks, optimizer=None, *, offloaded: bool = False) -> dict[str, int]:
    """{params,grads,optim}_{device,host}_bytes and the device / host totals of this rank."""
    params, seen = [], set()
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    on_gpu = any(local_tensor(p).is_cuda for p in params) or (offloaded and torch.cuda.is_available())
    compute = "cuda" if on_gpu else "cpu"
    out = {f"{k}_{w}_bytes": 0 for k in KINDS for w in ("device", "host")}

    def add(kind, t):
        if torch.is_tensor(t):
            t = local_tensor(t)
            out[f"{kind}_{_where(t, compute, offloaded)}_bytes"] += t.numel() * t.element_size()

    for p in params:
        add("params", p.detach())
        if p.grad is not None:
            add("grads", p.grad)
        if optimizer is not None:
            for value in optimizer.state.get(p, {}).values():
                if torch.is_tensor(value) and value.dim() > 0:   # moments; not the scalar step
                    add("optim", value)
    out["device_bytes"] = sum(out[f"{k}_device_bytes"] for k in KINDS)
    out["host_bytes"] = sum(out[f"{k}_host_bytes"] for k in KINDS)
    return out


def format_state_bytes(report: dict) -> str:
    """One log-line fragment: model state MB on device / on host per rank."""
    def mb(key):
        return report[key] / 2**20
    return (f"model state per rank (MB): device {mb('device_bytes'):.1f} "
            f"(params {mb('params_device_bytes'):.1f}, grads {mb('grads_device_bytes'):.1f}, "
            f"optimizer {mb('optim_device_bytes'):.1f}), host {mb('host_bytes'):.1f}")
