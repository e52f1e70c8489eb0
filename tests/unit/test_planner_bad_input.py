"""tools/plan_parallel.py, bad numbers (docs/design.md §12): argparse took 0, negative sizes, nan
and inf, which ended in a ZeroDivisionError traceback (--num-gpus 0, --mfu 0), plans for "global
batch 0", "loss_chunks must be a positive integer" (--seq-length 0) or "no feasible layout: more
GPUs..." (--num-gpus -8, --gpu-memory-gb 0 / nan). Each is now one sentence naming the flag; a
global batch no layout can split says so instead of asking for more GPUs."""
from __future__ import annotations

import json

import pytest

from megatron_sp.testing import load_script

plan_parallel = load_script("tools/plan_parallel.py")
BASE = ["--model", "llama-tiny", "--seq-length", "4096"]


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        plan_parallel.parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    return last.split(": error: ", 1)[1]      # argparse's "<prog>: error: " (prog: pytest's)


@pytest.mark.parametrize("flags, sentence", [
    (["--num-gpus", "0"], "--num-gpus must be a positive integer, got 0"),
    (["--num-gpus", "-8"], "--num-gpus must be a positive integer, got -8"),
    (["--num-gpus", "4", "--mfu", "0"], "--mfu is a fraction of the peak in (0, 1], got 0"),
    (["--num-gpus", "4", "--mfu", "nan"], "--mfu is a fraction of the peak in (0, 1], got nan"),
    (["--num-gpus", "4", "--global-batch-size", "0"],
     "--global-batch-size must be a positive integer, got 0"),
    (["--num-gpus", "4", "--micro-batch-size", "-1"],
     "--micro-batch-size must be a positive integer, got -1"),
    (["--num-gpus", "4", "--seq-length", "0"], "--seq-length must be a positive integer, got 0"),
    (["--num-gpus", "4", "--seq-length", "-5"], "--seq-length must be a positive integer, got -5"),
    (["--num-gpus", "4", "--gpu-memory-gb", "0"],
     "--gpu-memory-gb must be a positive finite number, got 0"),
    (["--num-gpus", "4", "--gpu-memory-gb", "nan"],
     "--gpu-memory-gb must be a positive finite number, got nan"),
    (["--num-gpus", "4", "--gpu-memory-gb", "inf"],
     "--gpu-memory-gb must be a positive finite number, got inf"),
    (["--num-gpus", "4", "--peak-tflops", "-1"],
     "--peak-tflops must be a positive finite number, got -1"),
    (["--num-gpus", "4", "--inter-node-gbps", "0"],
     "--inter-node-gbps must be a positive finite number, got 0"),
    (["--num-gpus", "4", "--host-memory-gb", "nan"],
     "--host-memory-gb must be a positive finite number, got nan"),
    (["--num-gpus", "4", "--reserve-gb", "-1"],
     "--reserve-gb must be a finite number of GB >= 0, got -1"),
    (["--num-gpus", "4", "--fragmentation", "1"], "--fragmentation is a fraction in [0, 1), got 1"),
    (["--num-gpus", "4", "--gpu-memory-gb", "4"],
     "--reserve-gb 4 leaves nothing of --gpu-memory-gb 4: give the GPU's memory, or a smaller "
     "reserve"),
    (["--num-gpus", "4", "--gpus-per-node", "0"],
     "--gpus-per-node must be a positive integer, got 0"),
    (["--num-gpus", "4", "--global-batch-size", "3", "--micro-batch-size", "2"],
     "--global-batch-size 3 is not a multiple of --micro-batch-size 2: no layout can split it "
     "into micro-batches; give a multiple of 2 x the data-parallel size (e.g. "
     "--global-batch-size 4)"),
])
def test_numbers_out_of_range_are_one_sentence_naming_the_flag(flags, sentence, capsys):
    argv = BASE[:2] + (flags if "--seq-length" in flags else BASE[2:] + flags)
    assert _usage_error(argv, capsys) == sentence


def test_the_global_batch_is_named_when_it_is_the_cause(capsys):
    assert plan_parallel.main(BASE + ["--num-gpus", "3"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "no feasible layout for --global-batch-size 1: the layouts that fit 3 GPUs have a "
        "data-parallel size (dp 3) that does not divide its 1 micro-batch(es) of 1; give "
        "--global-batch-size 3 (a multiple of --micro-batch-size x dp).")
    assert plan_parallel.main(BASE + ["--num-gpus", "3", "--json"]) == 1
    said = json.loads(capsys.readouterr().out)
    assert said["plans"] == [] and said["no_layout"].startswith(
        "no feasible layout for --global-batch-size 1: "), said
    assert plan_parallel.main(BASE + ["--num-gpus", "3", "--global-batch-size", "3"]) == 0
    capsys.readouterr()
    # Memory, not the batch: the usual advice.
    assert plan_parallel.main(["--model", "llama-tiny", "--seq-length", "4194304", "--num-gpus",
                               "1", "--gpu-memory-gb", "5", "--reserve-gb", "1"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "no feasible layout: more GPUs, more memory, a sharding mode, or a shorter sequence.")


@pytest.mark.parametrize("build, sentence", [
    (lambda H, W: H(0), "Hardware.num_gpus (--num-gpus) must be an integer >= 1, got 0."),
    (lambda H, W: H(-8), "Hardware.num_gpus (--num-gpus) must be an integer >= 1, got -8."),
    (lambda H, W: H(4, mfu=0.0), "Hardware.mfu is a fraction in (0, 1], got 0.0."),
    (lambda H, W: H(4, gpu_mem_gb=float("nan")),
     "Hardware.gpu_mem_gb must be a positive finite number, got nan."),
    (lambda H, W: H(4, peak_tflops=0.0),
     "Hardware.peak_tflops must be a positive finite number, got 0.0."),
    (lambda H, W: H(4, reserve_gb=-1.0), "Hardware.reserve_gb must be a finite number >= 0, got -1.0."),
    (lambda H, W: W(4096, global_batch=0),
     "Workload.global_batch (--global-batch-size) must be an integer >= 1, got 0."),
    (lambda H, W: W(-5), "Workload.seq (--seq-length) must be an integer >= 0, got -5."),
    (lambda H, W: W(4096, global_batch=3, micro_batch=2),
     "Workload.global_batch 3 (--global-batch-size) is not a multiple of micro_batch 2 "
     "(--micro-batch-size): no layout can split it into micro-batches."),
])
def test_the_planner_library_edge_refuses_the_same(build, sentence):
    """megatron_sp.memory.planner's Hardware and Workload (the library's entry, without the tool)."""
    from megatron_sp.memory.planner import Hardware, Workload
    with pytest.raises(ValueError) as err:
        build(Hardware, Workload)
    assert str(err.value) == sentence
