"""Checkpoint resharding on gloo: save in one (tp, sp, pp, dp) layout, load in others and on one rank.

One 4-rank spawn runs the whole matrix. Every value must come back bit-for-bit: parameters (with the
vocabulary re-padded for the new tp, SwiGLU's fused fc1 re-split), AdamW moments and steps, the LR
scheduler, the train state and (same layout only) the RNG streams. Also: bad input (shape mismatch,
config mismatch, a tensor missing) fails with one sentence naming the tensor or field.
"""
from __future__ import annotations

import os
import re
import tempfile

import pytest
import torch

from megatron_sp.testing import run_distributed

OVERRIDES = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                 ffn_hidden_size=128, vocab_size=300, add_bias_linear=True)

# (name, tp, sp, pp) on 4 ranks (dp inferred). Each save is loaded back in its own layout (RNG too),
# on one rank, and in one other layout.
LAYOUTS = {"one-rank": (None, None, None), "tp4": (4, 1, 1), "sp2xpp2": (1, 2, 2),
           "tp2xsp2": (2, 2, 1), "tp2xdp2": (2, 1, 1), "sp2xdp2": (1, 2, 1), "tp2xpp2": (2, 1, 2)}
MATRIX = {"llama": {"tp2xdp2": ["one-rank", "sp2xpp2"], "sp2xdp2": ["one-rank", "tp4"],
                    "tp2xpp2": ["one-rank", "tp2xsp2"]},
          "gpt2": {"tp2xpp2": ["one-rank", "sp2xpp2"]}}


def _config(model):
    from megatron_sp.models import preset
    if model == "llama":
        return preset("llama-tiny", **OVERRIDES)          # swiglu, rope, untied, biases on
    return preset("gpt2-tiny", num_layers=2, hidden_size=64, num_attention_heads=8,
                  vocab_size=300, max_position_embeddings=32)  # tied, learned positions


def _build(config, mesh, seed):
    from megatron_sp.models import GPTModel
    from megatron_sp.models.init import init_parameters
    if mesh.pp_size > 1:
        from megatron_sp.pipeline import chunk_specs
        chunks = [GPTModel(config, mesh, **spec) for spec in chunk_specs(config.num_layers, mesh)]
    else:
        chunks = [GPTModel(config, mesh)]
    for c in chunks:
        init_parameters(c, seed=seed)
    return chunks


def _opt(chunks, with_state, lr=1e-3):
    from megatron_sp.training.optimizer import LRScheduler, build_optimizer
    from megatron_sp.models.init import init_parameters
    opt = build_optimizer(chunks, lr)
    sched = LRScheduler(opt, lr, lr / 10, warmup_iters=2, decay_iters=20, style="cosine")
    if with_state:   # layout-independent moment values: the model's own init from other seeds
        for seed, key in ((11, "exp_avg"), (12, "exp_avg_sq")):
            twins = [type(c)(c.config, c.mesh, layer_ids=c.layer_ids, pre_process=c.pre_process,
                             post_process=c.post_process) for c in chunks]
            for c, t in zip(chunks, twins):
                if getattr(c, "embedding", None) is not None and t.embedding is not None and \
                        c.embedding.position_embeddings is None:
                    t.embedding.position_embeddings = None
                init_parameters(t, seed=seed)
                for p, q in zip(c.parameters(), t.parameters()):
                    st = opt.state[p]
                    st[key] = q.detach().clone().abs() if key == "exp_avg_sq" else q.detach().clone()
                    st["step"] = torch.tensor(5.0)
        sched.step(5)
    return opt, sched


def _reference(config):
    """Full tensors (vocab rows unpadded) of params and moments, computed on one rank."""
    from megatron_sp.mesh import ParallelMesh
    mesh = ParallelMesh.single()
    chunks = _build(config, mesh, seed=3)
    opt, _ = _opt(chunks, True)
    ref = {}
    for name, p in chunks[0].named_parameters():
        rows = getattr(p, "real_rows", None)
        cut = (lambda t: t[:rows]) if rows else (lambda t: t)
        ref[name] = (cut(p.detach()), cut(opt.state[p]["exp_avg"]), cut(opt.state[p]["exp_avg_sq"]))
    return ref


def _check_loaded(chunks, opt, ref, what):
    from megatron_sp.tensor_parallel import gather_full_like
    for c in chunks:
        for name, p in c.named_parameters():
            group = c.mesh.tp_group
            for i, t in enumerate((p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])):
                full = gather_full_like(t.detach(), p, group)
                rows = getattr(p, "real_rows", None)
                if rows:
                    assert not full[rows:].any(), f"{what}: padding rows of {name} not zero"
                    full = full[:rows]
                assert torch.equal(full, ref[name][i]), f"{what}: {name} [{i}] differs"
            assert float(opt.state[p]["step"]) == 5.0, f"{what}: step of {name}"


def _mesh(tp, sp, pp):
    from megatron_sp.mesh import ParallelMesh
    if tp is None:
        return ParallelMesh.single()
    return ParallelMesh.from_sizes(tp=tp, sp=sp, pp=pp)


def check_matrix(rank, world, root):
    from megatron_sp import checkpointing as ck
    from megatron_sp.training import TrainState
    from megatron_sp.tensor_parallel import RNGTracker
    done = []
    for model, saves in MATRIX.items():
        config = _config(model)
        ref = _reference(config)
        for sname, loads in saves.items():
            mesh = _mesh(*LAYOUTS[sname])
            chunks = _build(config, mesh, seed=3)
            opt, sched = _opt(chunks, True)
            tracker = RNGTracker(7, mesh.tp_rank, mesh.pp_rank, mesh.sp_rank)
            with tracker.fork():
                torch.rand(3)
            save_dir = os.path.join(root, f"{model}-{sname}")
            ck.save_checkpoint(save_dir, 5, chunks, mesh, optimizer=opt, scheduler=sched,
                               train_state=TrainState(5, 40), config=config, rng_tracker=tracker)
            expect_torch, expect_tp = torch.rand(4), None
            with tracker.fork():
                expect_tp = torch.rand(4)
            # Same layout: everything, RNG included.
            chunks2 = _build(config, mesh, seed=99)
            opt2, sched2 = _opt(chunks2, False)
            state, tracker2 = TrainState(), RNGTracker(8, mesh.tp_rank, mesh.pp_rank, mesh.sp_rank)
            torch.manual_seed(1234)
            ck.load_checkpoint(save_dir, chunks2, mesh, optimizer=opt2, scheduler=sched2,
                               train_state=state, config=config, rng_tracker=tracker2)
            _check_loaded(chunks2, opt2, ref, f"{model} {sname} -> same")
            assert (state.iteration, state.consumed_train_samples, sched2.num_steps) == (5, 40, 5)
            assert opt2.param_groups[0]["lr"] == sched.lr
            assert torch.equal(torch.rand(4), expect_torch), "default RNG stream not restored"
            with tracker2.fork():
                assert torch.equal(torch.rand(4), expect_tp), "tensor-parallel RNG not restored"
            for lname in loads:
                lmesh = _mesh(*LAYOUTS[lname])
                chunks3 = _build(config, lmesh, seed=99)
                opt3, sched3 = _opt(chunks3, False)
                state3 = TrainState()
                ck.load_checkpoint(save_dir, chunks3, lmesh, optimizer=opt3, scheduler=sched3,
                                   train_state=state3, config=config)
                _check_loaded(chunks3, opt3, ref, f"{model} {sname} -> {lname}")
                assert state3.iteration == 5 and sched3.num_steps == 5
                done.append(f"{model} {sname} -> {lname}")
    # Bad input: each refused with one sentence naming the field / tensor and both shapes.
    from megatron_sp.models import preset
    save_dir = os.path.join(root, "llama-tp2xdp2")
    mesh = _mesh(2, 1, 1)
    wider = preset("llama-tiny", **dict(OVERRIDES, ffn_hidden_size=256))
    errors = []
    for cfg_arg in (wider, None):
        try:
            ck.load_checkpoint(save_dir, _build(wider, mesh, 1), mesh, config=cfg_arg)
        except ck.CheckpointError as err:
            errors.append(str(err))
    assert "--ffn-hidden-size 128 in the checkpoint but 256" in errors[0], errors
    assert re.search(r"tensor 'layers.0.mlp.fc1.(weight|bias)' has shape \(2, 128(, 64)?\) in checkpoint "
                     r".* but shape \(2, 256(, 64)?\) in the model", errors[1]), errors
    try:
        ck.load_checkpoint(os.path.join(root, "gpt2-tp2xpp2"), _build(_config("llama"), mesh, 1), mesh)
        raise AssertionError("loading a GPT-2 checkpoint into a Llama model did not fail")
    except ck.CheckpointError as err:
        assert "has no tensor" in str(err) or "has shape" in str(err), err
    return done


def test_resharding_matrix():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(check_matrix, 4, root)
    assert len(results[0]) == sum(len(v) for s in MATRIX.values() for v in s.values())


def test_missing_and_partial_checkpoint(tmp_path):
    from megatron_sp import checkpointing as ck
    from megatron_sp.mesh import ParallelMesh
    config = _config("llama")
    mesh = ParallelMesh.single()
    chunks = _build(config, mesh, 3)
    assert ck.load_checkpoint(str(tmp_path / "nothing"), chunks, mesh) is None  # Megatron: from scratch
    with pytest.raises(ck.CheckpointError, match="holds no checkpoint"):
        ck.load_checkpoint(str(tmp_path), chunks, mesh, missing_ok=False)
    (tmp_path / ck.TRACKER_FILENAME).write_text("20")
    with pytest.raises(ck.CheckpointError, match="names iteration 20, but .*iter_0000020 is missing"):
        ck.load_checkpoint(str(tmp_path), chunks, mesh)
    ck.save_checkpoint(str(tmp_path), 20, chunks, mesh, config=config)
    with pytest.raises(ck.CheckpointError, match="holds no optimizer state"):
        opt, _ = _opt(chunks, False)
        ck.load_checkpoint(str(tmp_path), chunks, mesh, optimizer=opt)
    os.remove(tmp_path / "iter_0000020" / ".metadata")
    with pytest.raises(ck.CheckpointError, match="missing or incomplete"):
        ck.load_checkpoint(str(tmp_path), chunks, mesh)
