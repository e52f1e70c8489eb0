"""Megatron-LM's mixture-of-experts flags on pretrain_gpt.py: parsed into ModelFlags / ParallelConfig,
mapped into GPTConfig (on top of --model llama-tiny), --moe-layer-freq read with ast (never
evaluated), each refusal one sentence, and a two-step run whose log line and metrics carry the
load-balancing loss."""
import json
import re

import pytest

import pretrain_gpt
from megatron_sp.cli.build import parse_job
from megatron_sp.errors import ConfigError
from megatron_sp.training import format_log_line

from test_user_errors import TINY, finish, start

BASE = ["--model", "llama-tiny", "--mock-data", "--seq-length", "32"]
VOCAB = 512


def config_of(argv):
    return pretrain_gpt.model_config(parse_job(BASE + argv), VOCAB)


def assert_one_sentence(err, words):
    message = str(err.value)
    assert words in message, message
    assert "\n" not in message and message.endswith(".") and ". " not in message, message


def test_moe_flags_reach_gpt_config():
    argv = ["--num-experts", "4", "--moe-ffn-hidden-size", "128", "--moe-router-topk", "2",
            "--moe-layer-freq", "2", "--moe-shared-expert-intermediate-size", "64",
            "--moe-router-pre-softmax", "--moe-router-topk-scaling-factor", "2.5",
            "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3",
            "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-expert-capacity-factor",
            "1.5", "--moe-token-dispatcher-type", "alltoall", "--moe-router-dtype", "fp32",
            "--moe-grouped-gemm", "--expert-model-parallel-size", "1",
            "--expert-tensor-parallel-size", "1"]
    job = parse_job(BASE + argv)
    config = pretrain_gpt.model_config(job, VOCAB)
    expected = dict(num_experts=4, moe_ffn_hidden_size=128, moe_router_topk=2, moe_layer_freq=2,
                    moe_shared_expert_intermediate_size=64, moe_router_pre_softmax=True,
                    moe_router_score_function="softmax", moe_router_topk_scaling_factor=2.5,
                    moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
                    moe_router_load_balancing_type="seq_aux_loss", moe_expert_capacity_factor=1.5)
    assert {k: getattr(config, k) for k in expected} == expected
    assert [config.is_moe_layer(i) for i in range(config.num_layers)] == [True, False, True, False]
    assert config.num_layers == 4 and config.activation == "swiglu"    # llama-tiny's
    notes = " ".join(job.notes)
    assert "--moe-token-dispatcher-type alltoall" in notes and "--moe-grouped-gemm" in notes
    sigmoid = config_of(["--num-experts", "4", "--moe-router-score-function", "sigmoid"])
    assert sigmoid.moe_router_score_function == "sigmoid" and sigmoid.moe_router_topk == 2
    assert sigmoid.moe_ffn_hidden_size == sigmoid.ffn_hidden_size    # default: --ffn-hidden-size
    assert config_of([]).num_experts is None                         # dense without the flags


@pytest.mark.parametrize("value,layers", [
    ("2", [1, 0, 1, 0]), ("1", [1, 1, 1, 1]), ("([1]*1+[0]*1)*2", [1, 0, 1, 0]),
    ("[0,1,1,0]", [0, 1, 1, 0]), ("[1]*3+[0]", [1, 1, 1, 0]),
])
def test_moe_layer_freq_forms(value, layers):
    config = config_of(["--num-experts", "4", "--moe-layer-freq", value])
    assert [int(config.is_moe_layer(i)) for i in range(4)] == layers


def test_moe_layer_freq_of_the_wrong_length_is_one_sentence():
    with pytest.raises(ConfigError) as err:             # llama-tiny has 4 layers
        config_of(["--num-experts", "4", "--moe-layer-freq", "([1]*1+[0]*1)*3"])
    assert_one_sentence(err, "--moe-layer-freq gives 6 layers but the model has 4")
    with pytest.raises(ConfigError) as err:             # --num-layers given: at the edge
        parse_job(BASE + ["--num-layers", "2", "--num-experts", "4", "--moe-layer-freq", "[1,0,1]"])
    assert_one_sentence(err, "--moe-layer-freq gives 3 layers but the model has 2")


@pytest.mark.parametrize("value", [
    "__import__('os')", "__import__('os').system('echo pwned')", "[1]*10**9", "[1]*100000000",
    "[[1]]", "'1'", "lambda: 1", "0", "-1", "[1,2,0,1]", "[True]*4", "[1.0]*4", "()", "[x]*4",
    "[1]*4;1",
])
def test_moe_layer_freq_refuses_anything_else(value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        parse_job(BASE + ["--num-experts", "4", "--moe-layer-freq", value])
    assert_one_sentence(err, "--moe-layer-freq")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv,words", [
    (["--expert-model-parallel-size", "0"], "--expert-model-parallel-size must be a positive"),
    (["--expert-tensor-parallel-size", "2"],
     "--expert-tensor-parallel-size 2 must be 1 (whole experts) or "
     "--tensor-model-parallel-size 1"),
    (["--tensor-model-parallel-size", "4", "--sequence-parallel", "--expert-tensor-parallel-size",
      "2"], "other sizes are not implemented yet"),
    (["--moe-router-dtype", "fp64"], "the router always runs in fp32"),
    (["--moe-pad-expert-input-to-capacity"], "--moe-pad-expert-input-to-capacity needs "
                                               "--moe-expert-capacity-factor"),
    (["--moe-token-dispatcher-type", "allgather", "--moe-expert-capacity-factor", "1.0"],
     "--moe-expert-capacity-factor needs --moe-token-dispatcher-type alltoall"),
    (["--moe-token-dispatcher-type", "flex"], "is not one of alltoall, allgather"),
    (["--moe-router-topk", "8"], "--moe-router-topk 8 exceeds --num-experts 4"),
    (["--moe-aux-loss-coeff", "-1"], "--moe-aux-loss-coeff must be >= 0"),
    (["--moe-expert-capacity-factor", "0"], "--moe-expert-capacity-factor must be > 0"),
])
def test_moe_refusals_are_one_sentence(argv, words):
    with pytest.raises(ConfigError) as err:
        parse_job(BASE + ["--num-experts", "4"] + argv)
    assert_one_sentence(err, words)


def test_moe_flags_without_experts_are_refused():
    with pytest.raises(ConfigError) as err:
        config_of(["--moe-router-topk", "2"])
    assert_one_sentence(err, "--moe-router-topk is a mixture-of-experts flag but the model has "
                             "no experts: add --num-experts N")
    assert parse_job(BASE + ["--moe-token-dispatcher-type", "allgather"])   # alone: fine


def test_allgather_and_alltoall_are_accepted_with_a_note():
    for kind in ("alltoall", "allgather"):
        job = parse_job(BASE + ["--num-experts", "4", "--moe-token-dispatcher-type", kind])
        assert any(f"--moe-token-dispatcher-type {kind}: the tokens are permuted locally" in n
                   for n in job.notes), job.notes


def test_log_line_has_the_router_losses_only_for_moe():
    record = {"iteration": 1, "consumed_samples": 4, "ms_per_iter": 1.0, "tflops_per_gpu": 1e-5,
              "lr": 1e-3, "global_batch_size": 4, "lm_loss": 6.0, "grad_norm": 1.0,
              "tokens_per_sec": 10.0}
    assert "load balancing loss" not in format_log_line(record, 2)
    line = format_log_line(dict(record, load_balancing_loss=0.0123, z_loss=0.0), 2)
    fields = [f.split(":")[0].strip() for f in line.split(" | ")]
    i = fields.index("lm loss")
    assert fields[i + 1:i + 4] == ["load balancing loss", "z loss", "loss scale"]
    assert "load balancing loss: 1.230000E-02" in line


def test_moe_run_logs_the_load_balancing_loss(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rc, out, err = finish(start(TINY + ["--model", "llama-tiny", "--num-experts", "4",
                                        "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
                                        "--moe-ffn-hidden-size", "64", "--train-iters", "2",
                                        "--metrics-jsonl", str(metrics)]))
    assert rc == 0, (out[-2000:], err[-3000:])
    values = [float(v) for v in re.findall(r"load balancing loss: ([0-9.E+-]+)", out)]
    assert len(values) == 2 and all(v > 0 for v in values), out[-2000:]
    assert "z loss: 0.000000E+00" in out
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if "lm_loss" in r]
    assert len(train) == 2 and all(r["load_balancing_loss"] > 0 for r in train)
    assert [r["load_balancing_loss"] for r in train] == pytest.approx(values, rel=1e-5)


@pytest.mark.parametrize("argv,key,value", [
    (["--expert-model-parallel-size", "2"], "expert_parallel_size", 2),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel",
      "--expert-tensor-parallel-size", "2"], "expert_tensor_parallel_size", 2),
    ([], "expert_tensor_parallel_size", None),       # unset: GPTModel resolves it to tp
])
def test_expert_parallel_sizes_reach_the_model(monkeypatch, argv, key, value):
    """--expert-model-parallel-size / --expert-tensor-parallel-size parse and build_model hands
    them to GPTModel (recorded here instead of building: one process has no ep or tp group)."""
    job = parse_job(BASE + ["--num-experts", "4"] + argv)
    seen = {}

    class Stop(Exception):
        pass

    def fake_model(config, mesh, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(pretrain_gpt, "GPTModel", fake_model)
    from megatron_sp.mesh import ParallelMesh
    with pytest.raises(Stop):
        pretrain_gpt.build_model(config_of(["--num-experts", "4"]), ParallelMesh.single(), job, "cpu")
    assert seen[key] == value
