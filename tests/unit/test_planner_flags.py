"""tools/plan_parallel.py's printed flags are the whole plan: each plan's printed line, read back
by pretrain_gpt.py's own start-up (load_job: its parser, the Megatron-LM mapping, the JobConfig,
the world-size check) and its model builder (model_config), gives every planned quantity: layout,
ring, batch, sequence, positions, packed documents, model, precision, sharding and each memory
technique; and a long search says how far it is on stderr, never on stdout."""
import contextlib
import io
import json
import re
import shlex

import pytest

from megatron_sp.errors import UserError
from megatron_sp.memory import MemoryOptions
from megatron_sp.mesh import ParallelDims
from megatron_sp.models import preset
from megatron_sp.testing import load_script

plan_parallel = load_script("tools/plan_parallel.py")
pretrain_gpt = load_script("pretrain_gpt.py")

CASES = {
    # the ring alone and around Ulysses, tp 2, pp 2, replicated and FSDP2 state, 2 sequences a step
    "ring": ["--model", "llama-tiny", "--num-gpus", "8", "--seq-length", "65536",
             "--global-batch-size", "2", "--top", "20"],
    # micro-batches of 2, selective recompute, MLP tiles, loss chunks, the optimizer on host
    "memory": ["--model", "llama-1b", "--num-gpus", "8", "--seq-length", "131072",
               "--global-batch-size", "4", "--micro-batch-size", "2", "--gpu-memory-gb", "24"],
    # --max-seq without a preset: full recompute, activation offload, FSDP2 with offload
    "max-seq custom": ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
                       "--num-query-groups", "4", "--vocab-size", "1000", "--num-gpus", "2",
                       "--max-seq", "--gpu-memory-gb", "16"],
    # --max-seq with the ring and the distributed optimizer
    "max-seq ring": ["--model", "llama-tiny", "--num-gpus", "16", "--max-seq", "--sharding",
                     "distributed-optimizer", "--gpu-memory-gb", "8", "--global-batch-size", "2"],
    # --max-seq under a step-time bound: a ring around Ulysses (sp 2 x cp 8), FSDP2
    "max-seq step-bound ring": ["--model", "llama-tiny", "--num-gpus", "16", "--max-seq",
                                "--max-step-seconds", "30", "--gpu-memory-gb", "8",
                                "--global-batch-size", "2"],
    # packed documents (--reset-attention-mask): Ulysses, the hybrid and the ring alone
    "documents": ["--model", "llama-tiny", "--num-gpus", "4", "--seq-length", "16384",
                  "--reset-attention-mask", "--top", "3"],
}
ROW = re.compile(r"^\s*\d+(\s+\d+){4}\s")          # "  1   1   8   1   1   1  none ..."
# Printed for Megatron-LM's launchers (its full recompute needs a method and a layer count), but
# equal to what pretrain_gpt.py assumes under --recompute-granularity full without them.
RESTATED_DEFAULTS = {"--recompute-method", "--recompute-num-layers"}


def _tool(argv) -> str:
    """plan_parallel's stdout for argv (it must succeed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_parallel.main(argv) == 0
    return out.getvalue()


def _table_flags(out: str) -> list[list[str]]:
    """The flag lines under each row of the printed table, one argv per plan."""
    plans = []
    for line in out.splitlines():
        if ROW.match(line):
            plans.append([])
        elif plans and line.lstrip().startswith("--"):
            plans[-1] += shlex.split(line)
    return plans


def _planned(argv) -> list[tuple[list[str], dict, object]]:
    """(the printed argv, the plan's JSON, the model the planner assumed) for each plan of argv."""
    data = json.loads(_tool(argv + ["--json"]))
    plans = data["plans"] if "plans" in data else [data["plan"]]
    printed = _table_flags(_tool(argv))
    assert plans and len(printed) == len(plans)
    seq = data.get("max_seq") or data.get("seq_length")
    args = plan_parallel.parse_args(argv)
    out = []
    for flags, d in zip(printed, plans):
        assert flags == shlex.split(d["flags"])            # the table's line is the JSON's
        assert d["seq_length"] == seq == (args.seq_length or data["max_seq"])
        out.append((flags, d, plan_parallel.build_config(args, seq)))
    return out


@pytest.fixture(scope="module")
def cases():
    return {name: _planned(argv) for name, argv in CASES.items()}


def _world(name: str) -> int:
    argv = CASES[name]
    return int(argv[argv.index("--num-gpus") + 1])


def _expected(d: dict, cfg) -> dict:
    """The plan's quantities (its JSON), as _ran reports them."""
    keys = ("tp", "sp", "cp", "pp", "dp", "micro_batch", "global_batch", "seq_length",
            "max_position_embeddings", "sequence_parallel", "sharding", "cpu_offload", "documents")
    return {**{k: d[k] for k in keys}, "bf16": True, "memory": MemoryOptions(**d["memory"]),
            "model": cfg}


def _ran(flags: list[str], world: int, monkeypatch) -> dict:
    """What pretrain_gpt.py runs for `flags` on `world` processes (mock data: the data flags are
    not the planner's), in _expected's terms."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    job, embedded = pretrain_gpt.load_job(flags + ["--mock-data"])
    assert not embedded
    par, tr = job.parallel, job.training
    dims = ParallelDims(world, tp=par.tensor_model_parallel_size, sp=par.sequence_parallel_size,
                        pp=par.pipeline_model_parallel_size, cp=par.ring_size)
    dims.check_sequence(tr.seq_length, par.sequence_parallel)
    # the vocabulary is the tokenizer's: the one the flags name, else the preset's own tokenizer's
    vocab = job.data.vocab_size or (preset(job.model.model).vocab_size if job.model.model else None)
    model = pretrain_gpt.model_config(job, vocab) if vocab else None
    if model is not None:
        model.check_parallel(dims.tp, dims.sp, dims.pp)
    sharding = ("fsdp" if par.use_torch_fsdp2 else
                "distributed-optimizer" if par.use_distributed_optimizer else "none")
    return {"tp": dims.tp, "sp": dims.sp, "cp": dims.cp, "pp": dims.pp, "dp": dims.dp,
            "micro_batch": tr.micro_batch_size, "global_batch": tr.global_batch_size,
            "seq_length": tr.seq_length,
            "max_position_embeddings": model and model.max_position_embeddings,
            "sequence_parallel": par.sequence_parallel, "sharding": sharding,
            "documents": job.data.reset_attention_mask,
            "cpu_offload": par.optimizer_cpu_offload, "bf16": job.precision.bf16,
            "memory": MemoryOptions.from_config(job.memory), "model": model}


def test_printed_flags_run_each_plan(cases, monkeypatch):
    """Every printed plan, read back by pretrain_gpt.py, is the plan; the cases between them have
    the ring alone and around Ulysses, tp and pp > 1, each sharding mode and offload, and each
    memory technique (normal and --max-seq mode)."""
    seen = set()
    for name, plans in cases.items():
        for flags, d, cfg in plans:
            assert _ran(flags, _world(name), monkeypatch) == _expected(d, cfg), (name, flags)
            m = d["memory"]
            seen |= {("ring alone", d["cp"] > 1 and d["sp"] == 1),
                     ("ring and Ulysses", d["cp"] > 1 and d["sp"] > 1), ("tp", d["tp"] > 1),
                     ("pp", d["pp"] > 1), ("micro-batches", d["micro_batch"] > 1),
                     (d["sharding"], True), ("optimizer offload", d["cpu_offload"]),
                     (m["recompute_granularity"], True), ("tiles", m["mlp_tiles"] > 1),
                     ("chunks", m["loss_chunks"] > 1), ("offload", m["offload_activations"]),
                     ("max-seq", name.startswith("max-seq") and d["cp"] > 1),
                     ("documents", d["documents"])}
    wanted = {"ring alone", "ring and Ulysses", "tp", "pp", "micro-batches", "none",
              "distributed-optimizer", "fsdp", "optimizer offload", "selective", "full", "tiles",
              "chunks", "offload", "max-seq", "documents"}
    assert {k for k, on in seen if on} >= wanted


def test_step_bound_plan_keeps_its_bound_and_its_flags_run_it(cases, monkeypatch):
    """--max-seq --max-step-seconds 30: the plan's estimated step is within 30 s, it has a ring,
    and its printed line (with --seq-length) runs exactly that layout and length."""
    (flags, d, cfg), = cases["max-seq step-bound ring"]
    assert d["cp"] > 1 and d["sp"] > 1 and 0 < d["step_s"] <= 30
    assert d["step_s"] == d["compute_s"] + d["comm_s"]
    ran = _ran(flags, _world("max-seq step-bound ring"), monkeypatch)
    assert (ran["tp"], ran["sp"], ran["cp"], ran["pp"], ran["seq_length"]) == \
        (d["tp"], d["sp"], d["cp"], d["pp"], d["seq_length"])


def _groups(flags: list[str]) -> list[list[str]]:
    """flags split into one list per flag and its values."""
    groups = []
    for tok in flags:
        if tok.startswith("--"):
            groups.append([tok])
        else:
            groups[-1].append(tok)
    return groups


def test_each_printed_flag_is_needed_by_some_plan(cases, monkeypatch):
    """Dropping any printed flag from some plan's line runs something else (or is refused), so
    the previous test fails when the tool drops a flag; only RESTATED_DEFAULTS never matter."""
    needed, printed = set(), set()
    for name, plans in cases.items():
        for flags, d, cfg in plans:
            want = _expected(d, cfg)
            for i, group in enumerate(_groups(flags)):
                printed.add(group[0])
                if group[0] in needed:
                    continue
                rest = [t for j, g in enumerate(_groups(flags)) if j != i for t in g]
                try:
                    differs = _ran(rest, _world(name), monkeypatch) != want
                except (UserError, ValueError, SystemExit, TypeError):
                    differs = True    # refused (TypeError: no --model and no --num-layers)
                if differs:
                    needed.add(group[0])
    assert printed - needed == RESTATED_DEFAULTS & printed
    assert {"--seq-length", "--max-position-embeddings", "--global-batch-size", "--bf16",
            "--context-parallel-size", "--hierarchical-context-parallel-sizes", "--model",
            "--vocab-size", "--offload-activations", "--mlp-tiles", "--loss-chunks",
            "--reset-attention-mask"} <= needed


def test_progress_line_goes_to_stderr_and_json_stays_clean(capsys):
    """--progress-interval 0: a line on stderr after every layout tried, in both modes, while
    stdout holds only the JSON; by default (stderr not a terminal, as under pytest) none."""
    small = ["--model", "llama-tiny", "--num-gpus", "2", "--json"]
    for mode in (["--seq-length", "8192"], ["--max-seq", "--gpu-memory-gb", "6"]):
        assert plan_parallel.main(small + mode + ["--progress-interval", "0"]) == 0
        out, err = capsys.readouterr()
        json.loads(out)
        lines = err.splitlines()
        assert lines and all(line.startswith("plan_parallel: ") for line in lines)
        assert ("sequence lengths" in lines[-1]) == ("--max-seq" in mode)
        assert plan_parallel.main(small + mode) == 0
        out, err = capsys.readouterr()
        assert err == "" and json.loads(out)


def test_progress_line_waits_for_its_interval():
    """A line only once `interval` seconds have passed since the last (a fake clock), with what
    was tried and the best so far."""
    now = [0.0]
    stream = io.StringIO()
    line = plan_parallel.ProgressLine(5.0, max_seq=True, stream=stream, clock=lambda: now[0])
    for t, seq, fits in ((1.0, 1024, True), (4.9, 2048, True), (6.0, 4096, False),
                         (8.0, 3072, True), (11.0, 3072, True)):
        now[0] = t
        line.length(seq, fits)
    assert stream.getvalue().splitlines() == [
        "plan_parallel: 3 sequence lengths (longest that fits so far 2048 tokens), 0 layouts "
        "tried, 6 s",
        "plan_parallel: 5 sequence lengths (longest that fits so far 3072 tokens), 0 layouts "
        "tried, 11 s"]
