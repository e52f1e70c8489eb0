"""Mixture-of-experts conversion (models/families.py): Qwen3-MoE, Qwen2-MoE and Mixtral, both ways,
against transformers on tiny random models built here (never downloaded).

HF -> ours: the same logits as transformers (fp32, LOGITS_ATOL), from the in-memory state dict
(transformers 5's fused experts) and from a saved folder (save_pretrained's per-expert tensors).
Ours -> HF: a fresh transformers model holding the export has the original tensors (equal) and
logits, in both layouts. Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step) and
norm_topk_prob true and false; Qwen2-MoE (q/k/v bias, a sigmoid-gated shared expert) with a dense
layer, with and without qkv_bias; Mixtral with and without a sliding window. Refusals in one sentence;
the MoE presets' parameter counts against the published ones."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_sp.models import GPTModel, preset   # noqa: E402
from megatron_sp.models import families           # noqa: E402

VOCAB = 301
LOGITS_ATOL = 1e-4     # fp32 logits, ours against transformers (brief: 1e-4 absolute)
SEQ = 24
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)

QWEN3_MOE = {   # name: (Qwen3MoeConfig kwargs, expected moe_layer_freq)
    "qwen3_moe mlp_only_layers, norm_topk_prob": (
        dict(num_hidden_layers=3, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
             head_dim=16), [1, 0, 1]),
    "qwen3_moe decoder_sparse_step 2, no norm_topk_prob": (
        dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False,
             head_dim=8), [0, 1, 0, 1]),
}
QWEN2_MOE = {
    "qwen2_moe dense layer 1, qkv bias": dict(num_hidden_layers=3, decoder_sparse_step=1,
                                               mlp_only_layers=[1], norm_topk_prob=False),
    "qwen2_moe no qkv bias, norm_topk_prob": dict(num_hidden_layers=2, qkv_bias=False,
                                                  norm_topk_prob=True),
}
MIXTRAL = {
    "mixtral": dict(num_hidden_layers=2, sliding_window=None),
    "mixtral sliding_window 16": dict(num_hidden_layers=2, sliding_window=16),
}


def _randomise_(model, seed):
    """Non-trivial weights everywhere (norms near 1), so that a mix-up of experts or of gate and up
    rows would show; the router's default init is zeros in transformers."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(noise * (0.5 if name.endswith("gate.weight") else 0.1))
    return model.eval()


def _qwen3_moe(kwargs, seed):
    cfg = transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=40, moe_intermediate_size=16, num_experts=6,
        num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        **kwargs)
    return _randomise_(transformers.Qwen3MoeForCausalLM(cfg), seed)


def _qwen2_moe(kwargs, seed):
    cfg = transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=40, moe_intermediate_size=16, num_experts=6,
        num_experts_per_tok=2, shared_expert_intermediate_size=24,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, **kwargs)
    return _randomise_(transformers.Qwen2MoeForCausalLM(cfg), seed)


def _mixtral(kwargs, seed):
    cfg = transformers.MixtralConfig(
        **COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
        router_jitter_noise=0.0, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        **kwargs)
    return _randomise_(transformers.MixtralForCausalLM(cfg), seed)


def _logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return (out.logits if hasattr(out, "logits") else out).float()


def _max_diff(a, b):
    return (a - b).abs().max().item()


def _check_both_ways(hf, tmp_path, seed, seq=SEQ):
    """HF -> ours (both HF layouts) and ours -> HF (both layouts): logits and tensors."""
    tokens = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seed))
    expected = _logits(hf, tokens)
    original = {k: v.detach().clone() for k, v in hf.state_dict().items()}

    # HF in memory (fused experts) -> ours
    config, full = families.hf_to_megatron_sp(hf.config.to_dict(), hf.state_dict())
    ours = families.model_from_full(config, full).eval()
    assert isinstance(ours, GPTModel)
    diff = _max_diff(_logits(ours, tokens), expected)
    assert diff <= LOGITS_ATOL, f"HF -> ours logits differ by {diff}"

    # a saved HF folder (per-expert tensors on disk) -> ours: the same tensors
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    hf_config, state = families.read_hf_folder(str(tmp_path / "hf"))
    assert not any("gate_up_proj" in k for k in state)       # save_pretrained's per-expert layout
    config_disk, full_disk = families.hf_to_megatron_sp(hf_config, state)
    assert config_disk == config
    assert full_disk.keys() == full.keys()
    assert all(torch.equal(full_disk[k], full[k]) for k in full)
    loaded = families.load_hf_folder(str(tmp_path / "hf"))
    assert torch.equal(_logits(loaded, tokens), _logits(ours, tokens))

    # ours -> HF, fused: load_state_dict into a fresh transformers model
    exported = families.full_tensors(ours)
    hf_cfg, hf_state = families.megatron_sp_to_hf(config, exported, fused_experts=True)
    assert hf_cfg["model_type"] == hf.config.model_type
    fresh = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**hf_cfg)).eval()
    fresh.load_state_dict(hf_state, strict=True)
    assert fresh.state_dict().keys() == original.keys()
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, original[k]), f"round trip changed {k}"
    diff = _max_diff(_logits(fresh, tokens), expected)
    assert diff <= LOGITS_ATOL, f"ours -> HF (fused) logits differ by {diff}"

    # ours -> HF folder (per-expert, as the Hub checkpoints) -> from_pretrained
    hf_cfg, hf_state = families.megatron_sp_to_hf(config, exported)
    assert not any("gate_up_proj" in k for k in hf_state)
    families.write_hf_folder(str(tmp_path / "hf2"), hf_cfg, hf_state)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
    for k, v in back.state_dict().items():
        assert torch.equal(v, original[k]), f"folder round trip changed {k}"
    diff = _max_diff(_logits(back, tokens), expected)
    assert diff <= LOGITS_ATOL, f"ours -> HF folder logits differ by {diff}"
    return config, json.loads((tmp_path / "hf2" / "config.json").read_text())


@pytest.mark.parametrize("name", list(QWEN3_MOE))
def test_qwen3_moe_both_ways(name, tmp_path, seed):
    kwargs, freq = QWEN3_MOE[name]
    hf = _qwen3_moe(kwargs, seed)
    config, written = _check_both_ways(hf, tmp_path, seed)
    assert config.moe_layer_freq == freq
    assert config.num_experts == 6 and config.moe_router_topk == 2
    assert config.moe_ffn_hidden_size == 16 and config.ffn_hidden_size == 40
    # norm_topk_prob: our default routing (the same weights); without it --moe-router-pre-softmax
    assert config.moe_router_pre_softmax == (not kwargs["norm_topk_prob"]) and config.qk_layernorm
    assert not config.moe_norm_topk_prob
    assert written["norm_topk_prob"] == kwargs["norm_topk_prob"]
    assert written["moe_intermediate_size"] == 16 and written["intermediate_size"] == 40
    step, dense = written["decoder_sparse_step"], written["mlp_only_layers"]
    sparse = [int(i not in dense and (i + 1) % step == 0)
              for i in range(len(freq))]
    assert sparse == freq
    assert (written["decoder_sparse_step"], written["mlp_only_layers"]) == (
        (1, [1]) if freq == [1, 0, 1] else (2, []))


@pytest.mark.parametrize("name", list(QWEN2_MOE))
def test_qwen2_moe_both_ways(name, tmp_path, seed):
    kwargs = QWEN2_MOE[name]
    hf = _qwen2_moe(kwargs, seed)
    assert hf.model.layers[0].mlp.shared_expert_gate.weight.abs().sum() > 0   # a real gate
    config, written = _check_both_ways(hf, tmp_path, seed)
    assert config.moe_shared_expert_gate and config.moe_shared_expert_intermediate_size == 24
    assert config.add_qkv_bias == kwargs.get("qkv_bias", True) and not config.qk_layernorm
    assert config.moe_layer_freq == ([1, 0, 1] if kwargs["num_hidden_layers"] == 3 else [1, 1])
    assert written["shared_expert_intermediate_size"] == 24
    assert written["qkv_bias"] == kwargs.get("qkv_bias", True)
    assert written["norm_topk_prob"] == kwargs["norm_topk_prob"]


@pytest.mark.parametrize("name", list(MIXTRAL))
def test_mixtral_both_ways(name, tmp_path, seed):
    hf = _mixtral(MIXTRAL[name], seed)
    window = MIXTRAL[name]["sliding_window"]
    config, written = _check_both_ways(hf, tmp_path, seed, seq=window or SEQ)
    assert config.num_experts == 4 and config.moe_router_topk == 2 and config.moe_layer_freq == 1
    assert config.moe_ffn_hidden_size == config.ffn_hidden_size == 16
    assert not config.moe_router_pre_softmax and not config.qk_layernorm
    assert config.sliding_window == window and written["sliding_window"] == window
    assert written["num_local_experts"] == 4 and written["router_jitter_noise"] == 0.0
    if window:   # the model refuses sequences its full attention would get wrong (as mistral)
        ours = families.model_from_full(*families.hf_to_megatron_sp(hf.config.to_dict(),
                                                                     hf.state_dict()))
        with pytest.raises(ValueError, match="exceeds the model's sliding window 16"):
            ours(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_convert_script_both_ways(kind, tmp_path, seed):
    """tools/checkpoint/convert.py: HF folder -> megatron_sp checkpoint -> HF folder."""
    import megatron_sp
    from megatron_sp.testing import load_script
    convert = load_script("tools/checkpoint/convert.py")
    hf = {"qwen3_moe": lambda: _qwen3_moe(
              QWEN3_MOE["qwen3_moe decoder_sparse_step 2, no norm_topk_prob"][0], seed),
          "qwen2_moe": lambda: _qwen2_moe(QWEN2_MOE["qwen2_moe dense layer 1, qkv bias"], seed),
          "mixtral": lambda: _mixtral(MIXTRAL["mixtral"], seed)}[kind]()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    expected = _logits(hf, tokens)
    convert.main(["--loader", "hf", "--saver", "megatron_sp", "--load-dir", str(tmp_path / "hf"),
                  "--save-dir", str(tmp_path / "ours")])
    ours = megatron_sp.load_pretrained(str(tmp_path / "ours"))
    assert _max_diff(_logits(ours, tokens), expected) <= LOGITS_ATOL
    convert.main(["--loader", "megatron_sp", "--saver", "hf", "--load-dir", str(tmp_path / "ours"),
                  "--save-dir", str(tmp_path / "hf2")])
    written = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert written["model_type"] == kind
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
    assert _max_diff(_logits(back, tokens), expected) <= LOGITS_ATOL


def test_default_routing_exports_as_qwen3_moe_norm_topk_prob(seed):
    """Our default routing (softmax over the top-k logits) is Qwen3-MoE's norm_topk_prob=True."""
    hf = _qwen3_moe(QWEN3_MOE["qwen3_moe mlp_only_layers, norm_topk_prob"][0], seed)
    config, full = families.hf_to_megatron_sp(hf.config.to_dict(), hf.state_dict())
    default = type(config).from_dict(dict(config.to_dict(), moe_router_pre_softmax=False,
                                          moe_norm_topk_prob=False))
    hf_cfg, state = families.megatron_sp_to_hf(default, full, fused_experts=True)
    assert hf_cfg["norm_topk_prob"] is True
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    ours = families.model_from_full(default, full).eval()
    assert _max_diff(_logits(ours, tokens), _logits(hf, tokens)) <= LOGITS_ATOL


def _one_sentence(message: str) -> None:
    assert message.endswith(".") and ". " not in message and "\n" not in message, message


REFUSED_HF = [
    (dict(model_type="qwen2_moe", **COMMON, num_hidden_layers=2, intermediate_size=16,
          moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
          shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0"),
    (dict(model_type="deepseek_v3", n_routed_experts=8), "mixture-of-experts"),
    (dict(model_type="olmoe", num_experts=8), "mixture-of-experts"),
    (dict(model_type="mixtral", **COMMON, num_hidden_layers=2, intermediate_size=16,
          num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1),
     "router_jitter_noise=0.1"),
    (dict(model_type="mixtral", **COMMON, num_hidden_layers=2, intermediate_size=16,
          num_local_experts=4, num_experts_per_tok=5), "num_experts_per_tok=5"),
    (dict(model_type="qwen3_moe", hidden_size=32), "has no num_experts"),
]


@pytest.mark.parametrize("hf_config,phrase", REFUSED_HF, ids=lambda v: str(v)[:40])
def test_unsupported_moe_refused_in_one_sentence(hf_config, phrase):
    with pytest.raises(families.ConversionError, match=phrase) as info:
        families.hf_to_megatron_sp(hf_config, {})
    _one_sentence(str(info.value))


def test_exports_the_families_cannot_hold_are_refused(seed):
    hf = _qwen3_moe(QWEN3_MOE["qwen3_moe mlp_only_layers, norm_topk_prob"][0], seed)
    config, full = families.hf_to_megatron_sp(hf.config.to_dict(), hf.state_dict())
    cases = [
        (config, "qwen3", "has no experts"),                       # a dense family
        (type(config).from_dict(dict(config.to_dict(), qk_layernorm=False)), "mixtral",
         "leaves dense layers"),
        (type(config).from_dict(dict(config.to_dict(), moe_shared_expert_intermediate_size=8)),
         "qwen3_moe", "no shared expert"),
        (type(config).from_dict(dict(config.to_dict(), moe_router_score_function="sigmoid")),
         "qwen3_moe", "routes with a softmax"),
        (type(config).from_dict(dict(config.to_dict(), qk_layernorm=False)), "qwen2_moe",
         "sigmoid-gated shared expert"),
        (preset("qwen3-8b"), "qwen3_moe", "has no experts"),
    ]
    for cfg, family, phrase in cases:
        with pytest.raises(families.ConversionError, match=phrase) as info:
            families.megatron_sp_to_hf(cfg, {}, family=family)
        _one_sentence(str(info.value))
    assert families.infer_family(config) == "qwen3_moe"
    assert families.infer_family(preset("mixtral-8x7b")) == "mixtral"


def test_moe_presets_export_their_experts():
    """The presets' sizes are in test_families.py's PUBLISHED; they export their experts, and
    qwen3-30b-a3b its routing as norm_topk_prob with every layer sparse."""
    hf_config = families.llama_like_config(preset("qwen3-30b-a3b"),
                                           families.infer_family(preset("qwen3-30b-a3b")))
    assert hf_config["norm_topk_prob"] is True and hf_config["mlp_only_layers"] == []
    assert (hf_config["num_experts"], hf_config["num_experts_per_tok"],
            hf_config["moe_intermediate_size"], hf_config["head_dim"]) == (128, 8, 768, 128)
    qwen15 = preset("qwen1.5-moe-a2.7b")
    assert families.infer_family(qwen15) == "qwen2_moe"
    qwen15_hf = families.llama_like_config(qwen15, "qwen2_moe")
    assert (qwen15_hf["num_experts"], qwen15_hf["num_experts_per_tok"],
            qwen15_hf["shared_expert_intermediate_size"], qwen15_hf["norm_topk_prob"],
            qwen15_hf["qkv_bias"]) == (60, 4, 5632, False, True)
    mixtral = families.llama_like_config(preset("mixtral-8x7b"), "mixtral")
    assert (mixtral["num_local_experts"], mixtral["num_experts_per_tok"],
            mixtral["intermediate_size"]) == (8, 2, 14336)
