"""pretrain_gpt.py --use-distributed-optimizer on two ranks (dp2, with --optimizer-cpu-offload,
--overlap-param-gather and --report-memory) reproduces the one-rank loss curve: 1e-5 relative on
every logged training and validation loss; --report-memory prints and records the model-state
bytes (the flag refusals: tests/unit/test_sharding.py). Both runs' ranks are forked with the
launcher's environment set by hand (run_script; torchrun itself: test_pretrain_torchrun.py)."""
import json

from megatron_sp.testing import assert_same_curve

from test_pretrain_torchrun import _run


def test_dp2_distributed_optimizer_offload_matches_one_rank(tmp_path):
    flags = ["--use-distributed-optimizer", "--optimizer-cpu-offload", "--overlap-param-gather",
             "--overlap-grad-reduce", "--report-memory"]
    _run(1, [], tmp_path / "one.jsonl", "one")
    out = _run(2, flags, tmp_path / "dp2.jsonl", "dp2")
    assert "model state per rank (MB): device" in out and "host" in out, out[-2000:]
    assert_same_curve(tmp_path / "one.jsonl", tmp_path / "dp2.jsonl", train=4, valid=1)
    with open(tmp_path / "dp2.jsonl") as f:
        record = json.loads(f.readline())
    assert record["model_state_optim_host_bytes"] > 0 and record["model_state_optim_device_bytes"] == 0
