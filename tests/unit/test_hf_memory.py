"""megatron_sp.hf.memory on tiny random transformers models (built from configs): the tiled MLP and
the host-offloaded layer checkpoints give the untiled model's loss (1e-5 relative) and gradients
(1e-4 absolute), and keep fewer bytes for backward (measured with saved-tensor hooks)."""
import pytest
import torch
import torch.nn.functional as F

from megatron_sp.errors import ConfigError

LOSS_RTOL, GRAD_ATOL = 1e-5, 1e-4


def _model(family):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    config = cls(vocab_size=97, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                            dtype=torch.float32)


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits                        # [b, s, V]
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_tiled_mlp_and_offloaded_checkpoints_equal_plain(family="qwen3", seed=1):
    from megatron_sp.hf.memory import offload_checkpointing, saved_bytes, tile_mlp

    ids = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(seed))
    plain = _model(family)
    ref_loss, ref_grads = _loss_and_grads(plain, ids)
    ref_bytes = saved_bytes(lambda: _loss_and_grads(plain, ids))
    variants = {"tiled": tile_mlp(_model(family), tiles=4),
                "offload": offload_checkpointing(_model(family)),
                "both": offload_checkpointing(tile_mlp(_model(family), tiles=3))}
    measured = {}
    for name, model in variants.items():
        loss, grads = _loss_and_grads(model, ids)
        assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss), (name, loss, ref_loss)
        for key, g in ref_grads.items():
            assert (grads[key] - g).abs().max().item() <= GRAD_ATOL, (name, key)
        measured[name] = saved_bytes(lambda: _loss_and_grads(model, ids))
    # Tiling drops the kept [b, s, F] MLP intermediates of both layers; offloading moves what the
    # layer checkpoints keep to the host, so device bytes fall further and host bytes appear.
    mlp_intermediates = 2 * 3 * ids.numel() * 96 * 4        # layers x (gate, up, act) x fp32
    assert measured["tiled"]["device_bytes"] <= ref_bytes["device_bytes"] - mlp_intermediates // 2
    assert ref_bytes["host_bytes"] == measured["tiled"]["host_bytes"] == 0
    assert measured["offload"]["host_bytes"] > 0
    assert measured["offload"]["device_bytes"] < measured["tiled"]["device_bytes"]
    with pytest.raises(ConfigError, match="already tiled"):
        tile_mlp(variants["tiled"])
