"""pretrain_gpt's start-up checks, fifth round of bad input (docs/design.md §12): one sentence naming
the flag before any work, or the right behaviour with a note.

- every float flag refuses inf and nan (one sweep over the parser: argparse's float() takes them);
- the MoE coefficients and factors refuse inf in the config too (the library edge);
- a capacity factor over num_experts / topk is no capacity (1e9 with padding tried to allocate
  65 TB at step 1): refused naming the bound;
- --offload-pool-gb: negative, nan, inf, over the host's memory refused; a note where it does
  nothing;
- --moe-layer-freq "[1,1]" resumes a checkpoint saved with --moe-layer-freq 1 (the same layers).
"""
from __future__ import annotations

import os
import sys

import pytest

from megatron_sp.cli.arguments import build_parser, parse_args
from megatron_sp.cli.build import parse_job
from megatron_sp.cli.flag_checks import float_flags, offload_pool_notes
from megatron_sp.config import MemoryConfig, ModelFlags
from megatron_sp.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4"]
FLOAT_FLAGS = sorted(max(a.option_strings, key=len) for a in float_flags(build_parser()))


def _one_sentence(err) -> str:
    text = str(err.value)
    assert "\n" not in text and text.endswith("."), text
    return text


def test_the_sweep_sees_the_float_flags_of_the_issue():
    for flag in ("--moe-aux-loss-coeff", "--moe-z-loss-coeff", "--moe-router-topk-scaling-factor",
                 "--moe-expert-capacity-factor", "--offload-pool-gb", "--lr", "--clip-grad"):
        assert flag in FLOAT_FLAGS, FLOAT_FLAGS
    assert len(FLOAT_FLAGS) >= 30, FLOAT_FLAGS


@pytest.mark.parametrize("flag", FLOAT_FLAGS)
def test_every_float_flag_refuses_inf_and_nan(flag):
    for value in ("inf", "-inf", "nan"):
        with pytest.raises(ConfigError) as err:
            parse_args(BASE + [f"{flag}={value}"])
        shown = {"inf": "inf", "-inf": "-inf", "nan": "nan"}[value]
        assert _one_sentence(err) == (f"{flag} must be a finite number, got {shown}; give a "
                                      f"finite value (or leave the flag out for its default).")


@pytest.mark.parametrize("field, value, words", [
    ("moe_aux_loss_coeff", float("inf"), "--moe-aux-loss-coeff must be >= 0 and finite, got inf."),
    ("moe_z_loss_coeff", float("inf"), "--moe-z-loss-coeff must be >= 0 and finite, got inf."),
    ("moe_router_topk_scaling_factor", float("inf"),
     "--moe-router-topk-scaling-factor must be > 0 and finite, got inf."),
    ("moe_expert_capacity_factor", float("inf"),
     "--moe-expert-capacity-factor must be > 0 and finite, got inf."),
    ("moe_aux_loss_coeff", float("nan"), "--moe-aux-loss-coeff must be >= 0 and finite, got nan."),
])
def test_the_config_refuses_non_finite_moe_values(field, value, words):
    with pytest.raises(ConfigError) as err:
        ModelFlags(num_layers=2, num_experts=4, **{field: value})
    assert _one_sentence(err) == words


def test_a_capacity_factor_over_experts_per_topk_is_no_capacity():
    moe = BASE + ["--num-experts", "8", "--moe-router-topk", "2"]
    for factor in ("1e9", "4.5"):
        with pytest.raises(ConfigError) as err:
            parse_job(moe + ["--moe-expert-capacity-factor", factor,
                             "--moe-pad-expert-input-to-capacity"])
        assert _one_sentence(err) == (
            f"--moe-expert-capacity-factor {float(factor):g} is no capacity: with 8 experts and "
            f"top-2 routing a factor of 4 already lets an expert take every token of a rank, so "
            f"nothing is dropped (and padding to it only adds zero rows); leave the flag out for "
            f"no dropping, or give a factor <= 4.")
    for factor in ("4", "1.25"):      # at the bound: capacity = the rank's tokens (static shapes)
        job = parse_job(moe + ["--moe-expert-capacity-factor", factor,
                               "--moe-pad-expert-input-to-capacity"])
        assert job.model.moe_expert_capacity_factor == float(factor)
    with pytest.raises(ConfigError, match="a factor of 2 already"):      # the default top-2
        parse_job(BASE + ["--num-experts", "4", "--moe-expert-capacity-factor", "3"])


def test_offload_pool_gb(monkeypatch):
    for value, shown in ((-1.0, "-1"), (float("nan"), "nan"), (float("inf"), "inf")):
        with pytest.raises(ConfigError) as err:
            MemoryConfig(offload_pool_gb=value)
        assert _one_sentence(err) == (
            f"--offload-pool-gb must be a finite number of GiB >= 0 (0: torch's pinned buffers; "
            f"leave it out for the planner's count), got {shown}.")
    with pytest.raises(ConfigError) as err:
        parse_job(BASE + ["--offload-pool-gb", "1e12", "--offload-activations"])
    assert _one_sentence(err).startswith("--offload-pool-gb 1e+12 is more than this host's "
                                         "memory (")
    job = parse_job(BASE + ["--offload-pool-gb", "2"])
    assert ("--offload-pool-gb 2 does nothing without --offload-activations (it sizes the pinned "
            "host pool of the offloaded activations).") in job.notes, job.notes
    args = parse_args(BASE + ["--offload-pool-gb", "2", "--offload-activations"])
    assert offload_pool_notes(args, cuda=False) == [
        "--offload-pool-gb 2 does nothing on this host: the exact pinned pool is for CUDA "
        "devices, and there is none."]
    assert offload_pool_notes(args, cuda=True) == []
    assert parse_job(BASE + ["--offload-pool-gb", "0", "--offload-activations"])  # torch's buffers


def test_moe_layer_freq_compares_the_layers_it_makes_moe():
    from megatron_sp.checkpointing import CheckpointError
    from megatron_sp.checkpointing.format import check_config
    from megatron_sp.models import preset
    saved = preset("llama-tiny", num_layers=4, num_experts=4, moe_layer_freq=1)
    for same in ([1, 1, 1, 1], 1):
        check_config(saved.to_dict(), preset("llama-tiny", num_layers=4, num_experts=4,
                                             moe_layer_freq=same), "c")       # raises nothing
    every_other = preset("llama-tiny", num_layers=4, num_experts=4, moe_layer_freq=2)
    check_config(every_other.to_dict(), preset("llama-tiny", num_layers=4, num_experts=4,
                                                moe_layer_freq=[1, 0, 1, 0]), "c")
    with pytest.raises(CheckpointError, match=r"--moe-layer-freq 2 in the checkpoint but "
                                              r"\[1, 1, 1, 1\] from the command line"):
        check_config(every_other.to_dict(), preset("llama-tiny", num_layers=4, num_experts=4,
                                                    moe_layer_freq=[1, 1, 1, 1]), "c")


def test_moe_layer_freq_list_resumes_an_integer_checkpoint(tmp_path):
    """End to end: saved with --moe-layer-freq 1, resumed with "[1,1]" (was a false refusal)."""
    sys.path.insert(0, ROOT)
    import pretrain_gpt
    run = str(tmp_path / "run")
    flags = BASE + ["--num-experts", "4", "--swiglu", "--eval-iters", "0", "--lr", "1e-3", "--log-interval",
                    "1", "--lr-decay-iters", "10", "--save", run]
    pretrain_gpt.main(flags + ["--train-iters", "1", "--moe-layer-freq", "1"])
    pretrain_gpt.main(flags + ["--train-iters", "2", "--moe-layer-freq", "[1,1]", "--load", run])
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_as_a_user_runs_it_one_sentence_no_traceback():
    """pretrain_gpt.py launched (the runs start together): exit 1, one `error:` line."""
    from test_user_errors import TINY, assert_one_sentence, finish, start
    moe = TINY + ["--num-experts", "4", "--swiglu", "--train-iters", "1"]
    cases = {
        "capacity inf": (moe + ["--moe-expert-capacity-factor", "inf"],
                         "error: --moe-expert-capacity-factor must be a finite number, got inf"),
        "capacity 1e9 padded": (moe + ["--moe-expert-capacity-factor", "1e9",
                                       "--moe-pad-expert-input-to-capacity"],
                                "error: --moe-expert-capacity-factor 1e+09 is no capacity"),
        "aux inf": (moe + ["--moe-aux-loss-coeff", "inf"],
                    "error: --moe-aux-loss-coeff must be a finite number, got inf"),
        "pool -1": (TINY + ["--train-iters", "1", "--offload-pool-gb", "-1"],
                    "error: --offload-pool-gb must be a finite number of GiB >= 0"),
    }
    procs = {name: start(flags) for name, (flags, _) in cases.items()}
    for name, (_, expected) in cases.items():
        assert_one_sentence(*finish(procs[name]), expected)
