"""Sharded model state without processes: FSDP2's row arithmetic, start-up refusals, and the
replicated mode's measured model-state bytes against docs/design.md §11 (16 bytes per parameter)."""
import pytest
import torch

from megatron_sp.cli.build import parse_job
from megatron_sp.errors import ConfigError
from megatron_sp.mesh import ParallelMesh
from megatron_sp.models import GPTModel, preset
from megatron_sp.training.optimizer import build_optimizer
from megatron_sp.sharding import Replicated
from megatron_sp.sharding.fsdp import FSDPLayoutError, check_shardable, fsdp_rows


def test_fsdp_rows_cover_the_slice_once_like_torch_chunk():
    for rows in (1, 5, 8, 13, 1376):
        for n in (1, 2, 3, 4, 8):
            spans = [fsdp_rows(rows, n, i) for i in range(n)]
            chunks = torch.arange(rows).chunk(n)
            expected = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
            assert [s for s in spans if s[1] > s[0]] == expected, (rows, n)


def test_fused_rows_that_would_straddle_parts_are_refused_at_start_up():
    model = GPTModel(preset("llama-tiny"))      # fc1: 2 x 688 fused SwiGLU rows
    for n in (1, 2, 4, 8):
        check_shardable([model], n)
    with pytest.raises(FSDPLayoutError, match="straddling two parts"):
        check_shardable([model], 3)             # 459 rows per rank: rank 1 holds [459, 918)


@pytest.mark.parametrize("argv, message", [
    (["--optimizer-cpu-offload"], "error: --optimizer-cpu-offload acts on sharded model state: add "
                                  "--use-distributed-optimizer or --use-torch-fsdp2."),
    (["--overlap-param-gather"], "error: --overlap-param-gather acts on sharded model state: add "
                                 "--use-distributed-optimizer or --use-torch-fsdp2."),
    (["--use-torch-fsdp2", "--use-distributed-optimizer"],
     "error: --use-torch-fsdp2 and --use-distributed-optimizer are two sharding modes: choose one."),
])
def test_refused_flag_combinations_say_one_sentence(argv, message, capsys):
    with pytest.raises(ConfigError) as err:       # run_main prints it as "error: <message>"
        parse_job(argv)
    assert f"error: {err.value}" == message


@pytest.mark.parametrize("argv", [
    ["--use-distributed-optimizer", "--optimizer-cpu-offload", "--overlap-param-gather",
     "--overlap-grad-reduce"],
    ["--use-torch-fsdp2", "--optimizer-cpu-offload"],
])
def test_accepted_sharded_state_flags(argv):
    args = parse_job(argv).parallel
    assert args.optimizer_cpu_offload and args.use_distributed_optimizer != args.use_torch_fsdp2


def test_replicated_model_state_bytes_are_sixteen_per_parameter():
    torch.manual_seed(3)
    model = GPTModel(preset("gpt2-tiny"))
    optimizer = build_optimizer([model], lr=1e-3)
    model(input_ids=torch.randint(0, 100, (1, 8)), labels=torch.randint(0, 100, (1, 8))).sum().backward()
    optimizer.step()
    report = Replicated([model], ParallelMesh.single()).model_state_bytes(optimizer)
    p = sum(t.numel() for t in model.parameters())
    assert report["params_device_bytes"] == report["grads_device_bytes"] == 4 * p
    assert report["optim_device_bytes"] == 8 * p
    assert report["device_bytes"] == 16 * p and report["host_bytes"] == 0
