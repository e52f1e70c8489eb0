"""The unified device mesh: one object, built once from (tp, sp, cp, dp, pp) and passed explicitly.

Rank order follows Megatron-LM (tp-cp-dp-pp), tp varying fastest so that the heaviest traffic stays
inside a node; Megatron's cp slot holds Ulysses sp (adjacent ranks) times the ring cp of context
parallelism (stride TP*SP; docs/design.md §3, §14):

    rank = tp_rank + sp_rank*TP + cp_rank*TP*SP + dp_rank*TP*SP*CP + pp_rank*TP*SP*CP*DP,
    world = TP*SP*CP*DP*PP        (cp = 1, no ring: the four-axis layout)

`ParallelDims` is the pure rank arithmetic (no process group, unit-tested for every factorisation)
and the one home of the layout rules: heads over tp and Ulysses sp, the sequence over its shards
(docs/design.md §4: `check_heads`, `check_sequence`; `head_layout_problem` and
`sequence_layout_problem` are the same rules for callers that know only (tp, sp)). `ParallelMesh`
builds the torch.distributed DeviceMesh and hands out the groups: tp, sp, cp, dp, pp,
dp x cp x sp (`dp_sp_group`: gradient reduction of replicated parameters) and the embedding group
(first and last pipeline stage, for tied embeddings). With one rank it needs no torch.distributed at all: every group is
None and every communication helper is then the identity (`group_size`, `group_rank`).
"""
from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_sp import rendezvous
from megatron_sp.errors import UserError
from megatron_sp.rendezvous import RendezvousError  # noqa: F401  (re-exported; its home)

# Mesh dimensions from slowest to fastest varying: DeviceMesh lays ranks out row-major, so this
# order gives exactly the rank formula above. Megatron's cp slot holds Ulysses (sp, adjacent ranks)
# times the ring of context parallelism (cp, stride TP*SP): c = sp x cp.
MESH_DIMS = ("pp", "dp", "cp", "sp", "tp")


class LayoutError(UserError, ValueError):
    """An impossible parallel layout, refused at start-up with the numbers."""


# Layout rules (docs/design.md §4) -------------------------------------------------------------
# Pure functions of the sizes, so that callers without a world size (GPTConfig.check_parallel with
# (tp, sp, pp), UlyssesAttention with per-tp-rank head counts) share them. Each returns the sentence
# that names the broken rule, or None; callers raise it as their error type.

def sequence_shards(sp: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """Ranks one sequence is split over: sp (Ulysses), times tp under Megatron's tp sequence
    sharding (--sequence-parallel: the non-tp regions hold [b, s/(sp*tp), H])."""
    return sp * tp if sequence_parallel else sp


def _broken_head_rule(h: int, g: int, tp: int, sp: int) -> str | None:
    """The first head rule that h query and g key/value heads break under (tp, sp), or None:
    "heads" h % (tp*sp); "groups" h % g (grouped-query attention); "kv_tp" g % tp; "kv_sp" g/tp
    per tp rank neither split by sp ((g/tp) % sp) nor replicated sp/(g/tp) times (sp % (g/tp))."""
    if h % (tp * sp):
        return "heads"
    if g < 1 or h % g:
        return "groups"
    if g % tp:
        return "kv_tp"
    g_local = g // tp
    if g_local % sp and sp % g_local:
        return "kv_sp"
    return None


def _heads_sentence(rule: str, h: int, g: int, tp: int, sp: int) -> str:
    """The broken rule in head counts (UlyssesAttention, check_ulysses_layout)."""
    g_local = g // tp
    return {
        "heads": f"{h} attention heads are not divisible by tp*sp = {tp}*{sp} = {tp * sp}: Ulysses "
                 f"needs num_heads % (tp*sp) == 0.",
        "groups": f"{h} attention heads are not a multiple of {g} key/value heads "
                  f"(grouped-query attention needs num_heads % num_kv_heads == 0).",
        "kv_tp": f"{g} key/value heads are not divisible by tp = {tp}: each tp rank must "
                 f"hold whole key/value heads (num_kv_heads % tp == 0).",
        "kv_sp": f"{g} key/value heads over tp = {tp} leave {g_local} per tp rank, which sp = {sp} "
                 f"can neither split ({g_local} % {sp} != 0) nor replicate ({sp} % {g_local} "
                 f"!= 0): Ulysses needs (num_kv_heads/tp) % sp == 0 or sp % (num_kv_heads/tp) == 0.",
    }[rule]


def _config_sentence(rule: str, h: int, g: int, tp: int, sp: int) -> str:
    """The broken rule in GPTConfig's field names (GPTConfig.check_parallel, the model flags)."""
    g_local = g // tp
    return {
        "heads": f"num_attention_heads={h} is not divisible by tp*sp={tp}*{sp}={tp * sp}: "
                 f"every tensor- and sequence-parallel rank needs whole query heads.",
        "groups": f"num_attention_heads={h} is not divisible by num_query_groups={g}: each "
                  f"key/value head must serve a whole group of query heads.",
        "kv_tp": f"num_query_groups={g} is not divisible by tp={tp}: key/value heads are "
                 f"split over tensor-parallel ranks and must stay whole.",
        "kv_sp": f"key/value heads per tp rank ({g}/{tp}={g_local}) and sp={sp} do not fit "
                 f"Ulysses: one must divide the other (split when a multiple of sp, replicate when "
                 f"fewer).",
    }[rule]


HEAD_WORDINGS = {"heads": _heads_sentence, "config": _config_sentence}


def head_layout_problem(num_heads: int, num_kv_heads: int, tp: int = 1, sp: int = 1, *,
                        what: str = "heads") -> str | None:
    """Why tp x Ulysses sp cannot split h query and g key/value heads, or None when they can.

    Rules (docs/design.md §4): h % (tp*sp) == 0; h % g == 0 and g % tp == 0; with g_l = g/tp per tp
    rank, either g_l % sp == 0 (split like the query heads) or sp % g_l == 0 (each key/value head
    replicated sp/g_l times before the seq->head all-to-all). what: "heads" names the head counts,
    "config" GPTConfig's fields (num_attention_heads, num_query_groups).
    """
    rule = _broken_head_rule(num_heads, num_kv_heads, tp, sp)
    return None if rule is None else HEAD_WORDINGS[what](rule, num_heads, num_kv_heads, tp, sp)


def sequence_layout_problem(seq_length: int, sp: int, tp: int = 1, sequence_parallel: bool = False,
                            *, what: str = "--seq-length", cp: int = 1) -> str | None:
    """Why a sequence of seq_length tokens does not split into equal contiguous chunks over its
    shards (sequence_shards: sp, or sp*tp with --sequence-parallel; with a ring of cp > 1 ranks
    first 2*cp zigzag chunks, docs/design.md §14), or None when it does.

    what: "--seq-length" says it as the flag (pretrain_gpt.py: "... not divisible by the sequence
    shards (sp=2 x tp=2)."); any other name (e.g. "sequence length", for a tensor) says it with the
    arithmetic ("sequence length 40 is not divisible by sp*tp = 8*3 = 24 ...").
    """
    shards = sequence_shards(sp, tp, sequence_parallel) * (2 * cp if cp > 1 else 1)
    if seq_length % shards == 0:
        return None
    if cp > 1:
        fit = max(shards, seq_length // shards * shards)
        named = f"2 x cp={cp} x sp={sp}" + (f" x tp={tp}" if sequence_parallel else "")
        return (f"{what} {seq_length} is not divisible by the sequence shards ({named} = {shards}): "
                f"the ring's zigzag layout cuts the sequence into 2*cp chunks, each split over the "
                f"rest; use a multiple of {shards}, e.g. {fit}.")
    if what == "--seq-length":
        named = f"sp={sp}" + (f" x tp={tp}" if sequence_parallel else "")
        return f"--seq-length {seq_length} is not divisible by the sequence shards ({named})."
    how = (f"sp*tp = {sp}*{tp} = {shards} (Ulysses with tp sequence sharding)" if sequence_parallel
           else f"sp = {sp}")
    return (f"{what} {seq_length} is not divisible by {how}: each rank must hold an equal "
            f"contiguous chunk of the sequence.")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel axes: tp, sp (Ulysses), cp (the ring of context parallelism), pp and
    dp. dp=None is inferred from the world size. The context of one sequence is split over sp x cp
    ranks; cp = 1 (no ring) is the four-axis layout."""

    world_size: int
    tp: int = 1
    sp: int = 1
    pp: int = 1
    dp: int | None = None
    cp: int = 1

    def __post_init__(self):
        for name in ("world_size", "tp", "sp", "pp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}.")
        model_parallel = self.tp * self.sp * self.cp * self.pp
        ring = "*cp" if self.cp > 1 else ""
        if self.world_size % model_parallel != 0:
            sizes = f"tp={self.tp}, sp={self.sp}" + (f", cp={self.cp}" if self.cp > 1 else "")
            raise LayoutError(
                f"world size {self.world_size} is not divisible by tp*sp{ring}*pp = {model_parallel} "
                f"({sizes}, pp={self.pp}): choose sizes whose product divides the number of ranks.")
        inferred = self.world_size // model_parallel
        if self.dp is None:
            object.__setattr__(self, "dp", inferred)
        elif self.dp != inferred:
            cp = f"*{self.cp}" if self.cp > 1 else ""
            raise LayoutError(
                f"tp*sp{ring}*dp*pp = {self.tp}*{self.sp}{cp}*{self.dp}*{self.pp} = "
                f"{model_parallel * self.dp} does not equal the world size {self.world_size}: "
                f"leave dp out to infer it.")

    @property
    def context(self) -> int:
        """Ranks one sequence's context is split over: Ulysses sp times the ring cp."""
        return self.sp * self.cp

    # Layout rules (docs/design.md §4) ------------------------------------------------------------
    def sequence_shards(self, sequence_parallel: bool = False) -> int:
        """Ranks one sequence is split over: sp*cp, times tp with Megatron's tp sequence sharding."""
        return sequence_shards(self.sp, self.tp, sequence_parallel) * self.cp

    def check_heads(self, num_heads: int, num_kv_heads: int, what: str = "heads") -> None:
        """Refuse (LayoutError) head counts this tp x Ulysses sp cannot split (see
        head_layout_problem)."""
        problem = head_layout_problem(num_heads, num_kv_heads, self.tp, self.sp, what=what)
        if problem:
            raise LayoutError(problem)

    def check_sequence(self, seq_length: int, sequence_parallel: bool = False,
                       what: str = "--seq-length") -> None:
        """Refuse (LayoutError) a sequence length its shards do not divide, by default in the
        flag's words: "--seq-length 100 is not divisible by the sequence shards (sp=8)."."""
        problem = sequence_layout_problem(seq_length, self.sp, self.tp, sequence_parallel,
                                          what=what, cp=self.cp)
        if problem:
            raise LayoutError(problem)

    # Rank arithmetic (docs/design.md §3) ---------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in MESH_DIMS order (pp, dp, cp, sp, tp)."""
        return (self.pp, self.dp, self.cp, self.sp, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """{tp, sp, cp, dp, pp} coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the world of {self.world_size} ranks.")
        coords, rest = {}, rank
        for axis in reversed(MESH_DIMS):                 # tp fastest, pp slowest
            size = getattr(self, axis)
            coords[axis], rest = rest % size, rest // size
        return coords

    def rank_of(self, tp: int = 0, sp: int = 0, dp: int = 0, pp: int = 0, cp: int = 0) -> int:
        """Global rank of the given coordinates."""
        coords, rank, stride = {"tp": tp, "sp": sp, "cp": cp, "dp": dp, "pp": pp}, 0, 1
        for axis in reversed(MESH_DIMS):
            rank += coords[axis] * stride
            stride *= getattr(self, axis)
        return rank

    def group_ranks(self, axes: tuple[str, ...], rank: int) -> list[int]:
        """Global ranks of `rank`'s group along `axes` (e.g. ("dp", "sp")), in axis order."""
        base = self.coords(rank)
        sizes = {"tp": self.tp, "sp": self.sp, "cp": self.cp, "dp": self.dp, "pp": self.pp}
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

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage: dp*cp*sp*tp (rank = f + pp_rank*N, f the stage index,
        in (dp, cp, sp, tp) order with tp fastest)."""
        return self.dp * self.cp * self.sp * self.tp

    def check_expert_parallel(self, ep: int, etp: int = 1) -> None:
        """Refuse (LayoutError) an expert-parallel size that is not a divisor of the stage's
        dp*cp*sp*tp ranks (with expert tensor parallelism etp = tp: of its dp*cp*sp ranks)."""
        n = self.stage_ranks
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise LayoutError(f"--expert-model-parallel-size must be a positive integer, got {ep!r}.")
        if etp not in (1, self.tp):
            raise LayoutError(f"--expert-tensor-parallel-size {etp} must be 1 or "
                              f"--tensor-model-parallel-size {self.tp}: other expert "
                              f"tensor-parallel sizes are not implemented yet.")
        if etp > 1 and (n // etp) % ep:
            raise LayoutError(f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size "
                              f"{etp} does not divide the {n} ranks of a pipeline stage "
                              f"(dp*cp*sp*tp = {self.dp}*{self.cp}*{self.sp}*{self.tp}); choose an "
                              f"ep that divides dp*cp*sp = {n // etp}, or "
                              f"--expert-tensor-parallel-size 1 (whole experts, ep folded over "
                              f"tp too; tp is the default, as in Megatron-LM).")
        if n % ep:
            raise LayoutError(f"--expert-model-parallel-size {ep} does not divide the {n} ranks "
                              f"of a pipeline stage (dp*cp*sp*tp = {self.dp}*{self.cp}*{self.sp}*"
                              f"{self.tp}); choose a divisor of {n}.")

    def expert_ranks(self, ep: int, rank: int, etp: int = 1) -> tuple[list[int], list[int]]:
        """(ep group, edp group) global ranks of `rank` under --expert-model-parallel-size ep.
        With N = dp*cp*sp*tp ranks per stage, rank = f + pp_rank*N and f = t + etp*g (t the rank's
        index in its expert tensor-parallel group, the tp group when etp = tp; g its index among
        the N/etp groups): the ep group is the block of ep consecutive g with the same t, the edp
        group the stage's ranks with the same t and g % ep. etp 1 (Megatron's parallel folding):
        the block of ep consecutive f, and the ranks with the same f % ep."""
        n = self.stage_ranks
        stage, f = divmod(rank, n)
        t, g = f % etp, f // etp
        base = g // ep * ep
        return ([stage * n + etp * j + t for j in range(base, base + ep)],
                [stage * n + etp * (j * ep + g % ep) + t for j in range(n // (ep * etp))])

    def embedding_ranks(self, rank: int) -> list[int]:
        """First and last pipeline stage holding `rank`'s (tp, sp, cp, dp) coordinates."""
        c = dict(self.coords(rank))
        first = self.rank_of(**dict(c, pp=0))
        last = self.rank_of(**dict(c, pp=self.pp - 1))
        return sorted({first, last})


@dataclass
class ExpertGroups:
    """The expert-parallel layout of one rank (ParallelMesh.expert_groups): its index in the ep
    group (which experts it holds) and the edp group (its replicas, over which expert gradients are
    reduced); a group is None where it has one rank."""

    ep: int
    ep_rank: int
    edp: int
    edp_rank: int
    etp: int = 1                 # expert tensor parallelism: 1 or tp (the experts' ffn split)
    ep_group: object = None
    edp_group: object = None
    device_mesh: object = None


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
        self.cp_rank = c["cp"]
        self.device_mesh = self.dp_sp_mesh = None
        self.tp_group = self.sp_group = self.dp_group = self.pp_group = self.cp_group = None
        self.dp_sp_group = self.embedding_group = None
        if dims.world_size > 1:
            self._build_groups()

    @classmethod
    def single(cls) -> "ParallelMesh":
        return cls(ParallelDims(world_size=1))

    @classmethod
    def from_sizes(cls, tp: int = 1, sp: int = 1, pp: int = 1, dp: int | None = None,
                   device_type: str | None = None, cp: int = 1) -> "ParallelMesh":
        """Build the mesh for the default process group. None initialised yet: under a launcher
        (torchrun, accelerate launch, srun: RANK / WORLD_SIZE or SLURM_PROCID / SLURM_NTASKS set,
        more than one rank) it is initialised here from that environment (`init_distributed`:
        nccl with CUDA, gloo without), so a plain loop needs no init_process_group of its own;
        without one, the one-rank mesh."""
        if not (dist.is_available() and dist.is_initialized()):
            env = distributed_env()
            if env is not None and env["world_size"] > 1:
                init_distributed()
                return cls.from_sizes(tp=tp, sp=sp, pp=pp, dp=dp, device_type=device_type, cp=cp)
            if tp * sp * pp * cp > 1:
                raise LayoutError(
                    f"ParallelMesh.from_sizes(tp={tp}, sp={sp}, cp={cp}, pp={pp}) needs "
                    f"{tp * sp * cp * pp} ranks, but this process is alone: no process group is "
                    f"initialised and no launcher's RANK / WORLD_SIZE is set; launch it with "
                    f"torchrun --nproc-per-node {tp * sp * cp * pp} (or accelerate launch, srun), "
                    f"or call torch.distributed.init_process_group first.")
            dims = ParallelDims(world_size=1, tp=tp, sp=sp, pp=pp, dp=dp, cp=cp)
            return cls(dims)
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        dims = ParallelDims(world_size=dist.get_world_size(), tp=tp, sp=sp, pp=pp, dp=dp, cp=cp)
        return cls(dims, rank=dist.get_rank(), device_type=device_type)

    def _build_groups(self):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device_type, self.dims.shape, mesh_dim_names=MESH_DIMS)
        self.device_mesh = mesh
        self.tp_group = mesh["tp"].get_group()
        self.sp_group = mesh["sp"].get_group()
        self.dp_group = mesh["dp"].get_group()
        self.pp_group = mesh["pp"].get_group()
        self.cp_group = mesh["cp"].get_group()
        # 1-D dp x (the whole context: cp x sp): replicated parameters' gradients are reduced and
        # FSDP2 / the distributed optimizer shard over it (the name predates the ring).
        self.dp_sp_mesh = mesh["dp", "cp", "sp"]._flatten("dp_sp")
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
    cp_size = property(lambda self: self.dims.cp)
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

    def context_group(self):
        """The sp x cp ranks that share one sequence as ONE group (sp_group when cp = 1, cp_group
        when sp = 1), so that a reduction over the whole context is one collective. Flattened
        from the DeviceMesh on first use: every rank must ask at the same point (collective)."""
        if self.dims.sp == 1 or self.dims.cp == 1:
            return self.cp_group if self.dims.sp == 1 else self.sp_group
        if getattr(self, "_context_group", None) is None:
            self._context_group = self.device_mesh["cp", "sp"]._flatten("context").get_group()
        return self._context_group

    def token_group(self):
        """The cp x sp x tp ranks that hold parts of the same sequences under --sequence-parallel
        (each tp rank its own s/(sp*tp) slice), as ONE group: the MoE router losses' statistics
        are summed over it. context_group() when tp = 1, tp_group when sp = cp = 1; otherwise
        flattened from the DeviceMesh on first use (collective: every rank asks at the same
        point)."""
        if self.dims.tp == 1:
            return self.context_group()
        if self.dims.sp * self.dims.cp == 1:
            return self.tp_group
        if getattr(self, "_token_group", None) is None:
            self._token_group = self.device_mesh["cp", "sp", "tp"]._flatten("tokens").get_group()
        return self._token_group

    def expert_groups(self, ep: int, etp: int = 1) -> "ExpertGroups":
        """The expert-parallel groups of --expert-model-parallel-size `ep` with expert tensor
        parallelism `etp` (1 or tp). With N = dp*cp*sp*tp ranks per stage and f this rank's
        (dp, cp, sp, tp) flat index (rank = f + pp_rank*N, f = t + etp*g):
        - etp 1 (Megatron's parallel folding): the ep group is the block of `ep` consecutive f
          holding this rank (so tp, Ulysses and ring ranks, which hold different tokens under
          --sequence-parallel, hold different experts; tp ranks first) and the
          expert-data-parallel (edp) group the ranks of the stage with the same f % ep;
        - etp = tp: every tp rank holds its ffn slice of the same experts, so the ep group is the
          block of `ep` consecutive g with the same tp rank t, the edp group the ranks with the
          same t and g % ep (Megatron's default layout; tokens are all-gathered over tp first).
        Built once per (ep, etp) from a DeviceMesh over arange(world).view(pp, N/(ep*etp), ep,
        etp) named ("pp", "edp", "ep", "etp"), then cached: every rank must ask at the same point
        (collective)."""
        cache = self.__dict__.setdefault("_expert_groups", {})
        if (ep, etp) in cache:
            return cache[(ep, etp)]
        self.dims.check_expert_parallel(ep, etp)
        n = self.dims.stage_ranks
        f = self.rank % n if self.dims.world_size > 1 else 0
        g = f // etp
        edp = n // (ep * etp)
        groups = ExpertGroups(ep=ep, ep_rank=g % ep, edp=edp, edp_rank=g // ep, etp=etp)
        if ep > 1 or (self.dims.world_size > 1 and edp > 1):
            from torch.distributed.device_mesh import DeviceMesh
            mesh = DeviceMesh(self.device_type,
                              # [world] -> [pp, N/(ep*etp), ep, etp]: rank = f + pp_rank*N,
                              # f = (edp_rank*ep + ep_rank)*etp + t
                              torch.arange(self.dims.world_size).view(self.dims.pp, edp, ep, etp),
                              mesh_dim_names=("pp", "edp", "ep", "etp"))
            groups.device_mesh = mesh
            groups.ep_group = mesh.get_group("ep") if ep > 1 else None
            groups.edp_group = mesh.get_group("edp") if edp > 1 else None
        cache[(ep, etp)] = groups
        return groups

    def check_sequence(self, seq_length: int, sequence_parallel: bool = False,
                       what: str = "--seq-length") -> None:
        """ParallelDims.check_sequence of this mesh's layout."""
        self.dims.check_sequence(seq_length, sequence_parallel, what)

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the given pipeline stage at this rank's (tp, sp, cp, dp) coordinates."""
        return self.dims.rank_of(self.tp_rank, self.sp_rank, self.dp_rank, pp_rank, self.cp_rank)

    @property
    def sequence_chunk(self) -> int:
        """This rank's index among the sp x cp ranks that share one sequence (RNG streams)."""
        return self.cp_rank * self.dims.sp + self.sp_rank

    def __repr__(self):
        d = self.dims
        cp, cp_rank = (f", cp={d.cp}", f" cp{self.cp_rank}") if d.cp > 1 else ("", "")
        return (f"ParallelMesh(world={d.world_size}, tp={d.tp}, sp={d.sp}{cp}, dp={d.dp}, pp={d.pp}, "
                f"rank={self.rank} -> tp{self.tp_rank} sp{self.sp_rank}{cp_rank} dp{self.dp_rank} "
                f"pp{self.pp_rank})")


# Group helpers ---------------------------------------------------------------------------------

def group_size(group) -> int:
    """Number of ranks in `group`; 1 for None (no torch.distributed call then)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index in `group`; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


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
    The store is this job's, met within the timeout on every rank (megatron_sp/rendezvous.py:
    RendezvousError naming the address, or refusing another job's store).
    """
    env = distributed_env()
    if env is None or (env["world_size"] == 1 and backend is None):
        return env
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(env["local_rank"] % torch.cuda.device_count())
    store = rendezvous.connect(env, timeout_minutes, wait_for_ranks=True)
    try:
        dist.init_process_group(backend=backend, store=store, rank=env["rank"],
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
    should then leave through megatron_sp.reporting.exit_process (pretrain_gpt does): the
    interpreter's finalization can still race with gloo's threads and abort a finished run."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier(**barrier_device())
        dist.destroy_process_group()
