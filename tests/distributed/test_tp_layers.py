"""Tensor-parallel layers on 4 gloo ranks against their unsharded twins, at tp=4 and tp=2 (dp=2).

One spawn for everything: each rank computes named errors and facts (no assertion between
collectives, so a wrong value never leaves the ranks out of step), the parent asserts on them.
Every rank draws the same full tensors from the same seed and takes its shard. Tolerances (fp32):
forward 1e-5, gradients gathered back to full shape 1e-4.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_sp import comm_stats
from megatron_sp.mesh import ParallelMesh
from megatron_sp.tensor_parallel import (
    ColumnParallelLinear, RNGTracker, RowParallelLinear, VocabParallelEmbedding, all_reduce_grads,
    copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region, gather_full_like,
    reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region, shard_of_full,
    vocab_parallel_cross_entropy)
from megatron_sp.tensor_parallel import mappings
from megatron_sp.testing import run_distributed
from library_helpers import gather_full

B, S, F32 = 2, 8, 4  # batch, sequence (divisible by every tp), bytes per fp32 element
FWD_TOL, GRAD_TOL = 1e-5, 1e-4


def _err(a, b) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()


def _local_cols(full, tp, r, chunks=1):
    """This rank's slice of the last dim of a column-parallel output, in the chunked layout."""
    return torch.cat([c.chunk(tp, -1)[r] for c in full.chunk(chunks, -1)], -1)


def _load(layer, twin, mesh):
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(shard_of_full(getattr(twin, name), p, mesh.tp_rank, mesh.tp_size))


def _seq(t, mesh):
    """This rank's chunk of dim 1 (the sequence)."""
    return t.chunk(mesh.tp_size, 1)[mesh.tp_rank]


def _param_grad_errors(layer, twin, mesh, out, key):
    """Gather each param's grad to full shape and compare with the twin's."""
    if getattr(layer, "sequence_parallel", False):
        all_reduce_grads([p.grad for p in layer.parameters() if p.sequence_parallel], mesh.tp_group)
    for name, p in layer.named_parameters():
        out[f"{key}/grad_{name}"] = _err(gather_full_like(p.grad, p, mesh.tp_group),
                                         getattr(twin, name).grad)
        out[f"{key}/full_{name}"] = _err(gather_full(p, mesh.tp_group), getattr(twin, name))


def _column_checks(mesh, out):
    tp, r = mesh.tp_size, mesh.tp_rank
    for gather_output in (False, True):
        for chunks in (1, 2):
            for sp in (False, True):
                key = f"column/gather{int(gather_output)}/chunks{chunks}/sp{int(sp)}"
                twin = nn.Linear(8, 16)
                layer = ColumnParallelLinear(8, 16, mesh=mesh, gather_output=gather_output,
                                             chunks=chunks, sequence_parallel=sp)
                _load(layer, twin, mesh)
                x_full = torch.randn(B, S, 8)
                grad_full = torch.randn(B, S, 16)
                x = (_seq(x_full, mesh) if sp else x_full).clone().requires_grad_()
                x_ref = x_full.clone().requires_grad_()
                comm_stats.reset()
                y = layer(x)
                ref = twin(x_ref)
                want = ref if gather_output else _local_cols(ref, tp, r, chunks)
                g = grad_full if gather_output else _local_cols(grad_full, tp, r, chunks)
                out[f"{key}/out"] = _err(y, want)
                y.backward(g)
                ref.backward(grad_full)
                out[f"{key}/bytes"] = comm_stats.snapshot()
                out[f"{key}/grad_x"] = _err(x.grad, _seq(x_ref.grad, mesh) if sp else x_ref.grad)
                _param_grad_errors(layer, twin, mesh, out, key)


def _row_checks(mesh, out):
    for input_is_parallel, sp in ((True, False), (False, False), (True, True)):
        key = f"row/parallel_in{int(input_is_parallel)}/sp{int(sp)}"
        twin = nn.Linear(16, 8)
        layer = RowParallelLinear(16, 8, mesh=mesh, input_is_parallel=input_is_parallel,
                                  sequence_parallel=sp)
        _load(layer, twin, mesh)
        x_full = torch.randn(B, S, 16)
        grad_full = torch.randn(B, S, 8)
        x_local = x_full.chunk(mesh.tp_size, -1)[mesh.tp_rank] if input_is_parallel else x_full
        x = x_local.clone().requires_grad_()
        x_ref = x_full.clone().requires_grad_()
        comm_stats.reset()
        y = layer(x)
        ref = twin(x_ref)
        out[f"{key}/out"] = _err(y, _seq(ref, mesh) if sp else ref)
        y.backward(_seq(grad_full, mesh) if sp else grad_full)
        ref.backward(grad_full)
        out[f"{key}/bytes"] = comm_stats.snapshot()
        want_gx = (x_ref.grad.chunk(mesh.tp_size, -1)[mesh.tp_rank] if input_is_parallel
                   else x_ref.grad)
        out[f"{key}/grad_x"] = _err(x.grad, want_gx)
        _param_grad_errors(layer, twin, mesh, out, key)


def _embedding_checks(mesh, out):
    for sp in (False, True):
        key = f"embedding/sp{int(sp)}"
        twin = nn.Embedding(24, 6)
        layer = VocabParallelEmbedding(24, 6, mesh=mesh, sequence_parallel=sp)
        _load(layer, twin, mesh)
        ids = torch.randint(0, 24, (B, S))
        grad_full = torch.randn(B, S, 6)
        comm_stats.reset()
        y = layer(ids)
        ref = twin(ids)
        out[f"{key}/out"] = _err(y, _seq(ref, mesh) if sp else ref)
        y.backward(_seq(grad_full, mesh) if sp else grad_full)
        ref.backward(grad_full)
        out[f"{key}/bytes"] = comm_stats.snapshot()
        _param_grad_errors(layer, twin, mesh, out, key)


def _mapping_checks(mesh, out):
    """Each mapping's forward and backward against its definition, with rank-dependent inputs."""
    group, tp, r = mesh.tp_group, mesh.tp_size, mesh.tp_rank
    base = torch.randn(B, S, 8)                 # identical on every rank
    scale = torch.arange(1, tp + 1, dtype=torch.float32)  # rank k contributes base * (k+1)
    total = scale.sum()

    def run(fn, x, g):
        x = x.clone().requires_grad_()
        y = fn(x, group)
        y.backward(g)
        return y, x.grad

    y, gx = run(copy_to_tensor_parallel_region, base, base * scale[r])
    out["map/copy"] = max(_err(y, base), _err(gx, base * total))
    y, gx = run(reduce_from_tensor_parallel_region, base * scale[r], base)
    out["map/reduce"] = max(_err(y, base * total), _err(gx, base))
    y, gx = run(scatter_to_tensor_parallel_region, base, base.chunk(tp, -1)[r] * scale[r])
    want_g = torch.cat([c * scale[k] for k, c in enumerate(base.chunk(tp, -1))], -1)
    out["map/scatter"] = max(_err(y, base.chunk(tp, -1)[r]), _err(gx, want_g))
    y, gx = run(gather_from_tensor_parallel_region, base.chunk(tp, -1)[r], base)
    out["map/gather"] = max(_err(y, base), _err(gx, base.chunk(tp, -1)[r]))
    y, gx = run(scatter_to_sequence_parallel_region, base, _seq(base, mesh) * scale[r])
    want_g = torch.cat([c * scale[k] for k, c in enumerate(base.chunk(tp, 1))], 1)
    out["map/sp_scatter"] = max(_err(y, _seq(base, mesh)), _err(gx, want_g))
    y, gx = run(gather_from_sequence_parallel_region, _seq(base, mesh), base * scale[r])
    out["map/sp_gather"] = max(_err(y, base), _err(gx, _seq(base, mesh) * total))
    y, gx = run(reduce_scatter_to_sequence_parallel_region, base * scale[r], _seq(base, mesh))
    out["map/sp_reduce_scatter"] = max(_err(y, _seq(base, mesh) * total), _err(gx, base))
    # The all-reduce fallback used where gloo lacks reduce-scatter gives the same result.
    front = (base * scale[r]).transpose(0, 1).contiguous()          # [S, B, 8]
    fallback = front.new_empty(S // tp, B, 8)                        # [S/tp, B, 8]
    mappings._reduce_scatter_via_all_reduce(fallback, front, group)
    out["map/reduce_scatter_fallback"] = _err(fallback.transpose(0, 1),  # -> [B, S/tp, 8]
                                              _seq(base, mesh) * total)
    grads = [torch.full((3,), float(r)), torch.full((2, 2), float(r), dtype=torch.float64)]
    all_reduce_grads(grads, group)
    out["map/all_reduce_grads"] = max(_err(g, torch.full_like(g, float(sum(range(tp)))))
                                      for g in grads)


def _cross_entropy_checks(mesh, out):
    group, tp, r = mesh.tp_group, mesh.tp_size, mesh.tp_rank
    padded = 40
    # vocab 29 at tp=4 leaves rank 3 with only padding columns [30, 40).
    for vocab_size, smoothing in ((None, 0.0), (37, 0.0), (37, 0.1), (29, 0.2)):
        key = f"ce/vocab{vocab_size}/ls{smoothing}"
        real = vocab_size or padded
        logits_full = 3 * torch.randn(B, S, padded)
        logits_full[..., real:] = 1e4  # padding must never matter
        labels = torch.randint(0, real, (B, S))
        weights = torch.rand(B, S)
        logits = logits_full.chunk(tp, -1)[r].clone().requires_grad_()
        comm_stats.reset()
        loss = vocab_parallel_cross_entropy(logits, labels, group, vocab_size=vocab_size,
                                            label_smoothing=smoothing)
        (loss * weights).sum().backward()
        out[f"{key}/bytes"] = comm_stats.snapshot()
        ref_logits = logits_full[..., :real].clone().requires_grad_()
        eps = smoothing * real / (real - 1)
        ref = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), reduction="none",
                              label_smoothing=eps).view(B, S)
        (ref * weights).sum().backward()
        grad_full = torch.cat([ref_logits.grad, torch.zeros(B, S, padded - real)], -1)
        out[f"{key}/loss"] = _err(loss, ref)
        out[f"{key}/grad"] = _err(logits.grad, grad_full.chunk(tp, -1)[r])


def _rng_checks(mesh, out):
    group = mesh.tp_group

    def masks(tracker):
        with tracker.fork():
            forked = F.dropout(torch.ones(1, 256), 0.5, True)   # [1, 256]
        plain = F.dropout(torch.ones(1, 256), 0.5, True)        # [1, 256]
        return (mappings.gather_along_dim(forked, 0, group),    # [tp, 256]
                mappings.gather_along_dim(plain, 0, group))

    forked, plain = masks(RNGTracker(1234, mesh.tp_rank, device="cpu"))
    forked2, plain2 = masks(RNGTracker(1234, mesh.tp_rank, device="cpu"))
    out["rng/forked_distinct"] = all(not torch.equal(forked[0], forked[k])
                                     for k in range(1, mesh.tp_size))
    out["rng/plain_identical"] = all(torch.equal(plain[0], plain[k])
                                     for k in range(1, mesh.tp_size))
    out["rng/reproducible"] = torch.equal(forked, forked2) and torch.equal(plain, plain2)


def _all_checks(rank, world_size):
    results = {}
    for tp in (4, 2):
        mesh = ParallelMesh.from_sizes(tp=tp)
        torch.manual_seed(42 + tp)  # same full tensors on every rank
        out = {"tp": mesh.tp_size, "dp": mesh.dp_size}
        _mapping_checks(mesh, out)
        _column_checks(mesh, out)
        _row_checks(mesh, out)
        _embedding_checks(mesh, out)
        _cross_entropy_checks(mesh, out)
        _rng_checks(mesh, out)
        results[tp] = out
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_checks, 4)


def _errors(results, prefix, suffixes):
    return {f"rank{rank}/tp{tp}/{k}": v for rank, per_tp in enumerate(results)
            for tp, out in per_tp.items() for k, v in out.items()
            if k.startswith(prefix) and k.endswith(suffixes)}


def test_layouts(results):
    assert [(out["tp"], out["dp"]) for out in results[0].values()] == [(4, 1), (2, 2)]


def test_mappings_forward_and_backward(results):
    errs = _errors(results, "map/", ("",))
    assert len(errs) == 4 * 2 * 9
    assert max(errs.values()) < FWD_TOL, errs


@pytest.mark.parametrize("layer", ["column", "row", "embedding"])
def test_layers_match_unsharded_twin(results, layer):
    fwd = _errors(results, f"{layer}/", ("/out", "/full_weight", "/full_bias"))
    grads = _errors(results, f"{layer}/", ("/grad_x", "/grad_weight", "/grad_bias"))
    assert fwd and grads
    assert max(fwd.values()) < FWD_TOL, {k: v for k, v in fwd.items() if v >= FWD_TOL}
    assert max(grads.values()) < GRAD_TOL, {k: v for k, v in grads.items() if v >= GRAD_TOL}


def test_vocab_parallel_cross_entropy_matches_full_logits(results):
    losses = _errors(results, "ce/", ("/loss",))
    grads = _errors(results, "ce/", ("/grad",))
    assert len(losses) == len(grads) == 4 * 2 * 4
    assert max(losses.values()) < FWD_TOL, losses
    assert max(grads.values()) < GRAD_TOL, grads


def _expected_bytes(key, tp):
    """Bytes one rank sends for the layer's forward + backward, from the comm_stats formulas."""
    ar = lambda n: comm_stats.all_reduce_bytes(n, F32, tp)  # noqa: E731
    ag = lambda n_local: comm_stats.gather_bytes(n_local, F32, tp)  # noqa: E731
    sp = key.endswith("/sp1")
    if key.startswith("column/"):
        gather_output = "/gather1/" in key
        # sequence parallel: input all-gathered forward and again in backward (only the shard is
        # saved), input gradient reduce-scattered
        exp = ({"tp/all_gather": 2 * ag(B * S // tp * 8), "tp/reduce_scatter": ag(B * S // tp * 8)}
               if sp else {"tp/all_reduce": ar(B * S * 8)})
        if gather_output:  # output all-gathered forward (backward is a split)
            exp["tp/all_gather"] = exp.get("tp/all_gather", 0) + ag(B * S * 16 // tp)
        return exp
    if key.startswith("row/"):
        exp = ({"tp/reduce_scatter": ag(B * S // tp * 8), "tp/all_gather": ag(B * S // tp * 8)}
               if sp else {"tp/all_reduce": ar(B * S * 8)})
        if "/parallel_in0/" in key:  # input split forward, all-gathered backward
            exp["tp/all_gather"] = exp.get("tp/all_gather", 0) + ag(B * S * 16 // tp)
        return exp
    if key.startswith("embedding/"):
        return ({"tp/reduce_scatter": ag(B * S // tp * 6), "tp/all_gather": ag(B * S // tp * 6)}
                if sp else {"tp/all_reduce": ar(B * S * 6)})
    # cross-entropy: max [B, S], then [B, S, 2 or 3] stats
    n_stats = 3 if "/ls0.0" not in key else 2
    return {"tp/all_reduce": ar(B * S) + ar(B * S * n_stats)}


def test_byte_counters_equal_the_formulas(results):
    checked = 0
    for per_tp in results:
        for tp, out in per_tp.items():
            for key, value in out.items():
                if key.endswith("/bytes"):
                    layer_key = key[: -len("/bytes")]
                    assert value == _expected_bytes(layer_key, tp), (tp, layer_key, value)
                    assert all(v > 0 for v in value.values())
                    checked += 1
    assert checked == 4 * 2 * (8 + 3 + 2 + 4)


def test_rng_tracker_streams(results):
    for per_tp in results:
        for out in per_tp.values():
            assert out["rng/forked_distinct"], "forked dropout masks must differ across tp ranks"
            assert out["rng/plain_identical"], "default-stream masks must agree across tp ranks"
            assert out["rng/reproducible"], "the same seed must give the same masks"


def _sequence_parallel_linear_bf16(rank, world):
    """Under bf16 autocast the sequence-parallel column linear (shard saved, re-gathered in
    backward) equals the plain column linear on the gathered input; gradients keep fp32 dtypes."""
    mesh = ParallelMesh.from_sizes(tp=world)
    torch.manual_seed(0)                                    # same full tensors on every rank
    w_full, b_full = torch.randn(16, 8), torch.randn(16)
    x_full = torch.randn(2, 12, 8)
    outs = {}
    for seqpar in (True, False):
        layer = ColumnParallelLinear(8, 16, mesh=mesh, sequence_parallel=seqpar)
        with torch.no_grad():
            layer.weight.copy_(shard_of_full(w_full, layer.weight, mesh.tp_rank, world))
            layer.bias.copy_(shard_of_full(b_full, layer.bias, mesh.tp_rank, world))
        x = (x_full.chunk(world, dim=1)[mesh.tp_rank] if seqpar else x_full).clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        (y.float() ** 2).sum().backward()
        outs[seqpar] = (y.float(), layer.weight.grad, layer.bias.grad, x.grad)
        assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
        assert layer.weight.grad.dtype == torch.float32
    (y1, gw1, gb1, gx1), (y0, gw0, gb0, gx0_full) = outs[True], outs[False]
    tol = dict(rtol=2e-2, atol=2e-2)   # bf16 matmuls, summation order differs
    torch.testing.assert_close(y1, y0, **tol)
    torch.testing.assert_close(gw1, gw0, **tol)
    torch.testing.assert_close(gb1, gb0, **tol)
    # the plain layer's input gradient is all-reduced over tp: compare this rank's slice
    torch.testing.assert_close(gx1, gx0_full.chunk(world, dim=1)[mesh.tp_rank], **tol)
    return True


def test_sequence_parallel_linear_under_bf16_autocast():
    assert all(run_distributed(_sequence_parallel_linear_bf16, 2))
