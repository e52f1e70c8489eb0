"""Rank arithmetic of the unified mesh, with no process group (DESIGN 3)."""
import itertools

import pytest

from megatron_sp.mesh import LayoutError, ParallelDims, distributed_env, first_slurm_host


def factorisations(world):
    for tp, sp, pp in itertools.product(range(1, world + 1), repeat=3):
        if world % (tp * sp * pp) == 0:
            yield tp, sp, pp, world // (tp * sp * pp)


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
