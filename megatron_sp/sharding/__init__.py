"""Sharded model state over the flattened dp x sp group (docs/design.md §11).

Under Ulysses the sp ranks of one sequence hold identical weights, exactly like dp ranks, so the
model state (weights, gradients, Adam moments) can be sharded over n = dp*sp ranks, as DeepSpeed
ZeRO does over sp x dp and Megatron over dp x cp.

The Trainer talks to one "state sharding" object (`Trainer(..., sharding=)`), whatever the mode.
Its interface:

    device                         the compute device
    begin_step(num_micro_batches)  before the first forward of a global batch
    start_last_backward()          the schedules' call before the stage's last backward
                                   (GradientSync's name: the object is passed as `grad_sync`)
    finish()                       after the schedule: gradients final (reduced over dp x sp,
                                   sequence-parallel ones summed over tp, tied embeddings summed
                                   over the embedding group)
    clip_grad_norm(max_norm)       the exact global norm over every shard; clips; returns it
    model_state_bytes(optimizer)   parameters, gradients, optimizer state on device / on host
                                   (state_bytes.model_state_bytes's dict)

Modes:
- `Replicated` (default): every dp x sp rank holds the whole state of its (tp, pp) slice; bucketed
  all-reduce overlapped with backward (megatron_sp.grad_sync).
- `DistributedOptimizer` (--use-distributed-optimizer, megatron_sp.sharding.distributed_optimizer):
  ZeRO-1/2, Adam state sharded by rows; the object is both the optimizer and the sharding.
- `FSDP2` (--use-torch-fsdp2, megatron_sp.sharding.fsdp): torch's fully_shard (ZeRO-3).
Both sharded modes take --optimizer-cpu-offload (their sharded state and step on the host).
"""
from __future__ import annotations

from megatron_sp.grad_sync import GradientSync, clip_grad_norm

from .state_bytes import model_state_bytes, optimizer_tensors


class Replicated:
    """Today's mode: the whole (tp, pp) slice's state on every dp x sp rank (16 P_r bytes)."""

    def __init__(self, chunks, mesh, bucket_mb: float = 25.0):
        self.mesh = mesh
        self.grad_sync = GradientSync(chunks, mesh, bucket_mb=bucket_mb)
        self.params = self.grad_sync.params
        self.device = next(chunks[0].parameters()).device

    def begin_step(self, num_micro_batches: int):
        pass

    def start_last_backward(self):
        self.grad_sync.start_last_backward()

    def finish(self):
        self.grad_sync.finish()

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_grad_norm(self.params, max_norm, self.mesh)

    def model_state_bytes(self, optimizer) -> dict:
        return model_state_bytes(self.device, device={
            "params": self.params, "grads": [p.grad for p in self.params],
            "optim": optimizer_tensors(optimizer)})


__all__ = ["Replicated", "model_state_bytes"]
