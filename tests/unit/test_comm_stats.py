"""megatron_sp.comm_stats: exact counts, also inside torch.compile'd code once kept out of graphs,
and no torch._dynamo import for a run that never compiles (it costs about a second per process)."""
import subprocess
import sys

import torch

from megatron_sp import comm_stats


def test_counts_inside_a_compiled_function_are_exact_and_not_traced():
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    comm_stats.keep_out_of_graphs()
    comm_stats.keep_out_of_graphs()                    # idempotent: one wrapper
    assert comm_stats.record is not comm_stats._count
    counter = CompileCounter()

    def step(x, nbytes):
        comm_stats.record("test/compiled", nbytes)
        return x * 2

    compiled = torch.compile(step, backend=counter)
    comm_stats.reset()
    sizes = [int(n) for n in torch.randperm(1000)[:3] + 1]       # three different fresh sizes
    for n in sizes:
        compiled(torch.randn(4), n)
    assert comm_stats.snapshot()["test/compiled"] == sum(sizes)
    assert comm_stats.calls()["test/compiled"] == 3
    # one graph of x * 2 for the three sizes (traced, record would guard on each size: 3 frames)
    assert counter.frame_count == 1 and counter.op_count == 1
    comm_stats.reset()


def test_importing_the_training_script_does_not_import_dynamo():
    code = ("import sys, pretrain_gpt, megatron_sp.training, megatron_sp.models; "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr
