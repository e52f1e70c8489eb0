"""Rank arithmetic and layout rules of the unified mesh, with no process group (docs/design.md
§3, §4)."""
import itertools

import pytest

from megatron_sp.mesh import (LayoutError, ParallelDims, ParallelMesh, distributed_env,
                              first_slurm_host, group_rank, group_size, head_layout_problem,
                              sequence_layout_problem)


def factorisations(world):
    for tp, sp, pp in itertools.product(range(1, world + 1), repeat=3):
        if world % (tp * sp * pp) == 0:
            yield tp, sp, pp, world // (tp * sp * pp)


@pytest.mark.parametrize("world", [4, 8, 12, 16])
def test_every_factorisation_with_a_ring(world):
    """Five axes: Ulysses sp (adjacent ranks) x ring cp (stride tp*sp) in Megatron's cp slot."""
    for tp, sp, pp, rest in factorisations(world):
        for cp in (c for c in range(2, rest + 1) if rest % c == 0):
            dims = ParallelDims(world, tp=tp, sp=sp, pp=pp, cp=cp)
            dp = dims.dp
            assert dp == rest // cp and dims.context == sp * cp
            for rank in range(world):
                c = dims.coords(rank)
                assert rank == (c["tp"] + c["sp"] * tp + c["cp"] * tp * sp + c["dp"] * tp * sp * cp
                                + c["pp"] * tp * sp * cp * dp)
                assert dims.rank_of(**c) == rank
            for axes, size in ((("cp",), cp), (("dp", "cp", "sp"), dp * cp * sp)):
                groups = dims.all_groups(axes)
                assert all(len(g) == size for g in groups)
                assert sorted(r for g in groups for r in g) == list(range(world))
            # a ring's members are tp*sp ranks apart
            assert all(b - a == tp * sp for g in dims.all_groups(("cp",)) for a, b in zip(g, g[1:]))


def test_ring_sequence_rules():
    dims = ParallelDims(8, sp=2, cp=2, tp=2)
    assert dims.sequence_shards() == 4 and dims.sequence_shards(sequence_parallel=True) == 8
    dims.check_sequence(32, sequence_parallel=True)            # 2 x cp x sp x tp = 16 divides 32
    with pytest.raises(LayoutError, match=r"--seq-length 40 is not divisible by the sequence shards "
                                          r"\(2 x cp=2 x sp=2 x tp=2 = 16\).*zigzag.*multiple of "
                                          r"16, e.g. 32\."):
        dims.check_sequence(40, sequence_parallel=True)
    with pytest.raises(LayoutError, match=r"tp\*sp\*cp\*pp = 8"):
        ParallelDims(12, tp=2, sp=2, cp=2)


@pytest.mark.parametrize("world", range(1, 17))
def test_every_factorisation(world):
    count = 0
    for tp, sp, pp, dp in factorisations(world):
        dims = ParallelDims(world, tp=tp, sp=sp, pp=pp)
        assert dims.dp == dp
        seen = set()
        for rank in range(world):
            c = dims.coords(rank)
            # Megatron's order: tp fastest, then sp (cp slot), dp, pp.
            assert rank == c["tp"] + c["sp"] * tp + c["dp"] * tp * sp + c["pp"] * tp * sp * dp
            assert dims.rank_of(**c) == rank
            seen.add((c["tp"], c["sp"], c["dp"], c["pp"]))
        assert len(seen) == world
        for axes, size in ((("tp",), tp), (("sp",), sp), (("dp",), dp), (("pp",), pp),
                           (("dp", "sp"), dp * sp)):
            groups = dims.all_groups(axes)
            assert all(len(g) == size for g in groups)
            assert sorted(r for g in groups for r in g) == list(range(world))  # a partition
        # tp groups are contiguous ranks (stay inside a node)
        assert all(g == list(range(g[0], g[0] + tp)) for g in dims.all_groups(("tp",)))
        for rank in range(world):
            emb = dims.embedding_ranks(rank)
            assert rank in emb or not (dims.coords(rank)["pp"] in (0, pp - 1))
            assert len(emb) == (1 if pp == 1 else 2)
        count += 1
    assert count > 0


def test_bad_layouts_name_the_numbers():
    with pytest.raises(LayoutError, match=r"world size 6 is not divisible by tp\*sp\*pp = 4"):
        ParallelDims(6, tp=2, sp=2)
    with pytest.raises(LayoutError, match="does not equal the world size 8"):
        ParallelDims(8, tp=2, dp=2)
    with pytest.raises(LayoutError, match="tp must be a positive integer"):
        ParallelDims(8, tp=0)


@pytest.mark.parametrize("world,tp,sp,seqpar,shards", [
    (8, 1, 8, False, 8), (8, 1, 8, True, 8), (8, 2, 4, False, 4), (8, 2, 4, True, 8),
    (16, 4, 2, True, 8), (6, 3, 1, True, 3), (6, 3, 1, False, 1),
])
def test_sequence_shards(world, tp, sp, seqpar, shards):
    dims = ParallelDims(world, tp=tp, sp=sp)
    assert dims.sequence_shards(seqpar) == shards
    dims.check_sequence(shards * 1024, seqpar)
    dims.check_sequence(4 * shards, sequence_parallel=seqpar)


@pytest.mark.parametrize("world,tp,sp,seq,seqpar,message", [
    (8, 1, 8, 100, False, "--seq-length 100 is not divisible by the sequence shards (sp=8)."),
    (4, 2, 2, 102, True, "--seq-length 102 is not divisible by the sequence shards (sp=2 x tp=2)."),
    (8, 2, 4, 8196, True, "--seq-length 8196 is not divisible by the sequence shards (sp=4 x tp=2)."),
    (2, 1, 2, 7, True, "--seq-length 7 is not divisible by the sequence shards (sp=2 x tp=1)."),
])
def test_check_sequence_says_it_as_the_flag(world, tp, sp, seq, seqpar, message, monkeypatch):
    """pretrain_gpt.py's sentence, exactly (the CLI prints it after "error: ")."""
    dims = ParallelDims(world, tp=tp, sp=sp)
    with pytest.raises(LayoutError) as err:
        dims.check_sequence(seq, seqpar)
    assert str(err.value) == message and isinstance(err.value, ValueError)
    monkeypatch.setattr(ParallelMesh, "_build_groups", lambda self: None)   # no process group
    with pytest.raises(LayoutError) as err:
        ParallelMesh(dims).check_sequence(seq, seqpar)
    assert str(err.value) == message


def test_check_sequence_in_a_tensors_words():
    dims = ParallelDims(8, tp=2, sp=4)
    dims.check_sequence(4 * 3, what="sequence length")       # tp does not shard without seqpar
    with pytest.raises(LayoutError, match=r"^sequence length 10 is not divisible by sp = 4: each "
                                          r"rank must hold an equal contiguous chunk"):
        dims.check_sequence(10, what="sequence length")
    with pytest.raises(LayoutError, match=r"^sequence length 12 is not divisible by sp\*tp = 4\*2 = "
                                          r"8 \(Ulysses with tp sequence sharding\)"):
        dims.check_sequence(12, True, what="sequence length")
    assert sequence_layout_problem(16, sp=4, tp=2, sequence_parallel=True) is None
    assert sequence_layout_problem(12, sp=4, tp=2, sequence_parallel=False) is None


@pytest.mark.parametrize("tp,sp,h,g", [
    (1, 8, 8, 8), (1, 4, 8, 2), (1, 8, 8, 1), (2, 4, 32, 8), (4, 2, 32, 8), (8, 4, 32, 8),
    (2, 2, 16, 4), (1, 3, 12, 6), (1, 6, 12, 6), (1, 1, 7, 7),
])
def test_check_heads_accepts(tp, sp, h, g):
    ParallelDims(tp * sp * 2, tp=tp, sp=sp).check_heads(h, g)
    assert head_layout_problem(h, g, tp, sp) is None
    assert head_layout_problem(h, g, tp, sp, what="config") is None


@pytest.mark.parametrize("tp,sp,h,g,message", [
    (1, 8, 12, 12, "12 attention heads are not divisible by tp*sp = 1*8 = 8: Ulysses needs "
                   "num_heads % (tp*sp) == 0."),
    (4, 16, 32, 8, "32 attention heads are not divisible by tp*sp = 4*16 = 64: Ulysses needs "
                   "num_heads % (tp*sp) == 0."),
    (1, 2, 16, 6, "16 attention heads are not a multiple of 6 key/value heads (grouped-query "
                  "attention needs num_heads % num_kv_heads == 0)."),
    (4, 2, 16, 2, "2 key/value heads are not divisible by tp = 4: each tp rank must hold whole "
                  "key/value heads (num_kv_heads % tp == 0)."),
    (2, 4, 48, 12, "12 key/value heads over tp = 2 leave 6 per tp rank, which sp = 4 can neither "
                   "split (6 % 4 != 0) nor replicate (4 % 6 != 0): Ulysses needs "
                   "(num_kv_heads/tp) % sp == 0 or sp % (num_kv_heads/tp) == 0."),
])
def test_check_heads_refuses_naming_the_numbers(tp, sp, h, g, message):
    with pytest.raises(LayoutError) as err:
        ParallelDims(tp * sp, tp=tp, sp=sp).check_heads(h, g)
    assert str(err.value) == message and isinstance(err.value, ValueError)


@pytest.mark.parametrize("tp,sp,h,g,message", [
    (4, 2, 4, 2, "num_attention_heads=4 is not divisible by tp*sp=4*2=8: every tensor- and "
                 "sequence-parallel rank needs whole query heads."),
    (4, 1, 4, 2, "num_query_groups=2 is not divisible by tp=4: key/value heads are split over "
                 "tensor-parallel ranks and must stay whole."),
    (1, 2, 12, 3, "key/value heads per tp rank (3/1=3) and sp=2 do not fit Ulysses: one must "
                  "divide the other (split when a multiple of sp, replicate when fewer)."),
])
def test_head_rules_in_the_configs_words(tp, sp, h, g, message):
    """GPTConfig.check_parallel's sentences (the CLI prefixes them with the model flags)."""
    assert head_layout_problem(h, g, tp, sp, what="config") == message


def test_group_helpers_without_a_group():
    assert group_size(None) == 1 and group_rank(None) == 0
    from megatron_sp.tensor_parallel import mappings
    from megatron_sp.ulysses import comm
    assert mappings.group_size is comm.group_size is group_size       # one definition
    assert mappings.group_rank is group_rank


def test_slurm_and_torchrun_environments():
    assert first_slurm_host("gpu[003-005,010],cpu1") == "gpu003"
    assert first_slurm_host("node7") == "node7"
    assert first_slurm_host("a-b[1,4]") == "a-b1"
    env = distributed_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                           "SLURM_JOB_NODELIST": "n[12-13]"})
    assert env == {"rank": 3, "world_size": 8, "local_rank": 1, "master_addr": "n12",
                   "master_port": 29500}
    env = distributed_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h",
                           "MASTER_PORT": "1234", "SLURM_PROCID": "9", "SLURM_NTASKS": "16"})
    assert env["rank"] == 1 and env["master_port"] == 1234   # torchrun wins over SLURM
    assert distributed_env({}) is None


def test_barrier_names_the_gpu_under_nccl(monkeypatch):
    """Under NCCL every barrier passes this process's GPU (torch would guess it and warn, as it did
    on the H200 run); gloo barriers take no device."""
    import torch
    import torch.distributed as dist
    from megatron_sp import mesh
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for backend, expected in (("nccl", {"device_ids": [3]}), ("gloo", {})):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        mesh.barrier()
        assert calls.pop() == expected


def test_from_sizes_alone_says_how_to_launch(monkeypatch):
    """A layout of several ranks asked for in a process with no process group and no launcher's
    environment: one sentence naming the torchrun command and init_process_group (issue 35);
    the one-rank layout is the one-rank mesh, with no torch.distributed call."""
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LayoutError) as err:
        ParallelMesh.from_sizes(sp=2, cp=2)
    text = str(err.value)
    assert "needs 4 ranks" in text and "torchrun --nproc-per-node 4" in text, text
    assert "torch.distributed.init_process_group" in text and "\n" not in text, text
    mesh = ParallelMesh.from_sizes()
    assert mesh.world_size == 1 and mesh.sp_group is None and mesh.context_group() is None


def test_from_sizes_starts_the_process_group_from_the_launchers_environment(monkeypatch):
    """Under a launcher (RANK / WORLD_SIZE set, more than one rank) with no process group yet,
    from_sizes initialises it from that environment (init_distributed) before building the mesh;
    a one-rank launch (WORLD_SIZE 1) stays without torch.distributed."""
    import megatron_sp.mesh as mesh_module
    calls = []
    monkeypatch.setattr(mesh_module, "init_distributed", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(mesh_module.dist, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(mesh_module.dist, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(mesh_module.dist, "get_rank", lambda *a: 3)
    monkeypatch.setattr(mesh_module.dist, "get_backend", lambda *a: "gloo")
    monkeypatch.setattr(ParallelMesh, "_build_groups", lambda self: None)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    mesh = ParallelMesh.from_sizes(sp=2, cp=2)
    assert calls == [()] and mesh.rank == 3 and (mesh.sp_rank, mesh.cp_rank) == (1, 1)
    calls.clear()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert ParallelMesh.from_sizes().world_size == 1 and calls == []
