"""--torch-compile (megatron_sp/compile.py): compiled layers train exactly like the eager model on
one rank, in dp2 (inductor), tp2 (with --sequence-parallel), sp2 (Ulysses, with selective
recompute), pp2 (1F1B) and dp2 under FSDP2 with full recompute, 3 optimizer steps each, fresh
seeded batches.

Tolerances (layout_utils): loss 1e-5 relative, every full gradient 1e-4 absolute, grad norm 1e-4.
The layouts compile with the "aot_eager" backend (AOTAutograd's joint forward/backward graph, no
code generation: the fast path on a CPU); plain dp2 compiles with inductor (C++ code generation)
on the smallest model, so the default backend's real path runs too. Each case counts the graphs its
backend received (CompileCounterWithBackend), so a layer that silently ran eagerly fails the test.
All cases share one 2-rank spawn; Dynamo's caches are reset between cases.
"""
from __future__ import annotations

import pytest

from megatron_sp.compile import CompileLayoutError, check_compile, compile_layers, reset
from megatron_sp.config import JobConfig
from megatron_sp.memory import MemoryOptions
from megatron_sp.mesh import ParallelMesh
from megatron_sp.models import preset
from megatron_sp.sharding.fsdp import apply_fsdp2, full_tensor
from megatron_sp.tensor_parallel import gather_full_like
from megatron_sp.testing import run_distributed
from megatron_sp.training import Trainer
from megatron_sp.training.optimizer import LRScheduler, build_optimizer

from layout_utils import build_chunks, compare, global_batches, micro_batches

LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
             ffn_hidden_size=128, vocab_size=300)
SMALLEST = dict(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=64, vocab_size=128)
SEQ, GLOBAL_BATCH, STEPS = 16, 4, 3


def _train(mesh, cfg, batches, micro_batch, *, backend=None, sequence_parallel=False,
           memory=None, fsdp=False):
    """Per step (loss, grad norm, {name: full gradient}); backend None: eager."""
    chunks, schedule = build_chunks(mesh, cfg, sequence_parallel=sequence_parallel,
                                    model_kwargs={"memory": MemoryOptions(**(memory or {}))})
    if backend is not None:
        assert compile_layers(chunks, mesh, backend=backend) == len(chunks[0].layers) * len(chunks)
    sharding = apply_fsdp2(chunks, mesh) if fsdp else None
    optimizer = build_optimizer(chunks, lr=1e-3, weight_decay=0.1)
    scheduler = LRScheduler(optimizer, 1e-3, 1e-4, warmup_iters=1, decay_iters=STEPS, style="cosine")
    job = JobConfig.from_flags({"global_batch_size": GLOBAL_BATCH, "micro_batch_size": micro_batch,
                                "seq_length": SEQ, "clip_grad": 1.0, "grad_bucket_size_mb": 0.05})
    trainer = Trainer(job, mesh, chunks, optimizer, scheduler, schedule=schedule, sharding=sharding)
    history = []
    for batch in batches:
        result = trainer.train_step(micro_batches(batch, micro_batch, mesh.dp_rank, mesh.dp_size))
        grads = {n: gather_full_like(full_tensor(p.grad), p, mesh.tp_group)
                 for c in chunks for n, p in c.named_parameters()}
        history.append((result.loss, result.grad_norm, grads))
    return history


def _check(rank, world, cases):
    from torch._dynamo.testing import CompileCounterWithBackend
    out = []
    for case in cases:
        reset()
        cfg = preset("llama-tiny", **case["model"])
        batches = global_batches(cfg.vocab_size, SEQ, GLOBAL_BATCH, STEPS, seed=case["seed"])
        reference = _train(ParallelMesh.single(), cfg, batches, GLOBAL_BATCH)
        mesh = ParallelMesh.from_sizes(tp=case.get("tp", 1), sp=case.get("sp", 1),
                                       pp=case.get("pp", 1))
        counter = CompileCounterWithBackend(case.get("backend", "aot_eager"))
        compiled = _train(mesh, cfg, batches, case["micro_batch"], backend=counter,
                          sequence_parallel=case.get("sequence_parallel", False),
                          memory=case.get("memory"), fsdp=case.get("fsdp", False))
        assert counter.frame_count > 0, f"{case['name']}: no layer was compiled"
        out.append((case["name"], counter.frame_count) + compare(reference, compiled, case["name"]))
    reset()
    return out


@pytest.mark.timeout(400)
def test_compiled_layers_equal_eager_in_every_layout():
    cases = [
        dict(name="tp2 sequence-parallel", model=LLAMA, tp=2, micro_batch=4,
             sequence_parallel=True, seed=4),
        dict(name="sp2 Ulysses, selective recompute", model=LLAMA, sp=2, micro_batch=2,
             memory={"recompute_granularity": "selective"}, seed=5),
        dict(name="pp2 1F1B", model=LLAMA, pp=2, micro_batch=1, seed=6),
        dict(name="dp2 FSDP2, full recompute", model=LLAMA, micro_batch=2, fsdp=True,
             memory={"recompute_granularity": "full"}, seed=7),
        dict(name="dp2 (fullgraph) inductor, smallest model", model=SMALLEST, micro_batch=2,
             backend="inductor", seed=8),
    ]
    results = run_distributed(_check, 2, cases, timeout_s=380)
    for rank_results in results:
        assert [r[0] for r in rank_results] == [c["name"] for c in cases]


@pytest.mark.parametrize("kwargs, words", [
    (dict(backend="tvm"), "--torch-compile-backend 'tvm' is not one of"),
    (dict(backend="inductor", fp8=True), "--torch-compile with --fp8-format"),
])
def test_refusals_are_one_sentence(kwargs, words):
    with pytest.raises(CompileLayoutError, match=words) as err:
        check_compile(**kwargs)
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")


def test_the_flags_compile_the_layers_of_the_built_model():
    """--torch-compile through the JobConfig: every layer compiled in place (parameter names kept),
    the start-up line; FP8 refused in one sentence."""
    from megatron_sp.cli.build import parse_job
    from megatron_sp.compile import compile_from_config
    from megatron_sp.models import GPTModel
    job = parse_job(["--seq-length", "16", "--torch-compile", "--torch-compile-backend", "eager"])
    assert job.training.torch_compile and job.training.torch_compile_backend == "eager"
    model = GPTModel(preset("llama-tiny", **SMALLEST))
    names = [n for n, _ in model.named_parameters()]
    line = compile_from_config([model], ParallelMesh.single(), job)
    assert line == "> torch.compile: 1 transformer layers, backend eager (one graph per layer)"
    assert all(layer._compiled_call_impl is not None for layer in model.layers.values())
    assert [n for n, _ in model.named_parameters()] == names
    assert compile_from_config([model], ParallelMesh.single(), parse_job(["--seq-length", "16"])) is None
    fp8 = JobConfig.from_flags({"seq_length": 16, "torch_compile": True, "fp8_format": "hybrid"})
    with pytest.raises(CompileLayoutError, match="--torch-compile with --fp8-format"):
        compile_from_config([model], ParallelMesh.single(), fp8)


def test_the_first_step_is_announced_and_timed(capsys):
    """pretrain_gpt.py in this process (one rank, mock data): with --torch-compile one note
    before the first step says it compiles, at --log-interval 1 as well, and that step is kept
    out of the ETA; without it the first-step line gives the ETA of the other iterations (issue
    34). The default attention dropout (0.1, no preset) compiles with graph breaks around the RNG
    fork (fullgraph stopped at torch.get_rng_state) and trains like eager."""
    import os
    import re
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import pretrain_gpt
    tiny = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "3", "--eval-iters", "0"]
    compiled = ["--torch-compile", "--torch-compile-backend", "eager"]
    outputs = []
    try:
        for argv in (tiny + compiled + ["--log-interval", "1"],
                     tiny + compiled + ["--log-interval", "3"], tiny + ["--log-interval", "3"]):
            pretrain_gpt.main(argv)
            outputs.append(capsys.readouterr().out)
    finally:
        reset()
    note = ("> compiling the model on the first step (--torch-compile, backend eager: some "
            "seconds; the steps after it run the compiled layers) ...")
    every, once, eager = outputs
    assert "backend eager (graphs around attention dropout's RNG fork)" in every, every
    losses = [re.findall(r"lm loss: (\S+) \|", out) for out in outputs]
    assert len(losses[0]) == 3, losses
    assert losses[0][-1] == losses[1][-1] == losses[2][-1], losses       # compiled = eager
    for out in (every, once):
        assert out.count(note) == 1 and out.index(note) < out.index(" iteration "), out
    lines = [line for line in every.splitlines() if line.startswith(" iteration ")]
    assert len(lines) == 3 and "ETA" not in lines[0] and "ETA" in lines[1], lines  # no compile ETA
    assert "> first step (iteration" not in every     # its log line follows at once
    assert "> first step (iteration 1) done in " in once and "(compiling included); the log line " \
        "follows every 3 iterations" in once and "ETA" not in once.split(" iteration ")[0], once
    assert note not in eager and "compiling" not in eager
    assert re.search(r"> first step \(iteration 1\) done in [\d.]+ s; at that pace the other 2 "
                     r"iterations take about \d+s \(ETA\); the log line follows every 3 "
                     r"iterations", eager), eager
