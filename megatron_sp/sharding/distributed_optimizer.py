"""The distributed optimizer (Megatron-LM's --use-distributed-optimizer, ZeRO-1/2) over dp x sp.

Every rank keeps the full parameters and full gradients of its (tp, pp) slice, but the optimizer
state (Adam moments, and fp32 master weights when the parameters are 16-bit) of only 1/n of them,
n = dp x sp (docs/design.md §11; ZeRO, Rajbhandari et al. 2020, stages 1-2; Megatron's distributed optimizer):

1. backward: each gradient bucket is reduce-scattered (summed) over dp x sp from the gradients'
   post-accumulate hooks during the last backward pass, so each rank receives the reduced gradient
   of the rows it owns while the rest of backward runs;
2. the global gradient norm sums the owned rows of every rank (each row counted once), then clips;
3. each rank steps AdamW on its rows;
4. the updated rows are all-gathered, so every rank holds the full parameters again.

Layout: every parameter is split along its rows (dim 0; a fused tp projection, stored as [c, m, ...],
along the m rows of each part) into n pieces of ceil(rows / n) rows; the last pieces are shorter or
empty. A bucket's flat buffer is rank-major [n, segment]: segment r holds rank r's piece of every
parameter of the bucket (padded to ceil(rows / n) rows), so one reduce-scatter hands every rank its
pieces and one all-gather returns everybody's. A piece is a rectangle of the full tensor, so the
sharded Adam state is checkpointed under the unsharded optimizer's DCP keys and full shapes
(`checkpoint_state`): checkpoints load across both modes and any layout.

Expert parallelism (--expert-model-parallel-size ep): the experts of one ep rank are different
from its dp x sp peers', so they are sharded over their expert-data-parallel (edp) group instead,
n/ep ranks, in buckets of their own (a bucket has one group); their pieces are rectangles of the
full [E, ...] stack under the same DCP keys, and the gradient norm sums their owned rows over edp,
then over ep (grad_sync.global_grad_norm, experts_sharded).

Without offload and with fp32 parameters (our default: bf16 runs use autocast), the master rows are
views of the parameters themselves and the owned gradient rows views of p.grad: nothing is copied.
--optimizer-cpu-offload: the owned master rows, their gradients and the Adam moments live in host
memory (pinned on CUDA) and the step runs there; gradient rows are copied down, updated rows up.
16-bit parameters get fp32 master rows (and fp32 copies of their owned gradient rows); their
gradients are reduce-scattered in the parameters' dtype (bf16 on the wire with --grad-reduce-in-bf16).

Transient memory: a bucket's gradients are copied into its rank-major [n, segment] buffer for the
reduce-scatter; at most IN_FLIGHT (2) such buffers are alive during backward (the oldest is finished
when a third is launched). The parameter all-gather holds one bucket's buffer at a time (all of
them, 4 P_r, with --overlap-param-gather).

--overlap-param-gather: the all-gathers of every bucket are launched at once after the step and
unpacked as each completes (they overlap one another, not the next forward pass); without it each
bucket is gathered and unpacked in turn.
"""
from __future__ import annotations

import math

import torch

from megatron_sp.grad_sync import clip_grad_norm, expert_groups_of, is_expert_parallel
from megatron_sp.training.optimizer import fused_adamw, param_groups
from megatron_sp.sharding import comm
from megatron_sp.sharding.state_bytes import model_state_bytes, optimizer_tensors
from megatron_sp.mesh import group_rank, group_size

ADAM_STATES = ("exp_avg", "exp_avg_sq")
IN_FLIGHT = 2        # gradient buckets whose reduce-scatter may be pending during backward


class _Piece:
    """One parameter's split into n row pieces, and where the padded piece lies in a bucket segment.

    `view(t)` is t (shaped like the parameter) in the split geometry; dimension `dim` of it is cut
    into pieces of `rows` rows; rank r owns rows [lo, hi) = span(r).
    """

    def __init__(self, param: torch.Tensor, n: int):
        if param.dim() == 0:
            raise ValueError("the distributed optimizer needs parameters with at least one dimension.")
        self.param, self.n = param, n
        self.chunks = getattr(param, "tp_chunks", 1)
        self.fused = self.chunks > 1 and getattr(param, "tp_partition_dim", None) == 0
        self.dim = 1 if self.fused else 0
        shape = list(self.view(param).shape)
        self.size = shape[self.dim]
        self.rows = math.ceil(self.size / n)
        shape[self.dim] = self.rows
        self.padded_shape = torch.Size(shape)
        self.numel = self.padded_shape.numel()
        self.even = self.size == n * self.rows      # no padding: every rank's piece in one copy
        self.offset = 0

    def view(self, t: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return t.unflatten(0, (self.chunks, t.shape[0] // self.chunks))   # [c*m, ...] -> [c, m, ...]
        return t

    def span(self, rank: int) -> tuple[int, int]:
        return min(rank * self.rows, self.size), min((rank + 1) * self.rows, self.size)

    def piece(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s rows of t (a view)."""
        lo, hi = self.span(rank)
        return self.view(t).narrow(self.dim, lo, hi - lo)

    def all_pieces(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's piece of t at once, [n, padded piece shape] (a view; only when `even`)."""
        split = self.view(t).unflatten(self.dim, (self.n, self.rows))   # [.., n*rows, ..] -> [.., n, rows, ..]
        return split.movedim(self.dim, 0)                                # -> [n, .., rows, ..]

    def all_slots(self, buffer: torch.Tensor) -> torch.Tensor:
        """This parameter's slots in every segment of a bucket buffer [n, segment]: [n, padded]."""
        return buffer[:, self.offset:self.offset + self.numel].view(self.n, *self.padded_shape)

    def slot(self, segment: torch.Tensor, rank: int) -> torch.Tensor:
        """Where rank `rank`'s piece lies in a bucket segment [segment] (a view, padding cut off)."""
        lo, hi = self.span(rank)
        padded = segment[self.offset:self.offset + self.numel].view(self.padded_shape)  # [.., rows, ..]
        return padded.narrow(self.dim, 0, hi - lo)


class _Bucket:
    """Parameters whose gradients are reduce-scattered (and rows all-gathered) together."""

    def __init__(self, pieces: list[_Piece], n: int, group=None, rank: int = 0):
        self.pieces, self.n, self.group, self.rank = pieces, n, group, rank
        offset = 0
        for pc in pieces:
            pc.offset = offset
            offset += pc.numel
        self.segment = offset
        self.ready = 0
        self.launched = False
        self.handle = self.buffer = self.out = None

    def _empty(self, rows: int | None = None, dtype=None) -> torch.Tensor:
        p = self.pieces[0].param
        shape = (self.segment,) if rows is None else (rows, self.segment)
        return torch.zeros(shape, dtype=dtype or p.dtype, device=p.device)

    def launch_reduce(self, group, dtype=None):
        """dtype: the wire's (torch.bfloat16 with --grad-reduce-in-bf16), else the gradients'."""
        self.buffer = self._empty(self.n, dtype)                            # [n, segment]
        for pc in self.pieces:
            if pc.even:
                pc.all_slots(self.buffer).copy_(pc.all_pieces(pc.param.grad))
                continue
            for r in range(self.n):
                pc.slot(self.buffer[r], r).copy_(pc.piece(pc.param.grad, r))
        self.out = self._empty(dtype=dtype)                                 # [segment]
        self.handle = comm.reduce_scatter_sum(self.out, self.buffer, group)
        self.launched = True

    def finish_reduce(self):
        """Wait, copy the reduced owned rows into p.grad and free the buffers (once per step)."""
        rank = self.rank
        if self.out is None:
            return
        if self.handle is not None:
            self.handle.wait()
        for pc in self.pieces:
            pc.piece(pc.param.grad, rank).copy_(pc.slot(self.out, rank))
        self.handle = self.buffer = self.out = None


    def launch_gather(self):
        rank = self.rank
        mine = self._empty()                                                # [segment]
        for pc in self.pieces:
            pc.slot(mine, rank).copy_(pc.piece(pc.param.detach(), rank))
        self.buffer = self._empty(self.n)                                   # [n, segment]
        self.handle = comm.all_gather_segments(self.buffer, mine, self.group)

    def finish_gather(self):
        rank = self.rank
        if self.handle is not None:
            self.handle.wait()
        with torch.no_grad():
            for pc in self.pieces:
                if pc.even:     # own rows included: they are copied back unchanged
                    pc.all_pieces(pc.param.detach()).copy_(pc.all_slots(self.buffer))
                    continue
                for r in range(self.n):
                    if r != rank:
                        pc.piece(pc.param.detach(), r).copy_(pc.slot(self.buffer[r], r))
        self.handle = self.buffer = None


class DistributedOptimizer:
    """AdamW sharded over dp x sp; also owns the gradient reduction and the gradient norm.

    The Trainer takes it twice: as its optimizer (zero_grad, step, param_groups for the LR
    schedule) and as its state sharding (`Trainer(..., sharding=)`, megatron_sp.sharding: begin_step,
    start_last_backward, finish, clip_grad_norm, model_state_bytes).
    """

    def __init__(self, chunks, mesh, *, lr: float, weight_decay: float = 0.01, betas=(0.9, 0.999),
                 eps: float = 1e-8, bucket_mb: float = 25.0, overlap_param_gather: bool = False,
                 cpu_offload: bool = False):
        self.mesh, self.cpu_offload, self.overlap_param_gather = mesh, cpu_offload, overlap_param_gather
        self.group = mesh.dp_sp_group if group_size(mesh.dp_sp_group) > 1 else None
        self.n, self.rank = group_size(self.group), group_rank(self.group)
        self.params = [p for c in chunks for p in c.parameters() if p.requires_grad]
        self.device = self.params[0].device
        # Expert-parallel experts (different on each ep rank) are sharded over their own
        # expert-data-parallel group instead (Megatron's expert data parallelism).
        self.shard_of = {p: self._shard_group(p) for p in self.params}   # (group, n, rank)
        self.pieces = {p: _Piece(p, self.shard_of[p][1]) for p in self.params}
        self.sp_params = [p for p in self.params if getattr(p, "sequence_parallel", False)]
        self.embedding_params = [p for p in self.params if getattr(p, "embedding_tied", False)]
        self.host_pool = self._host_pool()
        self.master = {p: self._master(p) for p in self.params if self._owned(p).numel() > 0}
        self.host_grads = {p: self._host_empty(m) for p, m in self.master.items()   # where the
                           if not self._is_view(p)}                                # master lives
        # torch's fused kernel, as the unsharded optimizer (foreach cost +17% of an H200 llama-1b
        # step at 8K); the strided master rows (column pieces of fused tp projections) on foreach
        groups = [{"params": [self.master[p] for p in g["params"] if p in self.master],
                   "weight_decay": g["weight_decay"]} for g in param_groups(chunks, weight_decay)]
        self.optimizer = fused_adamw(groups, lr, betas, eps)
        self.buckets = self._make_buckets(bucket_mb)
        self.reduce_dtype = None    # torch.bfloat16 with --grad-reduce-in-bf16 (Megatron's flag)
        self._armed, self._in_flight, self._reduced = False, [], False
        owner = {pc.param: b for b in self.buckets for pc in b.pieces}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._make_hook(owner[p]))

    @classmethod
    def from_config(cls, chunks, mesh, job) -> "DistributedOptimizer":
        """--use-distributed-optimizer from a JobConfig: its Adam flags and bucket/offload options."""
        t, p = job.training, job.parallel
        return cls(chunks, mesh, lr=t.lr, weight_decay=t.weight_decay,
                   betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                   bucket_mb=p.grad_bucket_size_mb, overlap_param_gather=p.overlap_param_gather,
                   cpu_offload=p.optimizer_cpu_offload)

    # Layout ---------------------------------------------------------------------------------------

    def _shard_group(self, p) -> tuple:
        """(group, size, this rank's index) p is sharded over: dp x sp, or for expert-parallel
        experts their edp group (None where it has one rank)."""
        if not is_expert_parallel(p):
            return self.group, self.n, self.rank
        edp = expert_groups_of(self.mesh, p).edp_group
        return edp, group_size(edp), group_rank(edp)

    def _owned(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's rows of parameter p (a view of it)."""
        return self.pieces[p].piece(p.detach(), self.shard_of[p][2])

    def _is_view(self, p) -> bool:
        return not self.cpu_offload and p.dtype == torch.float32

    def _host_pool(self):
        """--optimizer-cpu-offload on CUDA: one exact pinned host pool for the fp32 master rows and
        their gradient rows (megatron_sp/memory/host_pool.py: no rounding to powers of two)."""
        if not (self.cpu_offload and self.device.type == "cuda"):
            return None
        from megatron_sp.memory.host_pool import HostPool, pool_bytes
        sizes = [4 * self._owned(p).numel() for p in self.params if self._owned(p).numel() > 0]
        return HostPool(pool_bytes(sizes * 2), pin=True, what="the offloaded optimizer state",
                        remedy="shard it over more ranks (dp x sp) or use --use-torch-fsdp2")

    def _host_empty(self, like: torch.Tensor) -> torch.Tensor:
        """An fp32 tensor shaped like `like` where the master rows live (the host pool if any)."""
        if self.host_pool is not None:
            return self.host_pool.empty(like.shape, torch.float32)
        return torch.empty(like.shape, dtype=torch.float32, device=like.device,
                           pin_memory=like.is_pinned())

    def _master(self, p) -> torch.Tensor:
        """fp32 master rows: a view of p itself, or a copy in host memory (offload) / in fp32."""
        own = self._owned(p)
        if self._is_view(p):
            return own
        if self.host_pool is not None:
            return self.host_pool.empty(own.shape, torch.float32).copy_(own)
        device = torch.device("cpu") if self.cpu_offload else p.device
        return torch.empty(own.shape, dtype=torch.float32, device=device).copy_(own)

    def _make_buckets(self, bucket_mb: float) -> list[_Bucket]:
        """Buckets of parameters sharded over the same group (dp x sp, or one edp group)."""
        buckets, current, size = [], {}, {}
        for p in reversed(self.params):              # backward visits layers roughly in reverse
            key = self.shard_of[p]
            current.setdefault(key, []).append(self.pieces[p])
            size[key] = size.get(key, 0) + p.numel() * p.element_size()
            if size[key] >= bucket_mb * 2**20:
                buckets.append(_Bucket(current.pop(key), key[1], key[0], key[2]))
                size[key] = 0
        for key, pieces in current.items():
            buckets.append(_Bucket(pieces, key[1], key[0], key[2]))
        return buckets

    # Gradient reduction (the GradientSync interface) ------------------------------------------------

    def _make_hook(self, bucket):
        def hook(param):
            if not self._armed:
                return
            bucket.ready += 1
            if bucket.ready == len(bucket.pieces) and not bucket.launched:
                bucket.launch_reduce(bucket.group, self.reduce_dtype)
                self._in_flight.append(bucket)
                # At most IN_FLIGHT buckets' [n, segment] copies alive: finish the oldest (by now
                # usually complete), so the transient memory stays a few buckets, not 4 P_r.
                while len(self._in_flight) > IN_FLIGHT:
                    self._in_flight.pop(0).finish_reduce()
        return hook

    def begin_step(self, num_micro_batches: int):
        pass

    def start_last_backward(self):
        """Arm the hooks: each bucket is reduce-scattered as soon as its gradients are final."""
        self._armed = True

    def finish(self):
        """Complete every reduce-scatter; the owned rows of every gradient are then final."""
        self._armed, self._in_flight = False, []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in self.buckets:
            if not bucket.launched:
                bucket.launch_reduce(bucket.group, self.reduce_dtype)
        for bucket in self.buckets:
            bucket.finish_reduce()
            bucket.ready, bucket.launched = 0, False
        # Owned rows are the same rows of the same shapes on every tp rank / embedding stage.
        comm.all_reduce_views([self.owned_grad(p) for p in self.sp_params], self.mesh.tp_group,
                              "tp/all_reduce")
        comm.all_reduce_views([self.owned_grad(p) for p in self.embedding_params],
                              self.mesh.embedding_group, "pp/embedding_all_reduce")
        for p, master in self.master.items():
            grad = self.owned_grad(p)
            master.grad = grad if self._is_view(p) else self.host_grads[p].copy_(grad)
        self._reduced = True

    def owned_grad(self, p) -> torch.Tensor:
        """The rows of p.grad this rank owns (reduced over dp x sp after finish()), a view."""
        return self.pieces[p].piece(p.grad, self.shard_of[p][2])

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient norm over the owned rows of every rank; clips them to max_norm."""
        owned = list(self.master)
        return clip_grad_norm(owned, max_norm, self.mesh, grads=[self.master[p].grad for p in owned],
                              shard_group=self.group, experts_sharded=True)

    # Optimizer interface ------------------------------------------------------------------------------

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None
        for master in self.master.values():
            master.grad = None
        self._reduced = False

    @torch.no_grad()
    def step(self):
        """AdamW on the owned rows, then every rank's updated rows all-gathered into the parameters."""
        if not self._reduced:
            raise RuntimeError("the distributed optimizer stepped before its finish(): it reduces "
                               "the gradients itself, pass it to the Trainer as sharding= too.")
        self.optimizer.step()
        self.sync_params_from_master()

    @torch.no_grad()
    def sync_params_from_master(self):
        for p, master in self.master.items():
            if not self._is_view(p):
                self._owned(p).copy_(master)
        pending = []
        for bucket in self.buckets:
            bucket.launch_gather()
            pending.append(bucket)
            if not self.overlap_param_gather:
                bucket.finish_gather()
                pending.clear()
        for bucket in pending:
            bucket.finish_gather()

    @torch.no_grad()
    def sync_master_from_params(self):
        """After the parameters were loaded (checkpoint): copy their owned rows into the masters."""
        for p, master in self.master.items():
            if not self._is_view(p):
                master.copy_(self._owned(p))

    # Checkpoints and memory -------------------------------------------------------------------------

    def checkpoint_state(self, chunks, tp_rank: int, tp_size: int, *, create: bool = False) -> dict:
        """The Adam moments of the owned rows under the unsharded DCP keys and full shapes.

        optim/<name>/exp_avg|exp_avg_sq: this rank's rows, a rectangle of the parameter's stored
        tensor at its offset; optim/<name>/step: the scalar (written by every owner, identical).
        `create`: make empty states to load into (and load into the live ones).
        """
        from megatron_sp.checkpointing import Shard, named_parameters, param_shard
        from megatron_sp.checkpointing.format import init_adam_state
        state = {}
        for name, p in named_parameters(chunks):
            base = param_shard(p, p.detach(), tp_rank, tp_size)
            if p not in self.master or base is None:
                continue
            pc, master = self.pieces[p], self.master[p]
            st = (init_adam_state(self.optimizer, master) if create
                  else self.optimizer.state.get(master, {}))
            lo, hi = pc.span(self.shard_of[p][2])
            rows = min(hi, base.local.shape[pc.dim]) - lo     # vocabulary padding rows are not stored
            if rows <= 0 or "exp_avg" not in st:
                continue
            offsets = list(base.offsets)
            offsets[pc.dim] += lo
            stored = [rows if d == pc.dim else n for d, n in enumerate(base.local.shape)]
            for key in ADAM_STATES:   # the owned rows in the stored geometry (expert w1: [r, 2, F, H])
                piece = st[key].narrow(pc.dim, 0, rows).view(stored)
                state[f"optim/{name}/{key}"] = Shard(piece, base.global_shape, torch.Size(offsets))
            state[f"optim/{name}/step"] = st["step"]
        return state

    def model_state_bytes(self, optimizer=None) -> dict:
        """This rank's model-state bytes (state_bytes.model_state_bytes; `optimizer` is this object,
        as the Trainer passes it): full parameters and gradients on the device; the Adam moments,
        the master rows that are copies (not views of the parameters) and their gradient rows on
        the host with --optimizer-cpu-offload, else on the device."""
        where = "host" if self.cpu_offload else "device"
        held = {"device": {"params": self.params, "grads": [p.grad for p in self.params]}, "host": {}}
        held[where]["optim"] = optimizer_tensors(self.optimizer) + [
            m for p, m in self.master.items() if not self._is_view(p)]
        held[where]["grads"] = held[where].get("grads", []) + list(self.host_grads.values())
        return model_state_bytes(self.device, **held)
