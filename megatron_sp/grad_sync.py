"""Communication of the training step outside the layers: gradients, norms and loss reductions.

- Gradients of parameters replicated over data and sequence parallelism are summed over the dp x sp
  group (the loss is already normalised by the global token count, so a sum is the global mean), in
  buckets that are launched asynchronously from gradient hooks during the last backward pass, so
  the all-reduce overlaps the rest of backward.
- Under --sequence-parallel, tp-replicated parameters (norms, row-parallel biases; the MoE router,
  shared expert and, without expert parallelism, the experts) saw only their tp rank's tokens:
  their gradients are summed over tp.
- Expert-parallel experts (--expert-model-parallel-size: each ep rank holds different experts) are
  summed over their expert-data-parallel group instead (which holds the tp ranks too: experts fold
  over the whole stage), in buckets of their own; the gradient norm sums their squares over the ep
  group.
- Tied embeddings with pipelining: the first and last stage each hold the word embeddings; their
  gradients are summed over the embedding group so both copies stay identical.
- The global gradient norm over every rank, and the scalar reductions of loss and token counts.
- Monitoring: every rank's step time gathered on every rank (the straggler report).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_sp import comm_stats


def group_active(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def all_reduce_sum(tensor: torch.Tensor, group, kind: str = "dp/all_reduce") -> torch.Tensor:
    """In-place sum over `group` (identity for None / size 1); returns the tensor."""
    if group_active(group):
        comm_stats.record(kind, comm_stats.all_reduce_bytes(tensor.numel(), tensor.element_size(),
                                                            dist.get_world_size(group)))
        dist.all_reduce(tensor, group=group)
    return tensor


def is_expert_parallel(p) -> bool:
    """Whether `p` is one ep rank's E/ep experts (models/moe.py marks them; ep > 1)."""
    return getattr(p, "expert_parallel", False) and getattr(p, "ep_size", 1) > 1


def expert_key(p) -> tuple[int, int]:
    """(ep, etp) of an expert-parallel parameter: the mesh.expert_groups its experts live on
    (etp > 1: each tp rank holds its ffn slice of them)."""
    return p.ep_size, getattr(p, "etp_size", 1)


def expert_groups_of(mesh, p):
    """mesh.expert_groups of expert-parallel parameter p (its ep and edp groups)."""
    return mesh.expert_groups(*expert_key(p))


class _Bucket:
    def __init__(self, params, group, kind="dp_sp/all_reduce"):
        self.params = params
        self.group, self.kind = group, kind
        self.ready = 0
        self.handle = None
        self.buffer = None

    def launch(self, dtype=None):
        grads = [p.grad.reshape(-1) for p in self.params]
        self.buffer = torch.cat(grads)                                # [sum of numels]
        if dtype is not None:        # --grad-reduce-in-bf16: bf16 on the wire, fp32 grads after
            self.buffer = self.buffer.to(dtype)
        comm_stats.record(self.kind, comm_stats.all_reduce_bytes(
            self.buffer.numel(), self.buffer.element_size(), dist.get_world_size(self.group)))
        self.handle = dist.all_reduce(self.buffer, group=self.group, async_op=True)

    def finish(self):
        self.handle.wait()
        offset = 0
        for p in self.params:
            n = p.grad.numel()
            p.grad.copy_(self.buffer[offset:offset + n].view_as(p.grad))  # [numel] -> param shape
            offset += n
        self.handle = self.buffer = None
        self.ready = 0


class GradientSync:
    """Bucketed, backward-overlapped gradient reduction for one model (all its pipeline chunks).

    Call `start_last_backward()` before the backward pass of the last micro-batch (hooks then launch
    each bucket's all-reduce as soon as its gradients are final) and `finish()` after it.
    Without `start_last_backward()`, `finish()` reduces everything at once.
    """

    def __init__(self, modules, mesh, bucket_mb: float = 25.0, overlap: bool = True):
        self.mesh = mesh
        self.group = mesh.dp_sp_group if group_active(mesh.dp_sp_group) else None
        params = [p for m in modules for p in m.parameters() if p.requires_grad]
        self.params = params
        self.sp_params = [p for p in params if getattr(p, "sequence_parallel", False)]
        self.embedding_params = [p for p in params if getattr(p, "embedding_tied", False)]
        self.buckets: list[_Bucket] = []
        self._armed = False
        self.reduce_dtype = None     # torch.bfloat16 with --grad-reduce-in-bf16 (Megatron's flag)
        if self.group is None and not any(is_expert_parallel(p) for p in params):
            return      # (experts fold over tp too: at dp x sp = 1 their edp group may not be)
        limit = bucket_mb * 2**20
        # Expert-parallel experts (different experts on each ep rank) are reduced over their
        # expert-data-parallel group instead, in buckets of their own (none when edp is one rank).
        by_group = {}
        for p in reversed(params):               # backward visits layers roughly in reverse
            if is_expert_parallel(p):
                key = ("edp",) + expert_key(p)
                group = expert_groups_of(mesh, p).edp_group
                group = group if group_active(group) else None
            else:
                key, group = ("dp_sp",), self.group
            if group is not None:
                by_group.setdefault(key, (group, []))[1].append(p)
        for key, (group, members) in by_group.items():
            kind = "edp/all_reduce" if key[0] == "edp" else "dp_sp/all_reduce"
            current, size = [], 0
            for p in members:
                current.append(p)
                size += p.numel() * 4
                if size >= limit:
                    self.buckets.append(_Bucket(current, group, kind))
                    current, size = [], 0
            if current:
                self.buckets.append(_Bucket(current, group, kind))
        if overlap:
            owner = {p: b for b in self.buckets for p in b.params}
            for p in params:
                if p in owner:
                    p.register_post_accumulate_grad_hook(self._make_hook(owner[p]))

    def _make_hook(self, bucket):
        def hook(param):
            if not self._armed:
                return
            bucket.ready += 1
            if bucket.ready == len(bucket.params) and bucket.handle is None:
                bucket.launch(self.reduce_dtype)
        return hook

    def start_last_backward(self):
        self._armed = True

    def finish(self):
        """Complete every reduction; gradients are then final on every rank."""
        self._armed = False
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in self.buckets:
            if bucket.handle is None:
                bucket.launch(self.reduce_dtype)
        for bucket in self.buckets:
            bucket.finish()
        if self.sp_params and group_active(self.mesh.tp_group):
            self._all_reduce_flat([p.grad for p in self.sp_params], self.mesh.tp_group, "tp/all_reduce")
        if self.embedding_params and group_active(self.mesh.embedding_group):
            self._all_reduce_flat([p.grad for p in self.embedding_params], self.mesh.embedding_group,
                                  "pp/embedding_all_reduce")

    @staticmethod
    def _all_reduce_flat(grads, group, kind):
        flat = all_reduce_sum(torch.cat([g.reshape(-1) for g in grads]), group, kind)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))   # [numel] -> grad shape
            offset += g.numel()


def global_grad_norm(params, mesh, grads=None, shard_group=None,
                     experts_sharded: bool = False) -> float:
    """L2 norm of the full gradient over every rank: tp shards summed, stages summed, copies once.

    `grads`: the gradients to measure, one per parameter (default: each p.grad); `shard_group`: the
    group over which they are sharded, summed over too (the distributed optimizer's dp x sp rows);
    `experts_sharded`: expert-parallel gradients are rows sharded over their edp group (the
    distributed optimizer), summed over it before the ep sum.
    """
    grads = [p.grad for p in params] if grads is None else grads
    device = next((g.device for g in grads if g is not None), _device(params))
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    experts = {}   # (ep, etp) -> squared norm of this ep rank's experts
    for p, grad in zip(params, grads):   # summed on the device: no host sync per parameter
        if grad is None or getattr(p, "embedding_copy", False):
            continue
        sq = grad.detach().double().pow(2).sum()
        if is_expert_parallel(p):
            experts[expert_key(p)] = experts.get(expert_key(p), 0.0) + sq
        elif getattr(p, "tp_partition_dim", None) is not None:
            sharded += sq
        else:
            replicated += sq
    # Replicated parameters hold the same gradient on every tp rank: count them once.
    total = torch.stack([sharded, replicated / mesh.tp_size])
    all_reduce_sum(total, shard_group, "dp_sp/all_reduce")
    all_reduce_sum(total, mesh.tp_group, "tp/all_reduce")
    # etp 1: the ep group already spans the tp ranks (experts folded over the stage); etp = tp:
    # the ep sum is followed by one over tp. Either way every rank of the stage then holds the
    # experts' whole square, added once, after the tp sum.
    total = total.sum() + sum_over_ep(experts, mesh, experts_sharded)
    all_reduce_sum(total, mesh.pp_group, "pp/all_reduce")
    return math.sqrt(total.item())


def sum_over_ep(experts: dict, mesh, sharded_over_edp: bool = False):
    """The per-(ep, etp) sums of expert-parallel parameters (each ep rank holds different experts),
    each summed over its ep group (first over its edp group when each edp rank holds other rows:
    `sharded_over_edp`; then over tp when etp = tp, each tp rank holding other ffn slices); 0
    without any. Every rank of a stage holds the same layers, so the groups agree on whether to
    reduce."""
    total = 0.0
    for (ep, etp), value in sorted(experts.items()):
        value = torch.as_tensor(value, dtype=torch.float64).clone()
        groups = mesh.expert_groups(ep, etp)
        if sharded_over_edp:
            value = all_reduce_sum(value, groups.edp_group, "edp/all_reduce")
        value = all_reduce_sum(value, groups.ep_group, "ep/all_reduce")
        if etp > 1:
            value = all_reduce_sum(value, mesh.tp_group, "tp/all_reduce")
        total = total + value
    return total


def model_parallel_sum(params, per_param, mesh) -> float:
    """Sum of per_param(p) over the whole model (e.g. zeros in the gradient, squared weights):
    tp shards summed, tp-replicated parameters once, expert-parallel experts summed over ep,
    stages summed, tied embedding copies skipped."""
    device = _device(params)
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    experts = {}
    for p in params:
        if getattr(p, "embedding_copy", False):
            continue
        value = per_param(p).to(device)
        if is_expert_parallel(p):
            experts[expert_key(p)] = experts.get(expert_key(p), 0.0) + value
        elif getattr(p, "tp_partition_dim", None) is not None:
            sharded += value
        else:
            replicated += value
    total = torch.stack([sharded, replicated / mesh.tp_size])
    all_reduce_sum(total, mesh.tp_group, "tp/all_reduce")
    total = total.sum() + sum_over_ep(experts, mesh)     # the ep group spans tp (as above)
    all_reduce_sum(total, mesh.pp_group, "pp/all_reduce")
    return total.item()


def _device(params):
    for p in params:
        return p.device
    return torch.device("cpu")


def clip_grad_norm(params, max_norm: float, mesh, grads=None, shard_group=None,
                   experts_sharded: bool = False) -> float:
    """Scale every gradient so the global norm is at most max_norm (max_norm <= 0: only measure).

    `grads` / `shard_group` / `experts_sharded` as in global_grad_norm (default: each p.grad, not
    sharded)."""
    params = list(params)
    grads = [p.grad for p in params] if grads is None else list(grads)
    norm = global_grad_norm(params, mesh, grads, shard_group, experts_sharded)
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for grad in grads:
            if grad is not None:
                grad.mul_(coef)
    return norm


def reduce_loss_and_count(values: torch.Tensor, mesh) -> torch.Tensor:
    """Sum [loss_sum, ...] over dp x sp and across stages (only the last stage has a loss)."""
    all_reduce_sum(values, mesh.dp_sp_group, "dp_sp/all_reduce")
    all_reduce_sum(values, mesh.pp_group, "pp/all_reduce")
    return values


def gather_step_times(seconds: float, device=None) -> list[float]:
    """Every rank's `seconds` (its own time per iteration), gathered on every rank in rank order.

    The straggler report: one all-gather of one float64 per rank over the whole world, called by
    every rank at the same iteration (each --log-interval). Identity without a process group.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [float(seconds)]
    local = torch.tensor([float(seconds)], dtype=torch.float64, device=device)     # [1]
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]   # world x [1]
    dist.all_gather(gathered, local)
    return [t.item() for t in gathered]
