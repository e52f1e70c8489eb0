"""The Hugging Face families we convert both ways: gpt2, llama (plain, Llama-3.1 RoPE scaling, YaRN),
mistral, qwen2 (Qwen2/2.5), qwen3, and the mixture-of-experts qwen3_moe (Qwen3-MoE), qwen2_moe
(Qwen1.5-MoE / Qwen2-MoE: a sigmoid-gated shared expert) and mixtral.

One mapping between a HF `config.json` + state dict and a GPTConfig + {our name: full tensor}
(vocabulary unpadded), used by tools/checkpoint/convert.py and by `megatron_sp.load_pretrained` on a
HF folder. Everything else is refused with one sentence (ConversionError): sliding-window attention
when the window is shorter than the sequence (checked by the model, which records the window),
the other mixture-of-experts families (Qwen2-MoE's gated shared expert, DeepSeek, ...), router
jitter, attention sinks, other RoPE rules, biases we do not have.

Layouts (full tensors):
  GPT-2  wte/wpe -> embedding.{word,position}_embeddings; Conv1D weights are [in, out]: transposed;
         c_attn's [q | k | v] columns -> our grouped qkv rows (per head: q, k, v); gelu_new = gelu_tanh;
         lm_head is tied to wte.
  Llama, Mistral, Qwen2, Qwen3
         q/k/v_proj -> grouped qkv rows [g x (h/g q, k, v) x d] (Qwen2's q/k/v biases the same way);
         q_norm/k_norm (Qwen3) -> attention.q_layernorm/k_layernorm; gate/up_proj -> fc1 = cat(gate,
         up); o_proj -> proj, down_proj -> fc2. HF's q/k weights are already in the rotate_half RoPE
         convention that our RotaryEmbedding uses, so no permutation.
  Qwen3-MoE, Mixtral (models/moe.py MoEMLP in the expert layers; attention as qwen3 / mistral)
         mlp.gate (Mixtral on disk: block_sparse_moe.gate) -> mlp.router.weight [E, H];
         experts -> mlp.experts.w1 [E, 2F, H] (per expert cat(gate, up)) and w2 [E, H, F] (down).
         Read in either layout: transformers 5's fused parameters (experts.gate_up_proj,
         experts.down_proj: the same layouts as ours) or the per-expert tensors its save_pretrained
         and the Hub checkpoints hold (Qwen3-MoE experts.{j}.gate/up/down_proj; Mixtral
         experts.{j}.w1 (gate), w3 (up), w2 (down)); written per expert unless fused_experts.
         Qwen3-MoE's dense layers (mlp_only_layers, decoder_sparse_step) keep mlp.fc1/fc2; its layer
         pattern becomes an explicit moe_layer_freq 0/1 list. Routing (models/moe.py topk_routing):
         Mixtral = the default (top-k of the logits, softmax over the k); Qwen3-MoE = the default
         with norm_topk_prob (the same weights), --moe-router-pre-softmax without it.
"""
from __future__ import annotations

import json
import os

import torch

from .config import GPTConfig
from .rope import yarn_mscale

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")   # llama-like attention, experts in the MLPs
FAMILIES = ("gpt2",) + LLAMA_LIKE + MOE_FAMILIES
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
MOE_TYPES = ("olmoe", "deepseek_v2", "deepseek_v3", "dbrx", "jamba", "granitemoe",
             "phimoe")                       # refused: mixture-of-experts families we do not convert
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


class ConversionError(ValueError):
    """A model that cannot be converted, with the reason."""


# Reading and writing HF folders ----------------------------------------------------------------------

def is_hf_folder(path: str) -> bool:
    """A folder with a config.json that names a model_type (a Hugging Face model folder)."""
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        return False
    return "model_type" in read_config_json(cfg)


def read_config_json(cfg_path: str) -> dict:
    """config.json as a dict; ConversionError (one sentence) when it is not a JSON object."""
    try:
        with open(cfg_path, "rb") as f:
            config = json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError:
        problem = "not UTF-8 text"
    except json.JSONDecodeError as err:
        problem = f"not JSON ({err.msg} at line {err.lineno} column {err.colno})"
    else:
        if isinstance(config, dict):
            return config
        problem = f"JSON but not an object (a {type(config).__name__})"
    raise ConversionError(f"{cfg_path} is {problem}: it is not a Hugging Face model config; "
                          f"restore the model's config.json (download it again) and run again.")


STALE_HF_FILES = ("model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
                  "generation_config.json")


def stale_hf_files(path: str) -> list[str]:
    """The files of another model in `path` that a loader would read beside (or instead of) an
    export's config.json + model.safetensors: weight shards, indexes, pytorch_model*.bin,
    generation_config.json (an export writes none of them)."""
    if not os.path.isdir(path):
        return []
    return sorted(name for name in os.listdir(path)
                  if name in STALE_HF_FILES or (name.endswith(".safetensors")
                                                and name != "model.safetensors")
                  or (name.startswith("pytorch_model") and name.endswith(".bin")))


def read_hf_folder(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, state dict) of a HF model folder; safetensors or weights_only .bin."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConversionError(f"{path} has no config.json: not a Hugging Face model folder.")
    config = read_config_json(cfg_path)
    _refuse_unsupported(config, {})     # before reading gigabytes of weights
    if not any(os.path.isfile(os.path.join(path, n)) for n in
               ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")):
        raise ConversionError(f"{path} has neither model.safetensors(.index.json) nor pytorch_model.bin.")
    from megatron_sp.checkpointing.hf_weights import read_hf_weights   # each file's failure named
    return config, read_hf_weights(path)


def write_hf_folder(path: str, config: dict, state: dict[str, torch.Tensor]) -> None:
    """config.json and model.safetensors, each written to a temporary name, given the user's umask
    and renamed (megatron_sp.fileutil)."""
    from safetensors.torch import save_file
    from megatron_sp.fileutil import publish, temporary_name
    os.makedirs(path, exist_ok=True)
    weights = os.path.join(path, "model.safetensors")
    tmp = temporary_name(weights)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp, metadata={"format": "pt"})
    publish(tmp, weights)
    cfg = os.path.join(path, "config.json")
    with open(temporary_name(cfg), "w") as f:
        json.dump(config, f, indent=2)
    publish(temporary_name(cfg), cfg)


def _get(state, key):
    if key not in state:
        raise ConversionError(f"the Hugging Face checkpoint has no tensor {key!r}.")
    return state[key]


# HF -> ours ---------------------------------------------------------------------------------------------

def hf_to_megatron_sp(hf_config: dict, state: dict[str, torch.Tensor]):
    """(GPTConfig, {our name: full tensor, vocabulary unpadded}) from a HF model of a family above."""
    kind = hf_config.get("model_type")
    _refuse_unsupported(hf_config, state)
    if kind == "gpt2":
        return _gpt2_to_ours(hf_config, state)
    if kind in LLAMA_LIKE + MOE_FAMILIES:
        return _llama_like_to_ours(hf_config, state)
    raise ConversionError(f"Hugging Face model_type={kind!r} is not supported "
                          f"({', '.join(FAMILIES)}).")


def _refuse_unsupported(hf_config: dict, state) -> None:
    kind = hf_config.get("model_type")
    if kind == "gpt_oss" or any(k.endswith(".sinks") for k in state):
        raise ConversionError(f"model_type={kind!r} uses attention sinks, which megatron_sp does not "
                              f"implement.")
    if kind in MOE_FAMILIES:
        _refuse_unsupported_moe(hf_config, state)
        return
    if kind in MOE_TYPES or any((hf_config.get(k) or 0) > 0 for k in MOE_KEYS):
        raise ConversionError(f"model_type={kind!r} is a mixture-of-experts model megatron_sp does "
                              f"not convert (of the MoE families only {' and '.join(MOE_FAMILIES)}).")


MOE_REQUIRED = {  # the config.json keys a conversion reads (the experts' count: either name)
    "qwen3_moe": ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "moe_intermediate_size", "num_experts_per_tok", "vocab_size"),
    "qwen2_moe": ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "moe_intermediate_size", "num_experts_per_tok", "vocab_size",
                  "shared_expert_intermediate_size"),
    "mixtral": ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "num_experts_per_tok", "vocab_size")}


def _num_experts(hf_config: dict):
    """The experts per MoE layer: num_experts (Qwen3-MoE's config.json) or num_local_experts
    (Mixtral's; transformers maps either name to the other)."""
    n = hf_config.get("num_experts")
    return hf_config.get("num_local_experts") if n is None else n


def _refuse_unsupported_moe(hf_config: dict, state) -> None:
    """What a qwen3_moe / qwen2_moe / mixtral config.json holds that megatron_sp's MoE layer cannot
    be (one sentence each). Not mapped, on purpose: router_aux_loss_coef and output_router_logits are
    training flags of transformers (pass --moe-aux-loss-coeff to train with a load-balancing loss)."""
    kind = hf_config["model_type"]
    missing = [k for k in MOE_REQUIRED[kind] if k not in hf_config]
    if _num_experts(hf_config) is None:
        missing.insert(0, "num_local_experts" if kind == "mixtral" else "num_experts")
    if missing:
        raise ConversionError(f"the {kind} (mixture-of-experts) config.json has no "
                              f"{', '.join(missing)}.")
    n, k = _num_experts(hf_config), hf_config["num_experts_per_tok"]
    if not (isinstance(n, int) and n >= 1 and isinstance(k, int) and 1 <= k <= n):
        raise ConversionError(f"{kind} with {n} experts and num_experts_per_tok={k} has no "
                              f"expert layer megatron_sp can build (1 <= top-k <= experts).")
    if kind == "mixtral" and (hf_config.get("router_jitter_noise") or 0.0) != 0.0:
        raise ConversionError(f"mixtral router_jitter_noise={hf_config['router_jitter_noise']} "
                              f"(multiplicative noise on the router's input in training) is not "
                              f"implemented by megatron_sp's router; set it to 0 to convert.")
    if kind == "qwen2_moe":
        shared = hf_config["shared_expert_intermediate_size"]
        if not (isinstance(shared, int) and shared >= 1):
            raise ConversionError(f"qwen2_moe with shared_expert_intermediate_size={shared!r} has "
                                  f"no shared expert megatron_sp can build (a positive integer).")
        return
    for key in ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                "n_shared_experts"):
        if hf_config.get(key):
            raise ConversionError(f"{kind} with {key}={hf_config[key]} (a shared expert) is not "
                                  f"the {kind} architecture megatron_sp converts.")
    if any(".shared_expert" in name for name in state):
        raise ConversionError(f"the {kind} checkpoint holds shared-expert tensors, which {kind} "
                              f"does not have.")


def _gpt2_to_ours(hf_config, state):
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
    out = {"embedding.word_embeddings.weight": g("wte.weight"),
           "embedding.position_embeddings.weight": g("wpe.weight")}
    for i in range(L):
        p, o = f"h.{i}.", f"layers.{i}."
        out[o + "input_norm.weight"], out[o + "input_norm.bias"] = g(p + "ln_1.weight"), g(p + "ln_1.bias")
        w = g(p + "attn.c_attn.weight").t()                      # [3H, H]: [q | k | v]
        # [3, h, d, H] -> [h, 3, d, H]: per head its q, k, v rows
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


def _rope_fields(hf_config: dict) -> dict:
    """GPTConfig RoPE fields from rope_parameters (transformers 5) or rope_theta + rope_scaling (4.x)."""
    rope = dict(hf_config.get("rope_scaling") or {})
    rope.update(hf_config.get("rope_parameters") or {})
    kind = rope.get("rope_type", rope.get("type")) or "default"
    theta = rope.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    if rope.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConversionError("partial rotary embeddings (partial_rotary_factor != 1) are not "
                              "supported.")
    fields = dict(position_embedding_type="rope", rotary_base=float(theta))
    if kind == "default":
        return fields
    if kind == "llama3":
        return dict(fields, use_rope_scaling=True, rope_scaling_factor=float(rope["factor"]),
                    rope_low_freq_factor=float(rope["low_freq_factor"]),
                    rope_high_freq_factor=float(rope["high_freq_factor"]),
                    rope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    if kind == "yarn":
        max_pos = hf_config.get("max_position_embeddings", 2048)
        original = int(rope.get("original_max_position_embeddings") or max_pos)
        factor = float(rope.get("factor") or max_pos / original)
        mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if not (mscale and all_dim):       # transformers' rule: the plain 0.1 ln(factor) + 1
            mscale, all_dim = 1.0, 0.0
        explicit = rope.get("attention_factor")
        if explicit is not None and abs(explicit - yarn_mscale(factor, mscale, all_dim)) > 1e-9:
            raise ConversionError(f"YaRN attention_factor={explicit} differs from the mscale rule "
                                  f"({yarn_mscale(factor, mscale, all_dim)}); not supported.")
        return dict(fields, position_embedding_type="yarn", yarn_rotary_scaling_factor=factor,
                    yarn_original_max_position_embeddings=original,
                    yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
                    yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
                    yarn_mscale=float(mscale), yarn_mscale_all_dim=float(all_dim),
                    yarn_correction_range_round_to_int=bool(rope.get("truncate", True)))
    raise ConversionError(f"rope_type={kind!r} is not supported (default, llama3, yarn).")


def _sliding_window(hf_config: dict) -> int | None:
    """The attention window when some layer uses one (the model then refuses longer sequences)."""
    kind = hf_config.get("model_type")
    if kind in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe") \
            and not hf_config.get("use_sliding_window", False):
        return None
    layer_types = hf_config.get("layer_types")
    if layer_types and all(t == "full_attention" for t in layer_types):
        return None
    return hf_config.get("sliding_window")


def _moe_fields(hf_config: dict) -> dict:
    """GPTConfig MoE fields of a qwen3_moe / qwen2_moe / mixtral config.json (empty for the dense
    families)."""
    kind, L = hf_config["model_type"], hf_config["num_hidden_layers"]
    if kind not in MOE_FAMILIES:
        return {}
    n, k = _num_experts(hf_config), hf_config["num_experts_per_tok"]
    if kind == "mixtral":      # every layer has experts; Mixtral's router is our default routing
        return dict(num_experts=n, moe_router_topk=k, moe_layer_freq=1,
                    moe_ffn_hidden_size=hf_config["intermediate_size"])
    step = hf_config.get("decoder_sparse_step") or 1
    dense = set(hf_config.get("mlp_only_layers") or [])
    # transformers' Qwen3MoeDecoderLayer: layer i is sparse iff i is not in mlp_only_layers and
    # (i + 1) % decoder_sparse_step == 0 (num_experts > 0 is checked above)
    freq = [int(i not in dense and (i + 1) % step == 0) for i in range(L)]
    shared = {}
    if kind == "qwen2_moe":   # Qwen2MoeSparseMoeBlock: + sigmoid(x . g) * shared_expert(x)
        shared = dict(moe_shared_expert_intermediate_size=hf_config["shared_expert_intermediate_size"],
                      moe_shared_expert_gate=True)
    return dict(num_experts=n, moe_router_topk=k, moe_layer_freq=freq, **shared,
                moe_ffn_hidden_size=hf_config["moe_intermediate_size"],
                # norm_topk_prob: softmax over all, top-k, renormalised = our default routing
                # (softmax over the top-k logits), which --moe-router-pre-softmax's absence says;
                # without it: --moe-router-pre-softmax (the printed flags rebuild either exactly)
                moe_router_pre_softmax=not hf_config.get("norm_topk_prob", False))


def _moe_prefix(state, kind: str, i: int) -> str:
    """The HF module of layer i's experts: model.layers.{i}.mlp. (transformers 5, Qwen3-MoE) or
    model.layers.{i}.block_sparse_moe. (Mixtral as saved on disk)."""
    legacy = f"model.layers.{i}.block_sparse_moe."
    if kind == "mixtral" and legacy + "gate.weight" in state:
        return legacy
    return f"model.layers.{i}.mlp."


def _experts_to_ours(state, kind: str, i: int, num_experts: int) -> dict:
    """Layer i's router and experts, in our names, from either HF layout (module docstring)."""
    p, o = _moe_prefix(state, kind, i), f"layers.{i}.mlp."
    g = lambda key: _get(state, key).float()
    out = {o + "router.weight": g(p + "gate.weight")}                       # [E, H]
    if p + "experts.gate_up_proj" in state:                                  # fused (transformers 5)
        out[o + "experts.w1"] = g(p + "experts.gate_up_proj")                # [E, 2F, H]
        out[o + "experts.w2"] = g(p + "experts.down_proj")                   # [E, H, F]
        return out
    names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    e = lambda j, n: g(f"{p}experts.{j}.{n}.weight")
    out[o + "experts.w1"] = torch.stack([torch.cat([e(j, names[0]), e(j, names[1])], dim=0)
                                         for j in range(num_experts)])       # [E, 2F, H]
    out[o + "experts.w2"] = torch.stack([e(j, names[2]) for j in range(num_experts)])   # [E, H, F]
    return out


def _shared_expert_to_ours(state, i: int) -> dict:
    """Qwen2-MoE's shared expert (gate_proj, up_proj, down_proj) and its gate [1, H], in our names."""
    p, o = f"model.layers.{i}.mlp.", f"layers.{i}.mlp.shared_expert."
    g = lambda key: _get(state, key).float()
    return {o + "fc1.weight": torch.cat([g(p + "shared_expert.gate_proj.weight"),
                                         g(p + "shared_expert.up_proj.weight")], dim=0),  # [2Fs, H]
            o + "fc2.weight": g(p + "shared_expert.down_proj.weight"),                    # [H, Fs]
            o + "gate.weight": g(p + "shared_expert_gate.weight")}                        # [1, H]


def _llama_like_to_ours(hf_config, state):
    kind = hf_config["model_type"]
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"{kind} hidden_act={hf_config['hidden_act']!r} is not supported (silu).")
    if hf_config.get("attention_bias") or hf_config.get("mlp_bias"):
        raise ConversionError(f"{kind} with attention_bias or mlp_bias is not supported (only "
                              f"Qwen2's bias in q/k/v).")
    H, L = hf_config["hidden_size"], hf_config["num_hidden_layers"]
    h = hf_config["num_attention_heads"]
    gq = hf_config.get("num_key_value_heads") or h
    d = hf_config.get("head_dim") or H // h
    tied = bool(hf_config.get("tie_word_embeddings", False))
    qkv_bias = kind == "qwen2" or (kind == "qwen2_moe" and hf_config.get("qkv_bias", True))
    qk_norm = kind in ("qwen3", "qwen3_moe")
    config = GPTConfig(
        num_layers=L, hidden_size=H, num_attention_heads=h, num_query_groups=gq, kv_channels=d,
        ffn_hidden_size=hf_config["intermediate_size"], vocab_size=hf_config["vocab_size"],
        max_position_embeddings=hf_config.get("max_position_embeddings", 2048),
        normalization="RMSNorm", norm_epsilon=hf_config.get("rms_norm_eps", 1e-6),
        activation="swiglu", add_bias_linear=False, add_qkv_bias=qkv_bias, tie_embeddings=tied,
        qk_layernorm=qk_norm, sliding_window=_sliding_window(hf_config), **_rope_fields(hf_config),
        **_moe_fields(hf_config))
    g = lambda k: _get(state, k).float()
    out = {"embedding.word_embeddings.weight": g("model.embed_tokens.weight")}
    for i in range(L):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        out[o + "input_norm.weight"] = g(p + "input_layernorm.weight")
        q = g(p + "self_attn.q_proj.weight").reshape(gq, h // gq, d, H)   # [g, h/g, d, H]
        k = g(p + "self_attn.k_proj.weight").reshape(gq, 1, d, H)         # [g, 1, d, H]
        v = g(p + "self_attn.v_proj.weight").reshape(gq, 1, d, H)
        out[o + "attention.qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, H)  # [g*(h/g+2)*d, H]
        if qkv_bias:
            bq = g(p + "self_attn.q_proj.bias").reshape(gq, h // gq, d)      # [g, h/g, d]
            bk = g(p + "self_attn.k_proj.bias").reshape(gq, 1, d)
            bv = g(p + "self_attn.v_proj.bias").reshape(gq, 1, d)
            out[o + "attention.qkv.bias"] = torch.cat([bq, bk, bv], dim=1).reshape(-1)
        if qk_norm:
            out[o + "attention.q_layernorm.weight"] = g(p + "self_attn.q_norm.weight")
            out[o + "attention.k_layernorm.weight"] = g(p + "self_attn.k_norm.weight")
        out[o + "attention.proj.weight"] = g(p + "self_attn.o_proj.weight")
        out[o + "post_attention_norm.weight"] = g(p + "post_attention_layernorm.weight")
        if config.is_moe_layer(i):
            out.update(_experts_to_ours(state, kind, i, config.num_experts))
            if config.moe_shared_expert_intermediate_size:
                out.update(_shared_expert_to_ours(state, i))
            continue
        out[o + "mlp.fc1.weight"] = torch.cat([g(p + "mlp.gate_proj.weight"),
                                               g(p + "mlp.up_proj.weight")], dim=0)
        out[o + "mlp.fc2.weight"] = g(p + "mlp.down_proj.weight")
    out["final_norm.weight"] = g("model.norm.weight")
    if not tied:
        out["output_layer.weight"] = g("lm_head.weight")
    return config, out


# Ours -> HF ---------------------------------------------------------------------------------------------

def infer_family(config: GPTConfig) -> str:
    """The HF family a GPTConfig exports to: gpt2, qwen3 (qk-norm), qwen2 (q/k/v bias only),
    mistral (a sliding window) or llama; with experts (num_experts) qwen3_moe (qk-norm),
    qwen2_moe (a gated shared expert) or mixtral."""
    c = config
    if (c.normalization == "LayerNorm" and c.activation in ("gelu_tanh", "gelu")
            and c.position_embedding_type == "learned_absolute"):
        return "gpt2"
    if not (c.normalization == "RMSNorm" and c.activation == "swiglu" and c.uses_rope):
        raise ConversionError(
            f"no Hugging Face architecture matches normalization={c.normalization}, activation="
            f"{c.activation}, position_embedding_type={c.position_embedding_type} (GPT-2: "
            f"LayerNorm, gelu_tanh, learned_absolute; Llama/Mistral/Qwen: RMSNorm, swiglu, rope).")
    if c.num_experts is not None:
        if c.moe_shared_expert_gate:
            return "qwen2_moe"
        return "qwen3_moe" if c.qk_layernorm else "mixtral"
    if c.qk_layernorm:
        return "qwen3"
    if c.add_qkv_bias and not c.add_bias_linear:
        return "qwen2"
    return "mistral" if c.sliding_window else "llama"


def _check_family(c: GPTConfig, family: str) -> None:
    """Refuse an export the family cannot represent, with the reason."""
    needs = {"llama": (False, False), "mistral": (False, False), "qwen2": (True, False),
             "qwen3": (False, True), "qwen3_moe": (False, True),
             "qwen2_moe": (bool(c.add_qkv_bias), False),   # transformers' qkv_bias either way
             "mixtral": (False, False)}   # (q/k/v bias, qk-norm)
    bias, norm = needs[family]
    if c.add_bias_linear or bool(c.add_qkv_bias) != bias or bool(c.qk_layernorm) != norm:
        raise ConversionError(
            f"{family} needs " + ("a bias in q/k/v only" if bias else "no biases")
            + (" and qk-norm" if norm else " and no qk-norm")
            + f"; this model has add_bias_linear={c.add_bias_linear}, add_qkv_bias={c.add_qkv_bias},"
              f" qk_layernorm={c.qk_layernorm}.")
    if c.sliding_window and family in ("llama",):
        raise ConversionError(f"llama has no sliding window; this model records "
                              f"sliding_window={c.sliding_window}: export it as mistral.")
    if family in MOE_FAMILIES:
        _check_moe_family(c, family)
    elif c.num_experts is not None:
        raise ConversionError(f"{family} has no experts; this model has num_experts="
                              f"{c.num_experts}: export it as "
                              f"{'qwen3_moe' if c.qk_layernorm else 'mixtral'}.")


def _check_moe_family(c: GPTConfig, family: str) -> None:
    """Refuse a qwen3_moe / qwen2_moe / mixtral export whose experts or routing the family cannot
    hold. Not checked, on purpose: the load-balancing / z-loss coefficients and the capacity factor are
    training choices (transformers' models route every token, as ours does without a capacity)."""
    if c.num_experts is None:
        raise ConversionError(f"{family} is a mixture-of-experts family but this model has no "
                              f"experts (num_experts None): export it as "
                              f"{'qwen3' if family == 'qwen3_moe' else 'mistral or llama'}.")
    if family == "qwen2_moe":
        if not c.moe_shared_expert_gate:
            raise ConversionError("qwen2_moe has a sigmoid-gated shared expert; this model has "
                                  "none (moe_shared_expert_gate False): export it as qwen3_moe "
                                  "or mixtral.")
    elif c.moe_shared_expert_intermediate_size:
        raise ConversionError(f"{family} has no shared expert; this model has "
                              f"moe_shared_expert_intermediate_size="
                              f"{c.moe_shared_expert_intermediate_size}.")
    if c.moe_router_score_function != "softmax" or c.moe_router_topk_scaling_factor is not None:
        raise ConversionError(f"{family} routes with a softmax and unscaled weights; this model "
                              f"has moe_router_score_function={c.moe_router_score_function!r}, "
                              f"moe_router_topk_scaling_factor={c.moe_router_topk_scaling_factor}.")
    if family == "mixtral":
        if not all(c.is_moe_layer(i) for i in range(c.num_layers)):
            raise ConversionError(f"mixtral has experts in every layer; this model's "
                                  f"moe_layer_freq={c.moe_layer_freq} leaves dense layers "
                                  f"(qwen3_moe, with qk-norm, can hold them).")
        if c.moe_router_pre_softmax and not c.moe_norm_topk_prob:
            raise ConversionError("mixtral renormalises its top-k routing weights; this model has "
                                  "moe_router_pre_softmax without moe_norm_topk_prob.")


def _qwen3_moe_layers(c: GPTConfig) -> dict:
    """decoder_sparse_step and mlp_only_layers of our MoE layer pattern: the step that leaves the
    fewest mlp_only_layers (transformers: layer i sparse iff i not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0)."""
    sparse = {i for i in range(c.num_layers) if c.is_moe_layer(i)}
    best = None
    for step in range(1, c.num_layers + 1):
        stepped = {i for i in range(c.num_layers) if (i + 1) % step == 0}
        if sparse <= stepped and (best is None or len(stepped - sparse) < len(best[1])):
            best = (step, sorted(stepped - sparse))
    step, dense = best if sparse else (1, list(range(c.num_layers)))
    return {"decoder_sparse_step": step, "mlp_only_layers": dense}


def _rope_parameters(c: GPTConfig) -> dict:
    rope = {"rope_type": "default", "rope_theta": c.rotary_base}
    if c.use_rope_scaling:
        rope.update(rope_type="llama3", factor=c.rope_scaling_factor,
                    low_freq_factor=c.rope_low_freq_factor, high_freq_factor=c.rope_high_freq_factor,
                    original_max_position_embeddings=c.rope_original_max_position_embeddings)
    if c.position_embedding_type == "yarn":
        rope.update(rope_type="yarn", factor=c.yarn_rotary_scaling_factor,
                    original_max_position_embeddings=(c.yarn_original_max_position_embeddings
                                                      or c.max_position_embeddings),
                    beta_fast=c.yarn_beta_fast, beta_slow=c.yarn_beta_slow,
                    truncate=c.yarn_correction_range_round_to_int)
        if c.yarn_mscale and c.yarn_mscale_all_dim:
            rope.update(mscale=c.yarn_mscale, mscale_all_dim=c.yarn_mscale_all_dim)
    return rope


def megatron_sp_to_hf(config: GPTConfig, full: dict[str, torch.Tensor], family: str = "auto",
                      token_ids: dict | None = None, fused_experts: bool = False
                      ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(HF config.json dict, HF state dict) of the family (auto: `infer_family`).

    token_ids: {"bos_token_id": ..., "eos_token_id": ..., "pad_token_id": ...} from the tokenizer,
    written into the config when given.
    fused_experts (qwen3_moe, qwen2_moe, mixtral): the experts as transformers 5's in-memory parameters
    (mlp.experts.gate_up_proj / down_proj, for `load_state_dict`) instead of the per-expert tensors
    of the Hub checkpoints and of transformers' save_pretrained (what a model folder holds).
    """
    family = infer_family(config) if family == "auto" else family
    if config.rotary_percent != 1.0:
        raise ConversionError(f"--rotary-percent {config.rotary_percent:g} (RoPE on part of each "
                              f"head) has no equivalent in the {FAMILIES} exports.")
    if config.apply_layernorm_1p:   # --apply-layernorm-1p stores gamma - 1: export gamma itself
        full = {k: v + 1 if "norm" in k and k.endswith(".weight") else v for k, v in full.items()}
    if family == "gpt2":
        hf, state = _ours_to_gpt2(config, full)
    elif family in LLAMA_LIKE + MOE_FAMILIES:
        if infer_family(config) == "gpt2":
            raise ConversionError(f"a GPT-2-style model (LayerNorm, gelu, learned positions) cannot "
                                  f"be exported as {family}.")
        _check_family(config, family)
        hf, state = _ours_to_llama_like(config, full, family, fused_experts)
    else:
        raise ConversionError(f"unknown family {family!r}; choose one of {FAMILIES} or auto.")
    hf.update({k: v for k, v in (token_ids or {}).items() if v is not None and v >= 0})
    return hf, state


def _ours_to_gpt2(c: GPTConfig, full):
    H, L, h, g, d, F = (c.hidden_size, c.num_layers, c.num_attention_heads, c.num_query_groups,
                        c.kv_channels, c.ffn_hidden_size)
    if not (c.add_bias_linear and c.add_qkv_bias and c.tie_embeddings and g == h and d * h == H
            and not c.qk_layernorm):
        raise ConversionError("GPT-2 export needs biases, tied embeddings, no GQA, no qk-norm and "
                              "kv_channels = hidden/heads; this model differs.")
    s = {"transformer.wte.weight": full["embedding.word_embeddings.weight"],
         "transformer.wpe.weight": full["embedding.position_embeddings.weight"]}
    for i in range(L):
        o, p = f"layers.{i}.", f"transformer.h.{i}."
        s[p + "ln_1.weight"], s[p + "ln_1.bias"] = full[o + "input_norm.weight"], full[o + "input_norm.bias"]
        # [h, 3, d, H] -> [3, h, d, H]: back to [q | k | v]
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


def _ours_to_llama_like(c: GPTConfig, full, family: str, fused_experts: bool = False):
    H, L, h, g, d = (c.hidden_size, c.num_layers, c.num_attention_heads, c.num_query_groups,
                     c.kv_channels)
    s = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"]}
    for i in range(L):
        o, p = f"layers.{i}.", f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = full[o + "input_norm.weight"]
        qkv = full[o + "attention.qkv.weight"].reshape(g, h // g + 2, d, H)   # [g, h/g + 2, d, H]
        s[p + "self_attn.q_proj.weight"] = qkv[:, :h // g].reshape(h * d, H).contiguous()
        s[p + "self_attn.k_proj.weight"] = qkv[:, h // g].reshape(g * d, H).contiguous()
        s[p + "self_attn.v_proj.weight"] = qkv[:, h // g + 1].reshape(g * d, H).contiguous()
        if c.add_qkv_bias:
            b = full[o + "attention.qkv.bias"].reshape(g, h // g + 2, d)          # [g, h/g + 2, d]
            s[p + "self_attn.q_proj.bias"] = b[:, :h // g].reshape(h * d).contiguous()
            s[p + "self_attn.k_proj.bias"] = b[:, h // g].reshape(g * d).contiguous()
            s[p + "self_attn.v_proj.bias"] = b[:, h // g + 1].reshape(g * d).contiguous()
        if c.qk_layernorm:
            s[p + "self_attn.q_norm.weight"] = full[o + "attention.q_layernorm.weight"]
            s[p + "self_attn.k_norm.weight"] = full[o + "attention.k_layernorm.weight"]
        s[p + "self_attn.o_proj.weight"] = full[o + "attention.proj.weight"]
        s[p + "post_attention_layernorm.weight"] = full[o + "post_attention_norm.weight"]
        if c.is_moe_layer(i):
            s.update(_experts_to_hf(c, full, family, i, fused_experts))
            if family == "qwen2_moe":
                s.update(_shared_expert_to_hf(full, i))
            continue
        gate, up = full[o + "mlp.fc1.weight"].chunk(2, dim=0)
        s[p + "mlp.gate_proj.weight"], s[p + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
        s[p + "mlp.down_proj.weight"] = full[o + "mlp.fc2.weight"]
    s["model.norm.weight"] = full["final_norm.weight"]
    if not c.tie_embeddings:
        s["lm_head.weight"] = full["output_layer.weight"]
    return llama_like_config(c, family), s


def _experts_to_hf(c: GPTConfig, full, family: str, i: int, fused: bool) -> dict:
    """Layer i's router and experts in HF names: fused (transformers 5 parameters) or per expert
    (Hub / save_pretrained layout; Mixtral's under block_sparse_moe)."""
    o = f"layers.{i}.mlp."
    w1, w2 = full[o + "experts.w1"], full[o + "experts.w2"]          # [E, 2F, H], [E, H, F]
    if fused:
        p = f"model.layers.{i}.mlp."
        return {p + "gate.weight": full[o + "router.weight"],
                p + "experts.gate_up_proj": w1.contiguous(), p + "experts.down_proj": w2.contiguous()}
    p = f"model.layers.{i}." + ("block_sparse_moe." if family == "mixtral" else "mlp.")
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    s = {p + "gate.weight": full[o + "router.weight"]}
    for j in range(c.num_experts):
        gate, up = w1[j].chunk(2, dim=0)                                   # [F, H] each
        s[f"{p}experts.{j}.{names[0]}.weight"] = gate.contiguous()
        s[f"{p}experts.{j}.{names[1]}.weight"] = up.contiguous()
        s[f"{p}experts.{j}.{names[2]}.weight"] = w2[j].contiguous()      # [H, F]
    return s


def _shared_expert_to_hf(full, i: int) -> dict:
    """Layer i's gated shared expert in Qwen2-MoE's names."""
    o, p = f"layers.{i}.mlp.shared_expert.", f"model.layers.{i}.mlp."
    gate, up = full[o + "fc1.weight"].chunk(2, dim=0)                      # [Fs, H] each
    return {p + "shared_expert.gate_proj.weight": gate.contiguous(),
            p + "shared_expert.up_proj.weight": up.contiguous(),
            p + "shared_expert.down_proj.weight": full[o + "fc2.weight"],
            p + "shared_expert_gate.weight": full[o + "gate.weight"]}


def llama_like_config(c: GPTConfig, family: str) -> dict:
    """config.json of a llama / mistral / qwen2 / qwen3 / qwen3_moe / qwen2_moe / mixtral export."""
    H, L, h, g, d, F = (c.hidden_size, c.num_layers, c.num_attention_heads, c.num_query_groups,
                        c.kv_channels, c.ffn_hidden_size)
    rope = _rope_parameters(c)
    hf = {"architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": c.vocab_size,
          "hidden_size": H, "intermediate_size": F, "num_hidden_layers": L,
          "num_attention_heads": h, "num_key_value_heads": g, "head_dim": d,
          "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.norm_epsilon,
          "rope_theta": c.rotary_base, "rope_parameters": rope, "hidden_act": "silu",
          "tie_word_embeddings": bool(c.tie_embeddings), "torch_dtype": "float32"}
    if family == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    if family == "qwen3":
        hf.update(attention_bias=False)
    if family in ("qwen2", "qwen3"):
        hf.update(use_sliding_window=False, sliding_window=None)
    if family in ("mistral", "mixtral"):
        hf.update(sliding_window=c.sliding_window)
    if family == "qwen2_moe":
        hf.update(qkv_bias=bool(c.add_qkv_bias),
                  shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size)
    if family in ("qwen3_moe", "qwen2_moe"):   # router_aux_loss_coef: transformers' default
        hf.update(attention_bias=False, use_sliding_window=bool(c.sliding_window),
                  sliding_window=c.sliding_window, num_experts=c.num_experts,
                  num_experts_per_tok=c.moe_router_topk,
                  moe_intermediate_size=c.moe_ffn_hidden_size,
                  # the default routing (softmax over the top-k logits) is the renormalised one
                  norm_topk_prob=bool(c.moe_norm_topk_prob or not c.moe_router_pre_softmax),
                  **_qwen3_moe_layers(c))
    if family == "mixtral":     # intermediate_size is the experts' (every layer has experts)
        hf.update(intermediate_size=c.moe_ffn_hidden_size, num_local_experts=c.num_experts,
                  num_experts_per_tok=c.moe_router_topk, router_jitter_noise=0.0)
    return hf


def model_from_full(config: GPTConfig, full: dict[str, torch.Tensor], attention_backend="sdpa"):
    """A one-rank GPTModel holding `full` (vocabulary rows padded with zeros)."""
    from .gpt import GPTModel
    model = GPTModel(config, attention_backend=attention_backend)
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


def full_tensors(model) -> dict[str, torch.Tensor]:
    """{our name: full tensor} of a one-rank model, vocabulary rows unpadded."""
    out = {}
    for name, p in model.named_parameters():
        rows = getattr(p, "real_rows", None)
        out[name] = (p[:rows] if rows else p).detach().float().contiguous()
    return out


def load_hf_folder(path: str, attention_backend="sdpa"):
    """A one-rank GPTModel (eval mode) from a Hugging Face model folder of a family above."""
    config, full = hf_to_megatron_sp(*read_hf_folder(path))
    return model_from_full(config, full, attention_backend).eval()


def token_ids_of(tokenizer) -> dict:
    """bos/eos/pad ids of a transformers tokenizer (None where it has none)."""
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
