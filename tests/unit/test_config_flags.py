"""config_to_flags: the printed flags rebuild the same GPTConfig through pretrain_gpt's parser
(what `convert.py` prints and `--use-checkpoint-args` applies)."""

import pytest

from megatron_sp.cli.build import parse_job
from megatron_sp.cli.model_flags import config_to_flags
from megatron_sp.models.config import PRESETS, GPTConfig, preset

from megatron_sp.testing import load_script  # noqa: E402
pretrain_gpt = load_script("pretrain_gpt.py")


def _odd_config():
    return GPTConfig(num_layers=3, hidden_size=96, num_attention_heads=4, vocab_size=500,
                     num_query_groups=2, kv_channels=32, ffn_hidden_size=200, normalization="RMSNorm",
                     norm_epsilon=1e-6, activation="swiglu", position_embedding_type="rope",
                     rotary_base=1e6, add_bias_linear=False, add_qkv_bias=True, tie_embeddings=False,
                     attention_dropout=0.1, hidden_dropout=0.05, init_method_std=0.006,
                     make_vocab_size_divisible_by=64, max_position_embeddings=4096)


@pytest.mark.parametrize("name", sorted(PRESETS) + ["odd"])
def test_flags_rebuild_the_config(name):
    config = _odd_config() if name == "odd" else preset(name)
    job = parse_job(config_to_flags(config) + ["--seq-length", "128"])
    rebuilt = pretrain_gpt.model_config(job, config.vocab_size)
    assert rebuilt.to_dict() == config.to_dict()


def test_checkpoint_mismatch_names_the_flag(capsys):
    """A finetune whose norm epsilon differs is warned about by that flag (not another), and a
    shape mismatch names the shape flag and --use-checkpoint-args."""
    from megatron_sp.checkpointing import CheckpointError, check_config
    config = _odd_config()
    saved = {**config.to_dict(), "norm_epsilon": 1e-5}
    check_config(saved, config, "ckpt/iter_0000010")
    err = capsys.readouterr().err
    assert "--norm-epsilon 1e-05 in the checkpoint but 1e-06 now" in err and "--rotary-base" not in err
    with pytest.raises(CheckpointError, match="--num-query-groups 4 in the checkpoint but 2 .*"
                                              "--use-checkpoint-args"):
        check_config({**config.to_dict(), "num_query_groups": 4}, config, "ckpt/iter_0000010")


def test_help_has_a_sentence_and_default_for_every_flag():
    """--help: every flag described, defaults shown, --fp16 not described as refused."""
    from megatron_sp.cli.arguments import build_parser
    parser = build_parser()
    undocumented = [a.option_strings[0] for a in parser._actions
                    if a.option_strings and a.dest != "help" and not a.help]
    assert undocumented == []
    text = parser.format_help()
    assert "peak learning rate (default: 0.0003)" in " ".join(text.split())
    assert "learning rate at the end of the decay (default: 0.0)" in " ".join(text.split())
    assert "refused" not in text.split("--fp16", 1)[1].split("\n  --", 1)[0]
