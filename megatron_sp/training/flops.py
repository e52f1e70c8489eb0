"""Model FLOPs and MFU, with Megatron-LM's formula so that figures compare with Megatron's (docs/design.md §9)."""
from __future__ import annotations

import torch

# Dense bf16 peak TFLOP/s per device, used for MFU (state the peak in the log).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0,
               "L40S": 362.0, "B200": 2250.0, "GH200": 989.0}
# Dense FP8 peak TFLOP/s, for MFU under --fp8-format (devices without FP8 use the bf16 peak).
FP8_PEAK_TFLOPS = {"H200": 1979.0, "H100": 1979.0, "H800": 1979.0, "L40S": 733.0, "B200": 4500.0,
                   "GH200": 1979.0}


def num_floating_point_operations(batch: int, seq: int, num_layers: int, hidden: int, heads: int,
                                  query_groups: int, ffn: int, padded_vocab: int, kv_channels: int,
                                  swiglu: bool) -> float:
    """12*B*s*L*H^2*((1 + g/a + s/H)*q + (F/H)*gated + V/(2*L*H)), q = kv_channels*a/H."""
    gated = 1.5 if swiglu else 1.0
    q = kv_channels * heads / hidden
    return 12.0 * batch * seq * num_layers * hidden ** 2 * (
        (1.0 + query_groups / heads + seq / hidden) * q
        + (ffn / hidden) * gated
        + padded_vocab / (2.0 * num_layers * hidden))


def flops_for_config(config, batch: int, seq: int, tp: int = 1) -> float:
    """Megatron's formula for `config`; with experts (num_experts) the MLP term counts the active
    width, as Megatron-LM does for MoE: moe_ffn_hidden_size x topk (+ the shared expert) in the
    MoE layers, ffn_hidden_size in the dense ones, averaged over the layers."""
    return num_floating_point_operations(
        batch, seq, config.num_layers, config.hidden_size, config.num_attention_heads,
        config.num_query_groups, active_ffn_hidden_size(config), config.padded_vocab_size(tp),
        config.kv_channels, config.activation == "swiglu")


def active_ffn_hidden_size(config) -> float:
    """The MLP width a token passes through, averaged over the layers (ffn_hidden_size for a
    dense model)."""
    if getattr(config, "num_experts", None) is None:
        return config.ffn_hidden_size
    moe = config.moe_ffn_hidden_size * config.moe_router_topk \
        + (config.moe_shared_expert_intermediate_size or 0)
    widths = [moe if config.is_moe_layer(i) else config.ffn_hidden_size
              for i in range(config.num_layers)]
    return sum(widths) / len(widths)


def device_peak_tflops(override: float | None = None, fp8: bool = False) -> float | None:
    """Peak bf16 TFLOP/s of this device (None when unknown, e.g. CPU); with `fp8` its FP8 peak
    where it has one (MFU under --fp8-format: a conservative figure, as only the projections and
    MLP matmuls run in FP8)."""
    if override:
        return override
    if not torch.cuda.is_available():
        return None
    return peak_of(torch.cuda.get_device_name(), fp8)


def peak_of(name: str, fp8: bool = False) -> float | None:
    """The dense peak TFLOP/s of the device called `name` (FP8's with `fp8` where it has one)."""
    for table in ((FP8_PEAK_TFLOPS, PEAK_TFLOPS) if fp8 else (PEAK_TFLOPS,)):
        for key, value in table.items():
            if key in name:
                return value
    return None
