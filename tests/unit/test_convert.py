"""tools/checkpoint/convert.py: HF GPT-2 / Llama (small random configs, no downloads) -> megatron_sp
-> HF again. Logits agree with transformers within 1e-5 both ways; the converted checkpoint loads in
pretrain_gpt.py (--load --finetune) and through megatron_sp.load_pretrained and the consolidated
safetensors export."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import transformers
import safetensors  # noqa: F401 (test extra)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_sp.testing import load_script  # noqa: E402
convert = load_script("tools/checkpoint/convert.py")

VOCAB = 301   # = NullTokenizer(--vocab-size 300).vocab_size; padded to 384 here, 512 at tp=2


def _hf_model(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=64,
                                       rms_norm_eps=1e-5, rope_theta=5000.0, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():   # non-trivial norms and biases, so that a mix-up would show
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "weight" in name else 0.0))
    return model.eval()


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits.float()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_roundtrip(kind, tmp_path):
    import megatron_sp
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    expected = _hf_logits(hf, tokens)

    convert.main(["--loader", "hf", "--saver", "megatron_sp", "--load-dir", str(tmp_path / "hf"),
                  "--save-dir", str(tmp_path / "ours")])
    assert (tmp_path / "ours" / "latest_checkpointed_iteration.txt").read_text() == "release"
    ours = megatron_sp.load_pretrained(str(tmp_path / "ours"))
    with torch.no_grad():
        logits = ours(tokens)
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() <= 1e-5, (logits - expected).abs().max()

    # Consolidated single-file export, read back by load_pretrained.
    convert.main(["--loader", "megatron_sp", "--saver", "safetensors", "--load-dir",
                  str(tmp_path / "ours"), "--save-dir", str(tmp_path / "export")])
    single = megatron_sp.load_pretrained(str(tmp_path / "export" / "model.safetensors"))
    with torch.no_grad():
        assert torch.equal(single(tokens), logits)

    # Back to HF: transformers loads it and computes the same logits.
    convert.main(["--loader", "megatron_sp", "--saver", "hf", "--load-dir", str(tmp_path / "ours"),
                  "--save-dir", str(tmp_path / "hf2")])
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
    assert type(back) is type(hf)
    diff = (_hf_logits(back, tokens) - expected).abs().max().item()
    assert diff <= 1e-5, diff

    if kind == "llama":   # the converted checkpoint trains in pretrain_gpt.py (weights only)
        sys.path.insert(0, ROOT)
        import pretrain_gpt
        flags = ("--mock-data --vocab-size 300 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
                 "--num-query-groups 2 --ffn-hidden-size 96 --swiglu --position-embedding-type rope "
                 "--rotary-base 5000 --normalization RMSNorm --disable-bias-linear "
                 "--untie-embeddings-and-output-weights --max-position-embeddings 64 --seq-length 16 "
                 "--micro-batch-size 2 --global-batch-size 2 --train-iters 1 --eval-iters 0 "
                 "--attention-backend sdpa --log-interval 1").split()
        pretrain_gpt.main(flags + ["--load", str(tmp_path / "ours"), "--finetune",
                                   "--save", str(tmp_path / "ft")])
        assert (tmp_path / "ft" / "latest_checkpointed_iteration.txt").read_text() == "1"
        from megatron_sp.checkpointing import CheckpointError     # (run_main says it, once)
        with pytest.raises(CheckpointError, match="--hidden-size 64 in the checkpoint but 128"):
            pretrain_gpt.main([f if f != "64" else "128" for f in flags]
                              + ["--load", str(tmp_path / "ours"), "--finetune"])


def test_unsupported_models_refused():
    from megatron_sp.models import preset
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   rope_scaling={"rope_type": "dynamic", "factor": 8.0})
    with pytest.raises(convert.ConversionError, match="rope_type='dynamic' is not supported"):
        convert.hf_to_megatron_sp(cfg.to_dict(), {})
    with pytest.raises(convert.ConversionError, match="model_type='bert'"):
        convert.hf_to_megatron_sp({"model_type": "bert"}, {})
    odd = preset("llama-tiny", activation="gelu")
    with pytest.raises(convert.ConversionError, match="no Hugging Face architecture"):
        convert.megatron_sp_to_hf(odd, {})
