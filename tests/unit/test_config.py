"""megatron_sp.config: the command line becomes one frozen, typed JobConfig at the edge.

Checked here: every flag lands in exactly one section (or is a Megatron-LM flag that the edge maps
or ignores), the sections are frozen and every field says which flag sets it, the values Megatron-LM
derives from other flags are derived, each refusal is one sentence, the flat record stored with a
checkpoint keeps the namespace's keys, and the library past the edge never reads an argparse
namespace (the seam itself, read from the source)."""
from __future__ import annotations

import ast
import dataclasses
import glob
import os

import pytest

from megatron_sp.cli import megatron_compat
from megatron_sp.cli.arguments import build_parser, parse_args
from megatron_sp.cli.build import job_config, parse_job
from megatron_sp.config import SECTIONS, JobConfig, TrainingConfig
from megatron_sp.errors import ConfigError
from megatron_sp.training.rampup import BatchSizeRampup

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOT_FLAGS = {"checkpoint_vocab_size",   # resolved at the edge from a checkpoint, not parsed
             "fp8_backend"}             # resolved at the edge from the installed libraries


def _compat_dests() -> set[str]:
    """The Megatron-LM-only flags (mapped, no-op, refused): the edge consumes them."""
    flags = set(megatron_compat.MAPPED) | set(megatron_compat.NOOP) | set(megatron_compat.REFUSED)
    return {f[2:].replace("-", "_") for f in flags}


def test_every_flag_has_exactly_one_section():
    dests = {a.dest for a in build_parser()._actions if a.dest != "help"}
    owners = {}
    for name, section in SECTIONS.items():
        for f in dataclasses.fields(section):
            assert f.name not in owners, f"{f.name} is in {owners.get(f.name)} and {name}"
            owners[f.name] = name
    assert dests - set(owners) == _compat_dests() - set(owners)
    assert set(owners) - dests == NOT_FLAGS


def test_sections_are_frozen_and_every_field_names_its_flag():
    job = parse_job(["--seq-length", "16"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.training.train_iters = 5
    with pytest.raises(TypeError):
        job.command_line["train_iters"] = 5          # the record is read-only too
    classes = [n for path in sorted(glob.glob(os.path.join(ROOT, "megatron_sp", "config", "*.py")))
               for n in ast.parse(open(path).read()).body if isinstance(n, ast.ClassDef)]
    wanted = {s.__name__ for s in SECTIONS.values()} | {"JobConfig"}
    assert wanted <= {c.name for c in classes}      # the megatron_sp/config/ package holds them all
    for cls in (c for c in classes if c.name in wanted):
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                doc = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), \
                    f"{cls.name}.{node.target.id} has no docstring"
                name = node.target.id
                if cls.name != "JobConfig" and name not in NOT_FLAGS:
                    assert doc.value.value.startswith("--"), f"{cls.name}.{name}: {doc.value.value}"


@pytest.mark.parametrize("argv, expected", [
    ([], dict(global_batch_size=1, train_iters=100, lr_decay_iters=100, lr_warmup_iters=0)),
    (["--micro-batch-size", "4", "--train-samples", "96", "--lr-warmup-fraction", "0.25"],
     dict(global_batch_size=4, train_iters=24, lr_decay_iters=24, lr_warmup_iters=6)),
    (["--train-iters", "50", "--lr-decay-iters", "40", "--eval-iters", "-1"],
     dict(train_iters=50, lr_decay_iters=40, eval_iters=0)),
])
def test_megatron_defaults_are_derived_in_the_section(argv, expected):
    training = parse_job(["--seq-length", "16"] + argv).training
    assert {k: getattr(training, k) for k in expected} == expected


def test_rampup_train_iters_and_resumed_end_iteration():
    """--train-samples under a ramp: Megatron's update_train_iters; after a resume with another
    batch size the run stops when the samples still due are consumed."""
    t = TrainingConfig(global_batch_size=8, micro_batch_size=1, train_samples=100,
                       rampup_batch_size=(2, 2, 12))
    assert t.train_iters == BatchSizeRampup(2, 2, 12, 8).train_iters(100) == t.end_iteration()
    assert t.counts_samples and t.rampup() == BatchSizeRampup(2, 2, 12, 8)
    constant = TrainingConfig(global_batch_size=8, train_samples=100)
    assert constant.train_iters == constant.end_iteration() == 12
    assert constant.end_iteration(iteration=5, consumed_samples=20) == 5 + 80 // 8
    assert TrainingConfig(train_iters=7).end_iteration(iteration=3, consumed_samples=99) == 7


@pytest.mark.parametrize("flags, words", [
    (dict(fp16=True, bf16=True), "--fp16 and --bf16 contradict each other"),
    (dict(rotary_percent=0.0), "--rotary-percent must be in (0, 1]"),
    (dict(decoupled_min_lr=1e-5), "--decoupled-min-lr needs --decoupled-lr"),
    (dict(recompute_method="uniform"), "need --recompute-granularity full"),
    (dict(mlp_tiles="two"), "--mlp-tiles must be a positive integer or 'auto'"),
    (dict(pipeline_model_parallel_size=0), "--pipeline-model-parallel-size must be >= 1"),
    (dict(decoder_first_pipeline_num_layers=2), "needs --pipeline-model-parallel-size > 1"),
    (dict(use_torch_fsdp2=True, use_distributed_optimizer=True), "two sharding modes"),
    (dict(optimizer_cpu_offload=True), "acts on sharded model state"),
    (dict(nonfinite_loss="ignore"), "--nonfinite-loss 'ignore' is not one of"),
    (dict(max_skipped_steps=0), "--max-skipped-steps must be at least 1"),
    (dict(lr_decay_samples=10), "--lr-decay-samples counts the schedule in samples"),
    (dict(global_batch_size=8, rampup_batch_size=(3, 2, 10)), "multiple of INCR"),
    (dict(profile=True, profile_step_start=5, profile_step_end=3), "--profile-step-end 3 is before"),
    (dict(load="ck", override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True),
     "contradict each other: pass one of them"),
])
def test_each_rule_is_one_sentence(flags, words):
    with pytest.raises(ConfigError) as err:
        JobConfig.from_flags(flags)
    message = str(err.value)
    assert words in message and "\n" not in message and message.endswith(".")


@pytest.mark.parametrize("argv, words", [
    (["--split", "0,0,0"], "--split 0,0,0 gives every split a weight of 0"),
    (["--split", "98,-2,4"], "--split 98,-2,4 gives a split the negative weight -2"),
    (["--split", "98;2"], "--split 98;2: '98;2' is not a number"),
    (["--split", "0,100,0"], "--split 0,100,0 gives the training split a weight of 0 (no documents) "
                             "but --train-iters 100 asks for training"),
    (["--split", "0/100/0", "--train-samples", "64"], "--split 0/100/0 gives the training split a "
                                                      "weight of 0 (no documents) but "
                                                      "--train-samples 64 asks for training"),
])
def test_split_is_checked_at_the_edge(argv, words):
    """--split in the typed config (issue 34): one sentence naming the flag and the value, not a
    TypeError after the model is built, nor '98,-2,4' read as 98,2,4."""
    from megatron_sp.errors import UserError
    with pytest.raises(UserError) as err:
        parse_job(["--seq-length", "16"] + argv)
    message = str(err.value)
    assert message.startswith(words) and "\n" not in message and message.endswith(".")


@pytest.mark.parametrize("argv, weights", [
    (["--split", "949/50/1"], [949.0, 50.0, 1.0]), (["--split", "1"], [1.0, 0.0, 0.0]),
    (["--split", "0,100,0", "--train-iters", "0"], [0.0, 100.0, 0.0]),    # evaluation only
    (["--split", "0,100,0", "--mock-data"], [0.0, 100.0, 0.0]),           # no documents read
])
def test_split_forms_megatron_accepts(argv, weights):
    assert parse_job(["--seq-length", "16"] + argv).data.split_weights() == weights


def test_unknown_field_is_a_type_error_in_code():
    with pytest.raises(TypeError, match="trian_iters"):
        JobConfig.from_flags({"trian_iters": 3})


def test_record_keeps_the_namespace_keys_with_resolved_values():
    """What a checkpoint stores as "args": the parsed namespace's keys, the sections' values."""
    args = parse_args(["--seq-length", "16", "--micro-batch-size", "2", "--mlp-tiles", "3",
                       "--context-parallel-size", "2", "--cp-comm-type", "a2a", "--use-flash-attn"])
    record = job_config(args).flags()
    assert set(record) == set(vars(args))
    assert record["global_batch_size"] == 2 and record["mlp_tiles"] == 3
    assert record["sequence_parallel_size"] == 2 and record["context_parallel_size"] == 2
    assert record["megatron_notes"] == args.megatron_notes != []


def _namespace_reads(path: str) -> list[str]:
    """`args.x` reads in a module (an argparse namespace called args)."""
    tree = ast.parse(open(path).read())
    return [f"{os.path.relpath(path, ROOT)}:{n.lineno} args.{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "args"]


def test_the_library_never_reads_the_namespace():
    """Past the command-line edge (megatron_sp/cli, pretrain_gpt.py, tools/) only configs travel."""
    files = [p for pattern in ("megatron_sp/**/*.py", "models/*.py", "data/*.py")
             for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)
             if os.sep + "cli" + os.sep not in p]
    assert len(files) > 40
    reads = [r for p in files for r in _namespace_reads(p)]
    assert reads == []
    assert _namespace_reads(os.path.join(ROOT, "megatron_sp", "cli", "build.py"))   # it can see some


def test_errors_is_a_leaf():
    """megatron_sp.errors imports nothing of megatron_sp at import time (every module may import
    it); inside a function it may (the rendezvous' store client, called while reporting)."""
    tree = ast.parse(open(os.path.join(ROOT, "megatron_sp", "errors.py")).read())

    def module_level(node):      # import statements outside any function body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for child in ast.iter_child_nodes(node):
            yield from module_level(child)
    nodes = list(module_level(tree))
    imported = [n.module for n in nodes if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in nodes if isinstance(n, ast.Import) for a in n.names]
    assert imported and not [m for m in imported if m and m.startswith("megatron_sp")]
