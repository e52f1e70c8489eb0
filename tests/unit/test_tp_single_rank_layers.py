"""Tensor-parallel layers on one rank (no process group): they must equal the plain torch layers,
and the layout helpers must round-trip the sharding for every tp size. Tolerances: fp32, 1e-6."""
import pytest
import torch
from torch import nn

from megatron_sp.mesh import ParallelMesh
from megatron_sp.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, all_reduce_grads,
    check_divisible, copy_to_tensor_parallel_region, full_shape,
    gather_from_sequence_parallel_region, gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region, set_tp_attributes,
    shard_of_full)

MESH = ParallelMesh.single()


def _load(layer, twin):
    """Copy the twin's full weights into the one-rank layer via shard_of_full."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(shard_of_full(getattr(twin, name), p, 0, 1))


@pytest.mark.parametrize("cls,kwargs", [
    (ColumnParallelLinear, {}), (ColumnParallelLinear, {"gather_output": True, "chunks": 2}),
    (ColumnParallelLinear, {"sequence_parallel": True, "bias": False}),
    (RowParallelLinear, {}), (RowParallelLinear, {"input_is_parallel": False}),
    (RowParallelLinear, {"sequence_parallel": True}),
])
def test_linear_layers_equal_nn_linear_on_one_rank(cls, kwargs):
    torch.manual_seed(0)
    bias = kwargs.get("bias", True)
    twin = nn.Linear(12, 8, bias=bias)
    layer = cls(12, 8, mesh=MESH, **kwargs)
    _load(layer, twin)
    x = torch.randn(2, 5, 12, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, ref = layer(x), twin(x_ref)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad, twin.weight.grad, rtol=1e-6, atol=1e-6)
    if bias:
        torch.testing.assert_close(layer.bias.grad, twin.bias.grad, rtol=1e-6, atol=1e-6)


def test_embedding_equals_nn_embedding_on_one_rank():
    torch.manual_seed(1)
    twin = nn.Embedding(24, 6)
    layer = VocabParallelEmbedding(24, 6, mesh=MESH, sequence_parallel=True)
    _load(layer, twin)
    ids = torch.randint(0, 24, (3, 7))
    out, ref = layer(ids), twin(ids)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(layer.weight.grad, twin.weight.grad)


def test_parameters_carry_their_layout():
    col = ColumnParallelLinear(4, 6, mesh=MESH, chunks=2)
    row = RowParallelLinear(6, 4, mesh=MESH, sequence_parallel=True)
    emb = VocabParallelEmbedding(10, 4, mesh=MESH)
    assert (col.weight.tp_partition_dim, col.weight.tp_chunks) == (0, 2)
    assert (col.bias.tp_partition_dim, col.bias.tp_chunks) == (0, 2)
    assert (row.weight.tp_partition_dim, row.weight.tp_chunks) == (1, 1)
    assert row.bias.tp_partition_dim is None and row.bias.sequence_parallel is True
    assert emb.weight.tp_partition_dim == 0
    for p in [*col.parameters(), *row.parameters(), *emb.parameters()]:
        assert isinstance(p, nn.Parameter) and torch.count_nonzero(p) == 0


def test_shard_of_full_and_full_shape_with_chunks():
    tp = 4
    gate, up = torch.arange(16.).view(8, 2), 100 + torch.arange(16.).view(8, 2)  # [8, 2] each
    full = torch.cat([gate, up])                                                  # [16, 2]
    shards = []
    for r in range(tp):
        p = set_tp_attributes(torch.empty(4, 2), 0, chunks=2)
        assert full_shape(p, tp) == torch.Size([16, 2])
        shard = shard_of_full(full, p, r, tp)
        # Megatron's fused layout: this rank's gate rows then its up rows.
        torch.testing.assert_close(shard, torch.cat([gate[2 * r:2 * r + 2], up[2 * r:2 * r + 2]]))
        g_local, u_local = shard.chunk(2)
        torch.testing.assert_close(g_local, gate.chunk(tp)[r])
        torch.testing.assert_close(u_local, up.chunk(tp)[r])
        shards.append(shard)
    assert sorted(torch.cat(shards).flatten().tolist()) == sorted(full.flatten().tolist())
    col_dim1 = set_tp_attributes(torch.empty(3, 2), 1)
    assert full_shape(col_dim1, 4) == torch.Size([3, 8])
    torch.testing.assert_close(shard_of_full(torch.arange(24.).view(3, 8), col_dim1, 2, 4),
                               torch.arange(24.).view(3, 8)[:, 4:6])
    replicated = set_tp_attributes(torch.empty(5), None)
    assert full_shape(replicated, 8) == torch.Size([5])
    with pytest.raises(ValueError, match="does not match the full shape"):
        shard_of_full(torch.zeros(15, 2), set_tp_attributes(torch.empty(4, 2), 0, 2), 0, 4)


def test_bad_sizes_raise_clear_errors():
    with pytest.raises(ValueError, match=r"\(7\) is not divisible by 3"):
        check_divisible(7, 3, "the thing")
    with pytest.raises(ValueError, match=r"out_features of ColumnParallelLinear \(9\) is not "
                                         r"divisible by chunks\*tp = 2\*1 = 2"):
        ColumnParallelLinear(4, 9, mesh=MESH, chunks=2)
    with pytest.raises(ValueError, match="input_is_parallel"):
        RowParallelLinear(4, 4, mesh=MESH, input_is_parallel=False, sequence_parallel=True)


def test_mappings_are_identity_without_a_group():
    x = torch.randn(2, 4, 6, requires_grad=True)
    for fn in (copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region,
               scatter_to_tensor_parallel_region, gather_from_tensor_parallel_region,
               scatter_to_sequence_parallel_region, gather_from_sequence_parallel_region,
               reduce_scatter_to_sequence_parallel_region):
        assert fn(x, None) is x
    g = torch.ones(3)
    all_reduce_grads([g, None], None)
    torch.testing.assert_close(g, torch.ones(3))
