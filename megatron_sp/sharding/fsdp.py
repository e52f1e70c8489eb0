"""--use-torch-fsdp2: fully sharded parameters, gradients and optimizer state (ZeRO-3) over dp x sp.

torch's FSDP2 (`fully_shard`) on the flattened dp x sp dimension of the mesh, composed with our
tensor-parallel layers and the pipeline as torchtitan composes it: tensor- and pipeline-parallel
shards are cut first (our layers hold their tp shard as a plain tensor), then FSDP2 shards each
rank's (tp, pp) slice along dim 0 over the n = dp*sp ranks of its dp x sp group (docs/design.md §11):

    (tp, pp) slice  W [R, C]  ->  dp x sp rank i holds rows [i*ceil(R/n), (i+1)*ceil(R/n)) of it

Units: one per transformer layer, the word/position embeddings when untied, and the root (the
rest: final norm, output layer, tied embeddings, which the output reads directly). Each layer's
forward prefetches the next layer's all-gather, each backward the previous one's. Expert
parallelism (ep > 1): a layer's E/ep experts differ per ep rank, so they are a unit of their own
inside the layer, sharded over their expert-data-parallel (edp) group instead (the ranks holding
the same experts, mesh.expert_groups):

    ep rank's experts  [E/ep, ...]  ->  edp rank j holds rows [j*ceil(E/ep/m), ...), m = edp size

Per step:
- forward/backward all-gather a unit's parameters just before it runs and free them after;
- gradients are reduce-scattered on the last micro-batch only (earlier ones accumulate unsharded,
  `set_requires_gradient_sync`), SUMMED: the loss is already normalised by the global token count,
  so FSDP2's division by n is turned off (`set_gradient_divide_factor(1.0)` with plain SUM
  reductions, `set_force_sum_reduction_for_comms`);
- then, on the local shards: the tp all-reduce of sequence-parallel-replicated gradients (norm
  weights under --sequence-parallel), the embedding-group sum of tied embeddings (first and last
  stage hold the same rows on the same dp x sp coordinate), the global gradient norm (squares of
  every local shard, summed over dp x sp, tp and pp) and clipping.
- --bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16): gathered parameters and the
  gradients on the wire are bf16, the sharded master weights, gradients and Adam moments fp32.
- --optimizer-cpu-offload: CPUOffloadPolicy: sharded parameters, gradients and optimizer state on
  the host (pinned on CUDA), the optimizer step on the host.

Checkpoints: a parameter (or Adam moment) is a DTensor whose local tensor is one more rectangle of
the same full tensor (`checkpoint_rectangle`), so the DCP keys and full shapes do not change.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp.grad_sync import (all_reduce_sum, expert_groups_of, expert_key, group_active,
                                   is_expert_parallel, sum_over_ep)

from .state_bytes import local_tensor, model_state_bytes, optimizer_tensors


class FSDPLayoutError(ValueError):
    """A model / layout that FSDP2 sharding cannot serve (refused at start-up)."""


def dp_sp_device_mesh(mesh, device_type: str = "cpu"):
    """The 1-D DeviceMesh over this rank's dp x sp group (one rank: a mesh of one)."""
    from torch.distributed.device_mesh import init_device_mesh
    if getattr(mesh, "dp_sp_mesh", None) is not None:
        return mesh.dp_sp_mesh
    return init_device_mesh(device_type, (1,), mesh_dim_names=("dp_sp",))


def ensure_process_group(device_type: str = "cpu") -> None:
    """FSDP2 needs torch.distributed even on one rank: a one-rank group on an in-memory store."""
    if dist.is_available() and not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)


def fsdp_rows(num_rows: int, n: int, i: int) -> tuple[int, int]:
    """[start, stop) of the dim-0 rows rank i of n holds (torch.chunk's split: ceil(R/n) each)."""
    size = -(-num_rows // n)
    start = min(i * size, num_rows)
    return start, min(start + size, num_rows)


def check_shardable(chunks, n: int) -> None:
    """Fused projections (SwiGLU gate+up) are stored per part: a shard must not straddle parts."""
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            parts = getattr(p, "tp_chunks", 1)
            if parts == 1 or getattr(p, "tp_partition_dim", None) != 0:
                continue
            rows, part = p.shape[0], p.shape[0] // parts
            for i in range(n):
                lo, hi = fsdp_rows(rows, n, i)
                if hi > lo and lo // part != (hi - 1) // part and (lo % part or (hi - lo) % part):
                    raise FSDPLayoutError(
                        f"--use-torch-fsdp2: the {rows} fused rows of {name} ({parts} parts of "
                        f"{part}) cannot be cut into {n} dp x sp shards without one straddling two "
                        f"parts: choose an --ffn-hidden-size whose per-tp rows ({part}) are a "
                        f"multiple of dp*sp = {n}, or a dp*sp that divides {parts}.")


def _param_attributes(module) -> dict:
    """{(owner module, name): the parameter's own attributes (tp_partition_dim, ...)}."""
    return {(m, name): dict(vars(p)) for m in module.modules()
            for name, p in m.named_parameters(recurse=False)}


def _restore_attributes(saved: dict) -> None:
    """fully_shard replaces each parameter by a DTensor parameter: carry the attributes over."""
    for (m, name), attrs in saved.items():
        p = getattr(m, name)
        for key, value in attrs.items():
            if not hasattr(p, key):
                setattr(p, key, value)


def apply_fsdp2(chunks, mesh, *, bf16: bool = False, cpu_offload: bool = False,
                device: torch.device | None = None) -> "FSDP2":
    """Shard every model chunk with fully_shard over dp x sp; returns the Trainer's sharding."""
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        fully_shard)
    device = device or next(chunks[0].parameters()).device
    ensure_process_group(device.type)
    dp_sp = dp_sp_device_mesh(mesh, device.type)
    check_shardable(chunks, dp_sp.size())
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                               cast_forward_inputs=False) if bf16
          else MixedPrecisionPolicy(cast_forward_inputs=False))
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    kwargs = dict(mesh=dp_sp, mp_policy=mp, offload_policy=offload)
    for chunk in chunks:
        saved = _param_attributes(chunk)
        layers = list(chunk.layers.values())
        for layer in layers:
            _shard_experts(layer, mesh, kwargs)
            fully_shard(layer, **kwargs)
        if chunk.embedding is not None and not chunk.config.tie_embeddings:
            fully_shard(chunk.embedding, **kwargs)
        fully_shard(chunk, **kwargs)
        _restore_attributes(saved)
        for prev, nxt in zip(layers, layers[1:]):
            prev.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([prev])
        for module in chunk.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)     # sum: the loss is already normalised
                module.set_force_sum_reduction_for_comms(True)   # plain SUM (gloo has no PREMUL_SUM)
    return FSDP2(chunks, mesh, device=device, offloaded=cpu_offload)


def _shard_experts(layer, mesh, kwargs) -> None:
    """Expert parallelism: a layer's E/ep experts differ per ep rank, so they are their own unit,
    sharded over their expert-data-parallel (edp) group, the ranks holding the same experts
    (torchtitan's dp_shard_mod_ep). Their gradients are reduce-scattered (summed) over edp."""
    import warnings
    from torch.distributed.fsdp import fully_shard
    # GroupedExperts returns a view (models/moe.py _ContiguousGrad makes its gradient dense); no
    # caller writes it in place, so FSDP2's warning about in-place ops on views does not apply.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGroupedExperts\) "
                                              r"returned a view tensor")
    for module in layer.modules():
        experts = [p for p in module.parameters(recurse=False) if is_expert_parallel(p)]
        if experts:
            edp = expert_groups_of(mesh, experts[0]).device_mesh["edp"]   # 1-D: this rank's edp
            fully_shard(module, **dict(kwargs, mesh=edp))


class FSDP2:
    """The Trainer's state sharding for --use-torch-fsdp2 (see megatron_sp.sharding)."""

    def __init__(self, chunks, mesh, *, device, offloaded: bool = False):
        self.chunks, self.mesh, self.device, self.offloaded = list(chunks), mesh, device, offloaded
        self.params = [p for c in self.chunks for p in c.parameters() if p.requires_grad]
        self.sp_params = [p for p in self.params if getattr(p, "sequence_parallel", False)]
        self.embedding_params = [p for p in self.params if getattr(p, "embedding_tied", False)]
        self._micro_batches = 1
        self._backwards = [0] * len(self.chunks)
        for i, chunk in enumerate(self.chunks):
            chunk.register_forward_hook(self._count_backward(i))

    # Gradient reduction on the last micro-batch of each chunk ----------------------------------
    def begin_step(self, num_micro_batches: int):
        """Earlier micro-batches accumulate unsharded gradients; the last one reduce-scatters."""
        self._micro_batches = num_micro_batches
        self._backwards = [0] * len(self.chunks)
        for chunk in self.chunks:
            chunk.set_requires_gradient_sync(num_micro_batches == 1)

    def _count_backward(self, index: int):
        def on_output_grad(_grad):
            self._backwards[index] += 1
            if self._backwards[index] == self._micro_batches:
                self.chunks[index].set_requires_gradient_sync(True)

        def hook(module, args, output):
            # The gradient of a chunk's output arrives before any of its parameters' gradients.
            if self._micro_batches > 1 and torch.is_tensor(output) and output.requires_grad:
                output.register_hook(on_output_grad)
        return hook

    def start_last_backward(self):
        pass        # the chunks' own counters decide (interleaved chunks finish at different times)

    def finish(self):
        """Gradients final on the local shards: sequence-parallel tp sums, tied-embedding sums."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.sp_params and group_active(self.mesh.tp_group):
            self._sum_local_grads(self.sp_params, self.mesh.tp_group, "tp/all_reduce")
        if self.embedding_params and group_active(self.mesh.embedding_group):
            self._sum_local_grads(self.embedding_params, self.mesh.embedding_group,
                                  "pp/embedding_all_reduce")

    def _sum_local_grads(self, params, group, kind):
        """Sum the local gradient shards over `group` in one flat buffer on the compute device
        (offloaded shards live on the host; the group may be NCCL)."""
        grads = [local_tensor(p.grad) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self.device)   # [sum of numels]
        all_reduce_sum(flat, group, kind)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))            # [numel] -> shard shape
            offset += g.numel()

    # Global norm and clipping ------------------------------------------------------------------
    def grad_norm(self) -> float:
        """L2 norm of the full gradient: local shards summed over dp x sp, tp shards, stages."""
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros_like(sharded)
        experts = {}   # (ep, etp) -> squared norm of this rank's edp shard of its ep rank's experts
        for p in self.params:
            if p.grad is None or getattr(p, "embedding_copy", False):
                continue
            sq = local_tensor(p.grad.detach()).double().pow(2).sum().to(self.device)
            if is_expert_parallel(p):
                experts[expert_key(p)] = experts.get(expert_key(p), 0.0) + sq
            elif getattr(p, "tp_partition_dim", None) is not None:
                sharded += sq
            else:
                replicated += sq
        total = torch.stack([sharded, replicated])                       # [2]
        all_reduce_sum(total, self.mesh.dp_sp_group, "dp_sp/all_reduce")
        # Replicated parameters hold the same gradient on every tp rank: count them once.
        total = torch.stack([total[0], total[1] / self.mesh.tp_size])   # [2]
        all_reduce_sum(total, self.mesh.tp_group, "tp/all_reduce")
        # Experts: shards summed over edp, then the ep ranks' experts (the ep group spans tp).
        total = total.sum() + sum_over_ep(experts, self.mesh, sharded_over_edp=True)
        all_reduce_sum(total, self.mesh.pp_group, "pp/all_reduce")
        return total.item() ** 0.5

    def clip_grad_norm(self, max_norm: float) -> float:
        norm = self.grad_norm()
        if max_norm > 0 and norm == norm and norm != float("inf") and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    local_tensor(p.grad).mul_(coef)
        return norm

    def model_state_bytes(self, optimizer) -> dict:
        """Local shards of the parameters, gradients and optimizer state: on the host when
        offloaded (CPUOffloadPolicy), else on the device (16 P_r / n either way, docs/design.md §11)."""
        state = {"params": self.params, "grads": [p.grad for p in self.params],
                 "optim": optimizer_tensors(optimizer)}
        return model_state_bytes(self.device, **{"host" if self.offloaded else "device": state})


# Checkpoints -----------------------------------------------------------------------------------

def is_sharded(tensor) -> bool:
    """True for an FSDP2 DTensor (a parameter or a state shaped like it)."""
    from torch.distributed.tensor import DTensor
    return isinstance(tensor, DTensor)



def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole (tp, pp) slice of an FSDP2 DTensor (all-gather over dp x sp), else a copy."""
    if is_sharded(tensor):
        return tensor.detach().full_tensor()
    return tensor.detach().clone()
