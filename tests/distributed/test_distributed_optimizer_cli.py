"""pretrain_gpt.py --use-distributed-optimizer under torchrun (dp2, with --optimizer-cpu-offload,
--overlap-param-gather and --report-memory) reproduces the one-rank loss curve: 1e-5 relative on
every logged training and validation loss; --report-memory prints and records the model-state
bytes (the flag refusals: tests/unit/test_sharding.py)."""
import json

from megatron_sp.testing import assert_same_curve

from test_pretrain_torchrun import _launch


def test_dp2_distributed_optimizer_offload_matches_one_rank(tmp_path):
    flags = ["--use-distributed-optimizer", "--optimizer-cpu-offload", "--overlap-param-gather",
             "--overlap-grad-reduce", "--report-memory"]
    procs = {"one": _launch(1, [], tmp_path / "one.jsonl"),
             "dp2": _launch(2, flags, tmp_path / "dp2.jsonl")}
    for name, p in procs.items():
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"{name}:\n{out[-4000:]}"
        if name == "dp2":
            assert "model state per rank (MB): device" in out and "host" in out, out[-2000:]
    assert_same_curve(tmp_path / "one.jsonl", tmp_path / "dp2.jsonl", train=4, valid=1)
    with open(tmp_path / "dp2.jsonl") as f:
        record = json.loads(f.readline())
    assert record["model_state_optim_host_bytes"] > 0 and record["model_state_optim_device_bytes"] == 0
