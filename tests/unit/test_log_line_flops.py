"""The log line's FLOP/s keeps enough digits on a CPU (issue 16): 0.0123 TFLOP/s, not 0.00."""
import pytest

from megatron_sp.training import format_log_line


@pytest.mark.parametrize("tflops,shown", [(0.0123456, "0.0123"), (0.000456, "0.000456"),
                                          (0.5, "0.5"), (312.456, "312.46")])
def test_tflops_digits(tflops, shown):
    record = {"iteration": 3, "consumed_samples": 12, "ms_per_iter": 10.0, "lr": 1e-4,
              "lm_loss": 5.0, "grad_norm": 1.0, "tokens_per_sec": 100.0, "tflops_per_gpu": tflops}
    assert f"TFLOP/s/GPU: {shown} |" in format_log_line(record, 10) + " |"
