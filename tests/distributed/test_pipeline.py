"""Pipeline parallelism (docs/design.md §6): stage partition, p2p, 1F1B and interleaved schedules, and their
composition with tp, sp and dp, each equal to one rank (loss 1e-5 relative, gradients 1e-4 over
several optimizer steps; every stage compares the gradients of the parameters it holds), plus
pretrain_gpt.py (tp 2 x sp 2 x pp 2 on 8 gloo ranks, forked: run_script) against its one-rank loss curve.
"""
import contextlib
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megatron_sp import comm_stats
from megatron_sp.cli.build import parse_job
from megatron_sp.errors import ConfigError
from megatron_sp.mesh import ParallelMesh
from megatron_sp.pipeline import (PipelineLayoutError, check_num_microbatches, chunk_layer_ids,
                                  forward_backward_pipelining_with_interleaving, stage_layer_ids)
from megatron_sp.testing import metrics_losses, run_distributed, run_script

from layout_utils import build_chunks, check_layouts, global_batches, micro_batches

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GPT2 = dict(model="gpt2-tiny", overrides=dict(num_layers=4, hidden_size=32, num_attention_heads=4,
                                              vocab_size=300, max_position_embeddings=64))
LLAMA = dict(model="llama-tiny", overrides=dict(num_layers=4, hidden_size=32, num_attention_heads=4,
                                                num_query_groups=2, ffn_hidden_size=64,
                                                vocab_size=300))
GPT2_8 = dict(GPT2, overrides=dict(GPT2["overrides"], num_layers=8))
LLAMA_8 = dict(LLAMA, overrides=dict(LLAMA["overrides"], num_layers=8))
LLAMA_6 = dict(LLAMA, overrides=dict(LLAMA["overrides"], num_layers=6))


# Partition and checks (no process group) ----------------------------------------------------------

def test_stage_partition():
    assert stage_layer_ids(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert stage_layer_ids(8, 4, first=1, last=1) == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert stage_layer_ids(7, 3, first=3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert stage_layer_ids(5, 2, first=1, last=4) == [[0], [1, 2, 3, 4]]
    # Interleaved: virtual stage j = chunk * pp + stage holds layers [j*n, (j+1)*n).
    assert chunk_layer_ids(8, 2, 0, layers_per_virtual_stage=2) == [[0, 1], [4, 5]]
    assert chunk_layer_ids(8, 2, 1, layers_per_virtual_stage=2) == [[2, 3], [6, 7]]
    assert chunk_layer_ids(8, 4, 3, layers_per_virtual_stage=1) == [[3], [7]]
    with pytest.raises(PipelineLayoutError, match="7 layers do not split evenly over 4"):
        stage_layer_ids(7, 4)
    with pytest.raises(PipelineLayoutError, match="does not equal --num-layers 6"):
        stage_layer_ids(6, 2, first=1, last=4)
    # First/last stages that take every layer: no "-1 layers", the flags and the fix.
    with pytest.raises(PipelineLayoutError, match=r"^--decoder-first-pipeline-num-layers 5 leaves "
                       r"no layer of --num-layers 4 for the other 1 pipeline stage: every stage "
                       r"needs at least one layer; give the first/last stage fewer layers\.$"):
        stage_layer_ids(4, 2, first=5)
    with pytest.raises(PipelineLayoutError, match=r"^--decoder-first-pipeline-num-layers 2 \+ "
                       r"--decoder-last-pipeline-num-layers 3 leave only 1 layer of --num-layers 6 "
                       r"for the other 2 pipeline stages"):
        stage_layer_ids(6, 4, first=2, last=3)
    with pytest.raises(PipelineLayoutError, match="not divisible by .* 2 x .* 3 = 6"):
        chunk_layer_ids(8, 2, 0, layers_per_virtual_stage=3)
    # Uneven and interleaved (Megatron's offsets): 2+4+4+2 layers, v = 4/2 = 2 chunks per stage.
    assert [chunk_layer_ids(12, 4, r, layers_per_virtual_stage=2, first=2, last=2)
            for r in range(4)] == [[[0], [6]], [[1, 2], [7, 8]], [[3, 4], [9, 10]], [[5], [11]]]
    assert chunk_layer_ids(6, 2, 1, layers_per_virtual_stage=1, first=2, last=4) == [[1, 2], [4, 5]]
    with pytest.raises(PipelineLayoutError, match="stage 0 holds 3 layers, which do not split into 2"):
        chunk_layer_ids(12, 4, 0, layers_per_virtual_stage=2, first=3, last=1)
    check_num_microbatches(3, 4)            # 1F1B runs any count, fewer than pp included
    check_num_microbatches(8, 4, 2)
    with pytest.raises(PipelineLayoutError, match=r"micro-batches \(6 .*multiple of .*size 4"):
        check_num_microbatches(6, 4, 2)


def test_pipeline_flags_accepted():
    args = parse_job(["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                      "1", "--decoder-first-pipeline-num-layers", "1"]).parallel
    assert args.pipeline_model_parallel_size == 2
    with pytest.raises(ConfigError, match="needs --pipeline-model-parallel-size > 1"):
        parse_job(["--num-layers-per-virtual-pipeline-stage", "2"])


# Distributed ----------------------------------------------------------------------------------------

def _run(world, cases, extra=None):
    results = run_distributed(_check, world, cases, extra)
    assert [r[0] for r in results[0]["layouts"]] == [c["name"] for c in cases]
    return results


def _check(rank, world, cases, extra):
    out = {"layouts": check_layouts(rank, world, cases)}
    if extra:
        out["extra"] = globals()[extra](rank, world)
    return out


class _SyncSpy:
    """Stands in for GradientSync: records when the last backward is armed."""

    def __init__(self):
        self.calls = 0

    def start_last_backward(self):
        self.calls += 1


def _held_after_send(schedule, chunks, mbs, mesh, count, autocast=contextlib.nullcontext):
    """One training step recording every activation this stage sends; returns (the most bytes the
    sent outputs still held at any later exchange or at the end, number sent)."""
    from megatron_sp.pipeline import p2p

    sent, held = [], [0]
    original = p2p.P2PCommunicator.communicate

    def spy(self, *, send_next=None, **kwargs):
        held[0] = max(held[0], sum(t.untyped_storage().nbytes() for t in sent))
        if send_next is not None:
            sent.append(send_next)
        return original(self, send_next=send_next, **kwargs)

    p2p.P2PCommunicator.communicate = spy
    try:
        schedule(chunks, mbs, mesh, num_tokens=count, autocast=autocast)
    finally:
        p2p.P2PCommunicator.communicate = original
    return max(held[0], sum(t.untyped_storage().nbytes() for t in sent)), len(sent)


def pipeline_extras(rank, world):
    """pp=2: evaluation (forward only), byte counts, arming, the interleaved micro-batch check and
    identical tied embeddings on both stages after training."""
    from megatron_sp.config import JobConfig
    from megatron_sp.models import preset
    from megatron_sp.training.optimizer import LRScheduler, build_optimizer
    from megatron_sp.training import Trainer

    cfg = preset(GPT2["model"], **GPT2["overrides"])
    batches = global_batches(cfg.vocab_size, 16, 4, 2, seed=5)
    results = {}
    for name, pipeline, v in (("1f1b", None, 1), ("interleaved", {"virtual": 1}, 2)):
        mesh = ParallelMesh.from_sizes(pp=2)
        ref_chunks, _ = build_chunks(ParallelMesh.single(), cfg)
        chunks, schedule = build_chunks(mesh, cfg, pipeline=pipeline)
        trainers = []
        for m, cs, sched in ((ParallelMesh.single(), ref_chunks, None), (mesh, chunks, schedule)):
            opt = build_optimizer(cs, lr=1e-3)
            job = JobConfig.from_flags({"global_batch_size": 4, "micro_batch_size": 1,
                                        "seq_length": 16})
            trainers.append(Trainer(job, m, cs, opt, LRScheduler(opt, 1e-3, 1e-4, 0, 2),
                                    schedule=sched))
        # Forward-only evaluation equals one rank's.
        evals = [t.evaluate(iter(micro_batches(batches[0], 1, 0, 1)), 1) for t in trainers]
        assert abs(evals[1] - evals[0]) <= 1e-5 * abs(evals[0]), (name, evals)
        # Bytes: per micro-batch [1, 16, 32] fp32 tensors cross 2v-1 stage boundaries each way; each
        # stage sends (2v-1)*m of them (activations forward, gradients backward).
        comm_stats.reset()
        spy = _SyncSpy()
        mbs = micro_batches(batches[0], 1, 0, 1)
        count = sum(mb["loss_mask"].sum() for mb in mbs).float()
        schedule(chunks, mbs, mesh, num_tokens=count, grad_sync=spy)
        assert comm_stats.snapshot()["pp/send"] == (2 * v - 1) * 4 * 16 * 32 * 4, comm_stats.snapshot()
        assert spy.calls == 1
        schedule(chunks, mbs, mesh, num_tokens=count, grad_sync=spy, forward_only=True)
        assert spy.calls == 1, "forward-only must not arm the gradient reduction"
        # The sender frees what it sent (Megatron's deallocate_output_tensor): at most one element
        # of each [1, 16, 32] fp32 output (2 KiB) is held after its send, until the step ends.
        held, n_sent = _held_after_send(schedule, chunks, mbs, mesh, count)
        assert n_sent == (4 * v if rank == 0 else 4 * (v - 1)), (name, n_sent)
        assert held <= 4 * n_sent, f"{name}: sent outputs still hold {held} bytes"
        # Under bf16 autocast activations and gradients cross stages in bf16: half the bytes.
        comm_stats.reset()
        bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
        held, _ = _held_after_send(schedule, chunks, mbs, mesh, count, autocast=bf16)
        assert comm_stats.snapshot()["pp/send"] == (2 * v - 1) * 4 * 16 * 32 * 2, comm_stats.snapshot()
        assert held <= 4 * n_sent
        # gloo posts each op directly; the grouped batch_isend_irecv that NCCL uses gives the
        # same step (equal gradients, bit for bit).
        grads = {}
        for batched in (False, True):
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            with mock.patch("megatron_sp.pipeline.p2p.posts_batched", lambda group: batched):
                schedule(chunks, mbs, mesh, num_tokens=count)
            grads[batched] = [p.grad.clone() for c in chunks for p in c.parameters()
                              if p.grad is not None]
        assert len(grads[True]) > 0 and all(
            torch.equal(a, b) for a, b in zip(grads[False], grads[True])), name
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        # Training keeps the two copies of the tied word embeddings identical.
        for batch in batches:
            trainers[1].train_step(micro_batches(batch, 1, 0, 1))
        weight = [p for c in chunks for n, p in c.named_parameters()
                  if n == "embedding.word_embeddings.weight"][0].detach().clone()
        gathered = [torch.empty_like(weight) for _ in range(2)]
        dist.all_gather(gathered, weight, group=mesh.pp_group)
        assert torch.equal(gathered[0], gathered[1]), f"{name}: tied embeddings diverged"
        results[name] = evals
    mesh = ParallelMesh.from_sizes(pp=2)
    chunks, _ = build_chunks(mesh, cfg, pipeline={"virtual": 1})
    with pytest.raises(PipelineLayoutError, match="multiple of"):
        forward_backward_pipelining_with_interleaving(
            chunks, micro_batches(batches[0], 1, 0, 1)[:3], mesh, num_tokens=torch.tensor(1.0))
    return results


def test_two_stage_pipelines():
    c = dict(seq=16, global_batch=4, steps=3, pp=2)
    _run(2, [
        dict(GPT2, name="gpt2 pp2 1f1b m=4 (tied embeddings)", micro_batch=1, **c),
        dict(LLAMA, name="llama pp2 1f1b m=2", micro_batch=2, **c),
        dict(GPT2, name="gpt2 pp2 1f1b m=1 (fewer micro-batches than stages)", micro_batch=4, **c),
        dict(LLAMA, name="llama pp2 uneven 1+3", micro_batch=1, pipeline=dict(first=1, last=3), **c),
        dict(GPT2, name="gpt2 pp2 interleaved v=2 m=4", micro_batch=1, pipeline=dict(virtual=1),
             **c),
        dict(LLAMA_8, name="llama pp2 interleaved v=2 m=2 (all warm-up)", micro_batch=2,
             pipeline=dict(virtual=2), **c),
        dict(LLAMA_6, name="llama pp2 uneven 2+4 interleaved v=2", micro_batch=1,
             pipeline=dict(virtual=1, first=2, last=4), **c),
    ], extra="pipeline_extras")


def test_four_rank_pipelines():
    c = dict(seq=16, global_batch=8, steps=3)
    _run(4, [
        dict(GPT2, name="gpt2 pp4 1f1b m=8", pp=4, micro_batch=1, **c),
        dict(LLAMA, name="llama pp4 1f1b m=2 (< pp)", pp=4, micro_batch=4, **c),
        dict(GPT2_8, name="gpt2 pp4 interleaved v=2 m=8", pp=4, micro_batch=1,
             pipeline=dict(virtual=1), **c),
        dict(LLAMA_8, name="llama pp4 interleaved v=2 m=4", pp=4, micro_batch=2,
             pipeline=dict(virtual=1), **c),
        dict(LLAMA_6, name="llama pp4 uneven 1+2+2+1", pp=4, micro_batch=2,
             pipeline=dict(first=1, last=1), **c),
        dict(GPT2, name="gpt2 pp2 x dp2 1f1b", pp=2, micro_batch=1, **c),
        dict(LLAMA_8, name="llama pp2 x dp2 interleaved", pp=2, micro_batch=2,
             pipeline=dict(virtual=2), **c),
    ])


def test_eight_rank_compositions():
    c = dict(seq=16, global_batch=4, steps=3)
    _run(8, [
        dict(GPT2, name="gpt2 tp2 x sp2 x pp2 sequence-parallel", tp=2, sp=2, pp=2, micro_batch=1,
             sequence_parallel=True, **c),
        dict(LLAMA, name="llama tp2 x sp2 x pp2 interleaved", tp=2, sp=2, pp=2, micro_batch=2,
             pipeline=dict(virtual=1), **c),
        dict(LLAMA, name="llama sp2 x pp2 x dp2 packed", sp=2, pp=2, micro_batch=1, packed=True, **c),
    ])


# pretrain_gpt.py on 8 ranks ---------------------------------------------------------------------------

def test_pretrain_gpt_tp_sp_pp_matches_one_rank(tmp_path):
    common = ["--mock-data", "--vocab-size", "512", "--num-layers", "4", "--hidden-size", "32",
              "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1",
              "--global-batch-size", "4", "--train-iters", "3", "--log-interval", "1",
              "--eval-iters", "1", "--eval-interval", "3", "--lr", "1e-3",
              "--attention-backend", "sdpa", "--distributed-backend", "gloo",
              "--attention-dropout", "0", "--hidden-dropout", "0"]
    one = tmp_path / "one.jsonl"
    eight = tmp_path / "eight.jsonl"
    # Both runs' ranks forked with the launcher's environment set by hand (run_script: the same
    # computation as under torchrun, without 8 fresh interpreters; torchrun itself:
    # test_pretrain_torchrun.py).
    for world, extra, metrics in ((1, [], one),
                                  (8, ["--tensor-model-parallel-size", "2",
                                       "--sequence-parallel-size", "2",
                                       "--pipeline-model-parallel-size", "2"], eight)):
        rcs, out = run_script("pretrain_gpt.py", common + extra + ["--metrics-jsonl", str(metrics)],
                              world=world)
        assert rcs == [0] * world, out[-4000:]
    (train1, valid1), (train8, valid8) = metrics_losses(one), metrics_losses(eight)
    assert len(train1) == len(train8) == 3 and len(valid1) == len(valid8) == 1
    for a, b in zip(train1 + valid1, train8 + valid8):
        assert abs(a - b) <= 1e-5 * abs(a), (train1, valid1, train8, valid8)
