#!/usr/bin/env python
"""Convert checkpoints between Hugging Face (GPT-2, Llama) and megatron_sp, Megatron-style flags.

    python tools/checkpoint/convert.py --loader hf --saver megatron_sp \
        --load-dir ./Llama-3.2-1B --save-dir ./ckpt/llama-1b        # then --load (any layout)
    python tools/checkpoint/convert.py --loader megatron_sp --saver hf \
        --load-dir ./ckpt/run1 --save-dir ./hf-export                 # GPT2LMHeadModel / LlamaForCausalLM
    python tools/checkpoint/convert.py --loader megatron_sp --saver safetensors \
        --load-dir ./ckpt/run1 --save-dir ./export                    # one model.safetensors, our names

HF checkpoints are read from safetensors (or pytorch_model.bin with torch.load(weights_only=True));
nothing is downloaded. A megatron_sp checkpoint written here is a "release" checkpoint (weights only,
iteration 0): train from it with `pretrain_gpt.py --load DIR` (any tp/sp/pp/dp; optionally
--finetune), or load it in Python with `megatron_sp.load_pretrained(DIR)`.

Name and layout mapping (full tensors, our names as in megatron_sp.models.GPTModel):
  GPT-2  wte/wpe -> embedding.{word,position}_embeddings; Conv1D weights are [in, out]: transposed;
         c_attn's [q | k | v] columns -> our grouped qkv rows (per head: q, k, v); gelu_new = gelu_tanh;
         lm_head is tied to wte.
  Llama  q/k/v_proj -> grouped qkv rows [g x (h/g q, k, v) x d]; gate/up_proj -> fc1 = cat(gate, up);
         o_proj -> proj, down_proj -> fc2; HF's q/k weights are already in the rotate_half RoPE
         convention that our RotaryEmbedding uses, so no permutation.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch


class ConversionError(ValueError):
    """A model that cannot be converted, with the reason."""


# Reading and writing HF folders ----------------------------------------------------------------------

def read_hf_folder(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, state dict) of a HF model folder; safetensors or weights_only .bin."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConversionError(f"{path} has no config.json: not a Hugging Face model folder.")
    with open(cfg_path) as f:
        config = json.load(f)
    state: dict[str, torch.Tensor] = {}
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single) or os.path.isfile(index):
        from safetensors.torch import load_file
        files = [single] if os.path.isfile(single) else sorted(
            {os.path.join(path, f) for f in json.load(open(index))["weight_map"].values()})
        for file in files:
            state.update(load_file(file))
    elif os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        state = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu",
                           weights_only=True)
    else:
        raise ConversionError(f"{path} has neither model.safetensors(.index.json) nor pytorch_model.bin.")
    return config, state


def write_hf_folder(path: str, config: dict, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})


def _get(state, key):
    if key not in state:
        raise ConversionError(f"the Hugging Face checkpoint has no tensor {key!r}.")
    return state[key]


# HF -> ours ---------------------------------------------------------------------------------------------

def hf_to_megatron_sp(hf_config: dict, state: dict[str, torch.Tensor]):
    """(GPTConfig, {our name: full tensor, vocabulary unpadded}) from a HF GPT-2 or Llama model."""
    from megatron_sp.models import GPTConfig
    kind = hf_config.get("model_type")
    out: dict[str, torch.Tensor] = {}
    if kind == "gpt2":
        act = hf_config.get("activation_function", "gelu_new")
        acts = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
        if act not in acts:
            raise ConversionError(f"GPT-2 activation_function={act!r} is not supported "
                                  f"(gelu_new, gelu_pytorch_tanh or gelu).")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if hf_config.get(flag):
                raise ConversionError(f"GPT-2 with {flag}=True is not supported.")
        H, L, h = hf_config["n_embd"], hf_config["n_layer"], hf_config["n_head"]
        config = GPTConfig(
            num_layers=L, hidden_size=H, num_attention_heads=h, vocab_size=hf_config["vocab_size"],
            ffn_hidden_size=hf_config.get("n_inner") or 4 * H,
            max_position_embeddings=hf_config["n_positions"], normalization="LayerNorm",
            norm_epsilon=hf_config.get("layer_norm_epsilon", 1e-5), activation=acts[act],
            position_embedding_type="learned_absolute", add_bias_linear=True, tie_embeddings=True)
        d = H // h
        pre = "transformer." if any(k.startswith("transformer.") for k in state) else ""
        g = lambda k: _get(state, pre + k).float()
        out["embedding.word_embeddings.weight"] = g("wte.weight")
        out["embedding.position_embeddings.weight"] = g("wpe.weight")
        for i in range(L):
            p, o = f"h.{i}.", f"layers.{i}."
            out[o + "input_norm.weight"], out[o + "input_norm.bias"] = g(p + "ln_1.weight"), g(p + "ln_1.bias")
            w = g(p + "attn.c_attn.weight").t()                      # [3H, H]: [q | k | v]
            out[o + "attention.qkv.weight"] = w.reshape(3, h, d, H).transpose(0, 1).reshape(3 * H, H)
            b = g(p + "attn.c_attn.bias")
            out[o + "attention.qkv.bias"] = b.reshape(3, h, d).transpose(0, 1).reshape(3 * H)
            out[o + "attention.proj.weight"] = g(p + "attn.c_proj.weight").t()
            out[o + "attention.proj.bias"] = g(p + "attn.c_proj.bias")
            out[o + "post_attention_norm.weight"] = g(p + "ln_2.weight")
            out[o + "post_attention_norm.bias"] = g(p + "ln_2.bias")
            out[o + "mlp.fc1.weight"], out[o + "mlp.fc1.bias"] = g(p + "mlp.c_fc.weight").t(), g(p + "mlp.c_fc.bias")
            out[o + "mlp.fc2.weight"], out[o + "mlp.fc2.bias"] = g(p + "mlp.c_proj.weight").t(), g(p + "mlp.c_proj.bias")
        out["final_norm.weight"], out["final_norm.bias"] = g("ln_f.weight"), g("ln_f.bias")
        return config, out
    if kind == "llama":
        if hf_config.get("hidden_act", "silu") != "silu":
            raise ConversionError(f"Llama hidden_act={hf_config['hidden_act']!r} is not supported (silu).")
        if hf_config.get("attention_bias") or hf_config.get("mlp_bias"):
            raise ConversionError("Llama with attention_bias or mlp_bias is not supported.")
        rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ConversionError(f"Llama rope_type={rope.get('rope_type', rope.get('type'))!r} "
                                  f"(RoPE scaling) is not supported; only the default RoPE.")
        theta = rope.get("rope_theta", hf_config.get("rope_theta", 10000.0))
        H, L = hf_config["hidden_size"], hf_config["num_hidden_layers"]
        h = hf_config["num_attention_heads"]
        gq = hf_config.get("num_key_value_heads") or h
        d = hf_config.get("head_dim") or H // h
        tied = bool(hf_config.get("tie_word_embeddings", False))
        config = GPTConfig(
            num_layers=L, hidden_size=H, num_attention_heads=h, num_query_groups=gq, kv_channels=d,
            ffn_hidden_size=hf_config["intermediate_size"], vocab_size=hf_config["vocab_size"],
            max_position_embeddings=hf_config.get("max_position_embeddings", 2048),
            normalization="RMSNorm", norm_epsilon=hf_config.get("rms_norm_eps", 1e-6),
            activation="swiglu", position_embedding_type="rope", rotary_base=float(theta),
            add_bias_linear=False, tie_embeddings=tied)
        g = lambda k: _get(state, k).float()
        out["embedding.word_embeddings.weight"] = g("model.embed_tokens.weight")
        for i in range(L):
            p, o = f"model.layers.{i}.", f"layers.{i}."
            out[o + "input_norm.weight"] = g(p + "input_layernorm.weight")
            q = g(p + "self_attn.q_proj.weight").reshape(gq, h // gq, d, H)
            k = g(p + "self_attn.k_proj.weight").reshape(gq, 1, d, H)
            v = g(p + "self_attn.v_proj.weight").reshape(gq, 1, d, H)
            out[o + "attention.qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, H)
            out[o + "attention.proj.weight"] = g(p + "self_attn.o_proj.weight")
            out[o + "post_attention_norm.weight"] = g(p + "post_attention_layernorm.weight")
            out[o + "mlp.fc1.weight"] = torch.cat([g(p + "mlp.gate_proj.weight"),
                                                   g(p + "mlp.up_proj.weight")], dim=0)
            out[o + "mlp.fc2.weight"] = g(p + "mlp.down_proj.weight")
        out["final_norm.weight"] = g("model.norm.weight")
        if not tied:
            out["output_layer.weight"] = g("lm_head.weight")
        return config, out
    raise ConversionError(f"Hugging Face model_type={kind!r} is not supported (gpt2, llama).")


def build_model_from_full(config, full: dict[str, torch.Tensor]):
    """A one-rank GPTModel holding `full` (vocabulary rows padded with zeros)."""
    from megatron_sp.models import GPTModel
    model = GPTModel(config)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(full))
    extra = sorted(set(full) - set(params))
    if missing or extra:
        raise ConversionError(f"tensors missing: {missing}; unexpected: {extra}.")
    with torch.no_grad():
        for name, p in params.items():
            t = full[name]
            rows = getattr(p, "real_rows", None)
            want = (rows,) + tuple(p.shape[1:]) if rows else tuple(p.shape)
            if tuple(t.shape) != want:
                raise ConversionError(f"tensor {name!r} has shape {tuple(t.shape)} but the model "
                                      f"expects {want}.")
            p.zero_()
            (p[:rows] if rows else p).copy_(t)
    return model


# Ours -> HF ---------------------------------------------------------------------------------------------

def full_tensors(model) -> dict[str, torch.Tensor]:
    """{our name: full tensor} of a one-rank model, vocabulary rows unpadded."""
    out = {}
    for name, p in model.named_parameters():
        rows = getattr(p, "real_rows", None)
        out[name] = (p[:rows] if rows else p).detach().float().contiguous()
    return out


def megatron_sp_to_hf(config, full: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """(HF config.json dict, HF state dict) for GPT2LMHeadModel or LlamaForCausalLM."""
    c = config
    H, L, h, g, d, F = (c.hidden_size, c.num_layers, c.num_attention_heads, c.num_query_groups,
                        c.kv_channels, c.ffn_hidden_size)
    s: dict[str, torch.Tensor] = {}
    gpt2_like = (c.normalization == "LayerNorm" and c.activation in ("gelu_tanh", "gelu")
                 and c.position_embedding_type == "learned_absolute")
    llama_like = (c.normalization == "RMSNorm" and c.activation == "swiglu"
                  and c.position_embedding_type == "rope")
    if gpt2_like:
        if not (c.add_bias_linear and c.add_qkv_bias and c.tie_embeddings and g == h and d * h == H):
            raise ConversionError("GPT-2 export needs biases, tied embeddings, no GQA and "
                                  "kv_channels = hidden/heads; this model differs.")
        s["transformer.wte.weight"] = full["embedding.word_embeddings.weight"]
        s["transformer.wpe.weight"] = full["embedding.position_embeddings.weight"]
        for i in range(L):
            o, p = f"layers.{i}.", f"transformer.h.{i}."
            s[p + "ln_1.weight"], s[p + "ln_1.bias"] = full[o + "input_norm.weight"], full[o + "input_norm.bias"]
            w = full[o + "attention.qkv.weight"].reshape(h, 3, d, H).transpose(0, 1).reshape(3 * H, H)
            s[p + "attn.c_attn.weight"] = w.t().contiguous()
            s[p + "attn.c_attn.bias"] = full[o + "attention.qkv.bias"].reshape(h, 3, d).transpose(0, 1).reshape(3 * H).contiguous()
            s[p + "attn.c_proj.weight"] = full[o + "attention.proj.weight"].t().contiguous()
            s[p + "attn.c_proj.bias"] = full[o + "attention.proj.bias"]
            s[p + "ln_2.weight"] = full[o + "post_attention_norm.weight"]
            s[p + "ln_2.bias"] = full[o + "post_attention_norm.bias"]
            s[p + "mlp.c_fc.weight"] = full[o + "mlp.fc1.weight"].t().contiguous()
            s[p + "mlp.c_fc.bias"] = full[o + "mlp.fc1.bias"]
            s[p + "mlp.c_proj.weight"] = full[o + "mlp.fc2.weight"].t().contiguous()
            s[p + "mlp.c_proj.bias"] = full[o + "mlp.fc2.bias"]
        s["transformer.ln_f.weight"], s["transformer.ln_f.bias"] = full["final_norm.weight"], full["final_norm.bias"]
        hf = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.vocab_size,
              "n_positions": c.max_position_embeddings, "n_embd": H, "n_layer": L, "n_head": h,
              "n_inner": F, "activation_function": "gelu_new" if c.activation == "gelu_tanh" else "gelu",
              "layer_norm_epsilon": c.norm_epsilon, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
              "attn_pdrop": 0.0, "tie_word_embeddings": True, "torch_dtype": "float32"}
        return hf, s
    if llama_like:
        if c.add_bias_linear or c.add_qkv_bias:
            raise ConversionError("Llama export needs a model without biases (--disable-bias-linear).")
        s["model.embed_tokens.weight"] = full["embedding.word_embeddings.weight"]
        for i in range(L):
            o, p = f"layers.{i}.", f"model.layers.{i}."
            s[p + "input_layernorm.weight"] = full[o + "input_norm.weight"]
            qkv = full[o + "attention.qkv.weight"].reshape(g, h // g + 2, d, H)
            s[p + "self_attn.q_proj.weight"] = qkv[:, :h // g].reshape(h * d, H).contiguous()
            s[p + "self_attn.k_proj.weight"] = qkv[:, h // g].reshape(g * d, H).contiguous()
            s[p + "self_attn.v_proj.weight"] = qkv[:, h // g + 1].reshape(g * d, H).contiguous()
            s[p + "self_attn.o_proj.weight"] = full[o + "attention.proj.weight"]
            s[p + "post_attention_layernorm.weight"] = full[o + "post_attention_norm.weight"]
            gate, up = full[o + "mlp.fc1.weight"].chunk(2, dim=0)
            s[p + "mlp.gate_proj.weight"], s[p + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
            s[p + "mlp.down_proj.weight"] = full[o + "mlp.fc2.weight"]
        s["model.norm.weight"] = full["final_norm.weight"]
        if not c.tie_embeddings:
            s["lm_head.weight"] = full["output_layer.weight"]
        hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
              "hidden_size": H, "intermediate_size": F, "num_hidden_layers": L,
              "num_attention_heads": h, "num_key_value_heads": g, "head_dim": d,
              "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.norm_epsilon,
              "rope_theta": c.rotary_base,
              "rope_parameters": {"rope_type": "default", "rope_theta": c.rotary_base},
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
              "tie_word_embeddings": bool(c.tie_embeddings), "torch_dtype": "float32"}
        return hf, s
    raise ConversionError(
        f"no Hugging Face architecture matches normalization={c.normalization}, activation="
        f"{c.activation}, position_embedding_type={c.position_embedding_type} (GPT-2: LayerNorm, "
        f"gelu_tanh, learned_absolute; Llama: RMSNorm, swiglu, rope).")


# Entry points ---------------------------------------------------------------------------------------

def convert_hf_to_megatron_sp(load_dir: str, save_dir: str):
    from megatron_sp import checkpointing
    from megatron_sp.mesh import ParallelMesh
    hf_config, state = read_hf_folder(load_dir)
    config, full = hf_to_megatron_sp(hf_config, state)
    model = build_model_from_full(config, full)
    checkpointing.save_checkpoint(save_dir, checkpointing.RELEASE, [model], ParallelMesh.single(),
                                  config=config)
    return config


def convert_megatron_sp_to_hf(load_dir: str, save_dir: str):
    from megatron_sp import load_pretrained
    model = load_pretrained(load_dir)
    hf_config, state = megatron_sp_to_hf(model.config, full_tensors(model))
    write_hf_folder(save_dir, hf_config, state)
    return hf_config


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--model-type", default="GPT", help="Megatron's flag; only GPT")
    p.add_argument("--loader", required=True, choices=["hf", "megatron_sp"])
    p.add_argument("--saver", required=True, choices=["megatron_sp", "hf", "safetensors"])
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    a = p.parse_args(argv)
    from megatron_sp.checkpointing import CheckpointError
    try:
        if a.loader == "hf" and a.saver == "megatron_sp":
            config = convert_hf_to_megatron_sp(a.load_dir, a.save_dir)
        elif a.loader == "megatron_sp" and a.saver == "hf":
            convert_megatron_sp_to_hf(a.load_dir, a.save_dir)
            config = None
        elif a.loader == "megatron_sp" and a.saver == "safetensors":
            from megatron_sp.checkpointing import export_safetensors
            path = export_safetensors(a.load_dir, os.path.join(a.save_dir, "model.safetensors"))
            print(f"> wrote {path}")
            return
        else:
            raise ConversionError(f"--loader {a.loader} --saver {a.saver} is not a supported pair.")
    except (ConversionError, CheckpointError) as err:
        raise SystemExit(f"error: {err}") from None
    print(f"> converted {a.load_dir} ({a.loader}) -> {a.save_dir} ({a.saver})")
    if config is not None:
        from megatron_sp.models.config import config_to_flags
        print(f"> fine-tune it with: --load {a.save_dir} --finetune --use-checkpoint-args "
              f"(model flags, stored in the checkpoint: {' '.join(config_to_flags(config))})")


if __name__ == "__main__":
    sys.exit(main())
