"""Model-state bytes per rank, measured from the tensors themselves (--report-memory, docs/design.md §11).

One measurement for every mode: parameters, gradients and optimizer state ("params", "grads",
"optim"), each split into "device" and "host". A DTensor counts its local shard only (what this
rank holds). Each mode says which of its tensors it keeps on the compute device and which in host
memory (--optimizer-cpu-offload); on a GPU run every tensor is then placed by where it actually
lives, on a CPU-only run (host memory is the device's) by the mode's word.
"""
from __future__ import annotations

import torch

KINDS = ("params", "grads", "optim")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (unpadded), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The optimizer's per-parameter state tensors (Adam moments), not the scalar step."""
    return [t for st in optimizer.state.values() for t in st.values()
            if torch.is_tensor(t) and t.dim() > 0]


def model_state_bytes(compute_device: torch.device, device: dict | None = None,
                      host: dict | None = None) -> dict[str, int]:
    """{params,grads,optim}_{device,host}_bytes and the device / host totals of this rank.

    device / host: {kind: tensors} the mode keeps on the compute device / in host memory (None
    entries are skipped: a parameter without a gradient yet).
    """
    out = {f"{k}_{w}_bytes": 0 for k in KINDS for w in ("device", "host")}
    on_gpu = torch.device(compute_device).type != "cpu"
    for declared, kinds in (("device", device or {}), ("host", host or {})):
        for kind, tensors in kinds.items():
            for t in tensors:
                if t is None:
                    continue
                t = local_tensor(t.detach())
                where = ("host" if t.device.type == "cpu" else "device") if on_gpu else declared
                out[f"{kind}_{where}_bytes"] += t.numel() * t.element_size()
    out["device_bytes"] = sum(out[f"{k}_device_bytes"] for k in KINDS)
    out["host_bytes"] = sum(out[f"{k}_host_bytes"] for k in KINDS)
    return out


def format_state_bytes(report: dict) -> str:
    """One log-line fragment: model state MB on device / on host per rank."""
    def mb(key):
        return report[key] / 2**20
    return (f"model state per rank (MB): device {mb('device_bytes'):.1f} "
            f"(params {mb('params_device_bytes'):.1f}, grads {mb('grads_device_bytes'):.1f}, "
            f"optimizer {mb('optim_device_bytes'):.1f}), host {mb('host_bytes'):.1f} "
            f"(params {mb('params_host_bytes'):.1f}, grads {mb('grads_host_bytes'):.1f}, "
            f"optimizer {mb('optim_host_bytes'):.1f})")
