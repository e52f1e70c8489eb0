"""tools/plan_parallel.py on a mixture-of-experts preset, as a user runs it (a subprocess from the
checkout): the total and active parameters, the ep column and --expert-model-parallel-size in the
plans' flags; a size that does not divide the experts refused in one line with a non-zero exit
status, no traceback."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--model", "qwen3-30b-a3b", "--seq-length", "32768", "--num-gpus", "64",
        "--global-batch-size", "64", "--no-ring", "--top", "4"]


def _run(*argv):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan_parallel.py"), *argv],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_plan_parallel_plans_a_moe_preset_with_expert_parallelism():
    done = _run(*BASE, "--expert-model-parallel-size", "8")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("model: 30.53B parameters, 3.35B active (top-8 of 128 experts")
    header = next(line for line in lines if line.split()[:1] == ["#"])
    assert "ep" in header.split() and max(len(line) for line in lines) <= 120
    assert done.stdout.count("--expert-model-parallel-size 8") == 4
    bad = _run(*BASE, "--expert-model-parallel-size", "48")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "error: --expert-model-parallel-size 48 does not divide num_experts=128: choose one of "
        "[1, 2, 4, 8, 16, 32, 64, 128]."]
