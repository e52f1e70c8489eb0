"""tools/checkpoint/convert.py, bad input (docs/design.md §12): a config.json that is not JSON, an
export into a folder holding another HF model's shards, and an export of a model trained with a
capacity factor (HF routes every token) — one sentence or one note, nothing lost."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_sp.testing import load_script  # noqa: E402

convert = load_script("tools/checkpoint/convert.py")


def _refusal(argv) -> str:
    with pytest.raises(SystemExit) as info:
        convert.main(argv)
    message = str(info.value.code)
    assert message.startswith("error: ") and message.endswith(".") and "\n" not in message
    return message


def _mixtral_folder(path, seed):
    """A tiny random Mixtral (4 experts, top 2) saved as a HF folder."""
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(
        vocab_size=301, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        router_jitter_noise=0.0, sliding_window=None)
    transformers.MixtralForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


@pytest.mark.parametrize("content, problem", [
    (b"{\"model_type\": \"llama\",", "is not JSON (Expecting property name enclosed in double "
                                     "quotes at line 1 column 24)"),
    (b"\xff\xfe garbage", "is not UTF-8 text"),
    (b"[1, 2]", "is JSON but not an object (a list)"),
])
def test_config_json_that_is_not_json(tmp_path, content, problem):
    import megatron_sp
    from megatron_sp.checkpointing import CheckpointError
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_bytes(content)
    expected = (f"{folder / 'config.json'} {problem}: it is not a Hugging Face model config; "
                f"restore the model's config.json (download it again) and run again.")
    assert _refusal(["--loader", "hf", "--saver", "megatron_sp", "--load-dir", str(folder),
                     "--save-dir", str(tmp_path / "out")]) == "error: " + expected
    assert not (tmp_path / "out" / "latest_checkpointed_iteration.txt").exists()
    with pytest.raises(CheckpointError) as info:    # load_pretrained on the folder: the same
        megatron_sp.load_pretrained(str(folder))
    assert str(info.value) == expected


def test_export_over_another_sharded_model_is_refused_and_a_capacity_factor_noted(
        tmp_path, seed, capsys):
    from megatron_sp import checkpointing
    from megatron_sp.mesh import ParallelMesh
    from megatron_sp.models.families import (hf_to_megatron_sp, model_from_full,
                                             read_hf_folder)
    _mixtral_folder(tmp_path / "hf", seed)
    config, full = hf_to_megatron_sp(*read_hf_folder(str(tmp_path / "hf")))
    config = dataclasses.replace(config, moe_expert_capacity_factor=1.25)   # trained with one
    checkpointing.save_checkpoint(str(tmp_path / "ours"), checkpointing.RELEASE,
                                  [model_from_full(config, full)], ParallelMesh.single(),
                                  config=config)

    # An older sharded model in the export folder: refused, its files untouched.
    old = tmp_path / "old"
    old.mkdir()
    files = {"model-00001-of-00002.safetensors": b"a", "model-00002-of-00002.safetensors": b"b",
             "model.safetensors.index.json": b"{}", "generation_config.json": b"{}",
             "config.json": b"{}"}
    for name, data in files.items():
        (old / name).write_bytes(data)
    message = _refusal(["--loader", "megatron_sp", "--saver", "hf", "--load-dir",
                        str(tmp_path / "ours"), "--save-dir", str(old)])
    assert message == (
        f"error: --save-dir {old} holds another Hugging Face model's files that a loader would "
        f"read beside the export (generation_config.json, model-00001-of-00002.safetensors, "
        f"model-00002-of-00002.safetensors, model.safetensors.index.json): choose a new or empty "
        f"--save-dir, or move those files away first."), message
    assert {p.name: p.read_bytes() for p in old.iterdir()} == files

    # A new folder: exported with a note; exporting again over our own export is fine.
    capsys.readouterr()
    for _ in range(2):
        convert.main(["--loader", "megatron_sp", "--saver", "hf", "--load-dir",
                      str(tmp_path / "ours"), "--save-dir", str(tmp_path / "export")])
        out = capsys.readouterr().out
        assert ("> note: the model was trained with --moe-expert-capacity-factor 1.25 (tokens "
                "over an expert's capacity dropped); Hugging Face's models route every token to "
                "its top-k experts, so the export's outputs differ from training's wherever "
                "tokens were dropped.") in out, out
        assert "> wrote a mixtral model (MixtralForCausalLM)" in out
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    assert type(back).__name__ == "MixtralForCausalLM"
