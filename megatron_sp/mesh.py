"""The unified device mesh: one object, built once from (tp, sp, dp, pp) and passed explicitly.

Rank order follows Megatron-LM (tp-cp-dp-pp, Ulysses in the cp slot), tp varying fastest so that
the heaviest traffic stays inside a node (DESIGN 3):

    rank = tp_rank + sp_rank*TP + dp_rank*TP*SP + pp_rank*TP*SP*DP,   world = TP*SP*DP*PP

`ParallelDims` is the pure rank arithmetic (no process group, unit-tested for every factorisation);
`ParallelMesh` builds the torch.distributed DeviceMesh and hands out the groups: tp, sp, dp, pp,
dp x sp (gradient reduction of replicated parameters) and the embedding group (first and last
pipeline stage, for tied embeddings). With one rank it needs no torch.distributed at all: every
group is None and every communication helper is then the identity.
"""
from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_sp.errors import UserError

# Mesh dimensions from slowest to fastest varying: DeviceMesh lays ranks out row-major, so this
# order gives exactly the rank formula above.
MESH_DIMS = ("pp", "dp", "sp", "tp")


class LayoutError(UserError, ValueError):
    """An impossible parallel layout, refused at start-up with the numbers."""


class RendezvousError(UserError, RuntimeError):
    """This rank cannot reach the rendezvous (each rank says so with its rank)."""
    same_on_every_rank = False


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the four parallel axes. dp=None is inferred from the world size."""

    world_size: int
    tp: int = 1
    sp: int = 1
    pp: int = 1
    dp: int | None = None

    def __post_init__(self):
        for name in ("world_size", "tp", "sp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}.")
        model_parallel = self.tp * self.sp * self.pp
        if self.world_size % model_parallel != 0:
            raise LayoutError(
                f"world size {self.world_size} is not divisible by tp*sp*pp = {model_parallel} "
                f"(tp={self.tp}, sp={self.sp}, pp={self.pp}): choose sizes whose product divides "
                f"the number of ranks.")
        inferred = self.world_size // model_parallel
        if self.dp is None:
            object.__setattr__(self, "dp", inferred)
        elif self.dp != inferred:
            raise LayoutError(
                f"tp*sp*dp*pp = {self.tp}*{self.sp}*{self.dp}*{self.pp} = {model_parallel * self.dp} "
                f"does not equal the world size {self.world_size}: leave dp out to infer it.")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Mesh shape in MESH_DIMS order (pp, dp, sp, tp)."""
        return (self.pp, self.dp, self.sp, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """{tp, sp, dp, pp} coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the world of {self.world_size} ranks.")
        tp_rank = rank % self.tp
        sp_rank = rank // self.tp % self.sp
        dp_rank = rank // (self.tp * self.sp) % self.dp
        pp_rank = rank // (self.tp * self.sp * self.dp)
        return {"tp": tp_rank, "sp": sp_rank, "dp": dp_rank, "pp": pp_rank}

    def rank_of(self, tp: int = 0, sp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Global rank of the given coordinates."""
        return tp + sp * self.tp + dp * self.tp * self.sp + pp * self.tp * self.sp * self.dp

    def group_ranks(self, axes: tuple[str, ...], rank: int) -> list[int]:
        """Global ranks of `rank`'s group along `axes` (e.g. ("dp", "sp")), in axis order."""
        base = self.coords(rank)
        sizes = {"tp": self.tp, "sp": self.sp, "dp": self.dp, "pp": self.pp}
        members = [dict(base)]
        for axis in axes:
            members = [dict(m, **{axis: i}) for m in members for i in range(sizes[axis])]
        return sorted(self.rank_of(**m) for m in members)

    def all_groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Every distinct group along `axes`, covering the world once."""
        seen, groups = set(), []
        for rank in range(self.world_size):
            ranks = tuple(self.group_ranks(axes, rank))
            if ranks not in seen:
                seen.add(ranks)
                groups.append(list(ranks))
        return groups

    def embedding_ranks(self, rank: int) -> list[int]:
        """First and last pipeline stage holding `rank`'s (tp, sp, dp) coordinates."""
        c = self.coords(rank)
        first = self.rank_of(c["tp"], c["sp"], c["dp"], 0)
        last = self.rank_of(c["tp"], c["sp"], c["dp"], self.pp - 1)
        return sorted({first, last})


class ParallelMesh:
    """Process groups of one layout. Build once per process, pass to whatever needs a group.

    `ParallelMesh.single()` is the one-rank mesh: sizes 1, groups None, no torch.distributed.
    """

    def __init__(self, dims: ParallelDims, rank: int = 0, device_type: str = "cpu"):
        self.dims = dims
        self.rank = rank
        self.device_type = device_type
        c = dims.coords(rank)
        self.tp_rank, self.sp_rank, self.dp_rank, self.pp_rank = c["tp"], c["sp"], c["dp"], c["pp"]
        self.device_mesh = self.dp_sp_mesh = None
        self.tp_group = self.sp_group = self.dp_group = self.pp_group = None
        self.dp_sp_group = self.embedding_group = None
        if dims.world_size > 1:
            self._build_groups()

    @classmethod
    def single(cls) -> "ParallelMesh":
        return cls(ParallelDims(world_size=1))

    @classmethod
    def from_sizes(cls, tp: int = 1, sp: int = 1, pp: int = 1, dp: int | None = None,
                   device_type: str | None = None) -> "ParallelMesh":
        """Build the mesh for the already initialised default process group (or one rank)."""
        if not (dist.is_available() and dist.is_initialized()):
            dims = ParallelDims(world_size=1, tp=tp, sp=sp, pp=pp, dp=dp)
            return cls(dims)
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        dims = ParallelDims(world_size=dist.get_world_size(), tp=tp, sp=sp, pp=pp, dp=dp)
        return cls(dims, rank=dist.get_rank(), device_type=device_type)

    def _build_groups(self):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device_type, self.dims.shape, mesh_dim_names=MESH_DIMS)
        self.device_mesh = mesh
        self.tp_group = mesh["tp"].get_group()
        self.sp_group = mesh["sp"].get_group()
        self.dp_group = mesh["dp"].get_group()
        self.pp_group = mesh["pp"].get_group()
        self.dp_sp_mesh = mesh["dp", "sp"]._flatten("dp_sp")   # 1-D: FSDP2 shards over it
        self.dp_sp_group = self.dp_sp_mesh.get_group()
        if self.dims.pp > 1:
            # new_group is collective: every rank creates every embedding group, keeps its own.
            mine = self.dims.embedding_ranks(self.rank)
            for ranks in self.dims.all_groups(("pp",)):
                pair = sorted({ranks[0], ranks[-1]})
                group = dist.new_group(pair)
                if pair == mine:
                    self.embedding_group = group

    # Sizes -----------------------------------------------------------------------------------
    tp_size = property(lambda self: self.dims.tp)
    sp_size = property(lambda self: self.dims.sp)
    dp_size = property(lambda self: self.dims.dp)
    pp_size = property(lambda self: self.dims.pp)
    world_size = property(lambda self: self.dims.world_size)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    def background_group(self):
        """A gloo group over the whole world for background work (asynchronous checkpoint
        writes), so its collectives never interleave with training's. Created on first use: every
        rank must ask at the same point (new_group is collective). None with one rank."""
        if self.dims.world_size == 1 or not dist.is_initialized():
            return None
        if getattr(self, "_background_group", None) is None:
            self._background_group = dist.new_group(backend="gloo")
        return self._background_group

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the given pipeline stage at this rank's (tp, sp, dp) coordinates."""
        return self.dims.rank_of(self.tp_rank, self.sp_rank, self.dp_rank, pp_rank)

    def __repr__(self):
        d = self.dims
        return (f"ParallelMesh(world={d.world_size}, tp={d.tp}, sp={d.sp}, dp={d.dp}, pp={d.pp}, "
                f"rank={self.rank} -> tp{self.tp_rank} sp{self.sp_rank} dp{self.dp_rank} "
                f"pp{self.pp_rank})")


# Process-group initialisation ------------------------------------------------------------------

def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM_JOB_NODELIST such as "gpu[003-005,010],cpu1" -> "gpu003"."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}.")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def distributed_env(environ=os.environ) -> dict | None:
    """rank / world_size / local_rank / master address from torchrun or, failing that, SLURM.

    Returns None when neither launcher's variables are present (a plain one-rank run).
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return {
            "rank": int(environ["RANK"]), "world_size": int(environ["WORLD_SIZE"]),
            "local_rank": int(environ.get("LOCAL_RANK", 0)),
            "master_addr": environ.get("MASTER_ADDR", "127.0.0.1"),
            "master_port": int(environ.get("MASTER_PORT", 29500)),
        }
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        nodelist = environ.get("SLURM_JOB_NODELIST", environ.get("SLURM_NODELIST", "127.0.0.1"))
        return {
            "rank": int(environ["SLURM_PROCID"]), "world_size": int(environ["SLURM_NTASKS"]),
            "local_rank": int(environ.get("SLURM_LOCALID", 0)),
            "master_addr": environ.get("MASTER_ADDR", first_slurm_host(nodelist)),
            "master_port": int(environ.get("MASTER_PORT", 29500)),
        }
    return None


def init_distributed(backend: str | None = None, timeout_minutes: float = 10.0) -> dict | None:
    """Initialise the default process group from torchrun's or SLURM's environment.

    nccl when CUDA is available (each process on its local GPU), gloo otherwise. Returns the
    environment dict, or None for a one-rank run with no launcher (no process group is created).
    """
    env = distributed_env()
    if env is None or (env["world_size"] == 1 and backend is None):
        return env
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(env["local_rank"] % torch.cuda.device_count())
    init_method = f"tcp://{env['master_addr']}:{env['master_port']}"
    try:
        dist.init_process_group(backend=backend, init_method=init_method, rank=env["rank"],
                                world_size=env["world_size"],
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    except Exception as err:  # a rendezvous that cannot be reached: name the address
        raise RendezvousError(
            f"rank {env['rank']} could not reach the rendezvous at {env['master_addr']}:"
            f"{env['master_port']} within {timeout_minutes} min ({type(err).__name__}: {err}); "
            f"check MASTER_ADDR/MASTER_PORT and that rank 0 is running.") from err
    return env


def barrier(mesh: "ParallelMesh | None" = None) -> None:
    """Wait for every rank (no-op without a process group)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier(**barrier_device())


def barrier_device() -> dict:
    """dist.barrier's device_ids under NCCL: this process's GPU (set by init_distributed), which
    torch would otherwise guess, with a warning on every run."""
    if dist.get_backend() == "nccl":
        return {"device_ids": [torch.cuda.current_device()]}
    return {}


def shutdown() -> None:
    """Barrier, then destroy every group: no rank tears down the store while another
    still uses it (a rank leaving first can crash a slower rank's gloo teardown). The process
    should then leave through megatron_sp.errors.exit_process (pretrain_gpt does): the
    interpreter's finalization can still race with gloo's threads and abort a finished run."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier(**barrier_device())
        dist.destroy_process_group()
