"""RoPE frequencies: plain (Su et al.), Llama-3.1 scaling and YaRN (Peng et al. 2023).

Each rule gives the inverse frequencies theta_i (i < d/2) of the rotary embedding and the
attention scaling that multiplies cos and sin. They equal Megatron-LM's (`--use-rope-scaling`,
`--position-embedding-type yarn`) and transformers' rope_type "llama3" / "yarn".

    plain     theta_i = base^(-2i/d)
    llama3    wavelength lambda_i = 2 pi / theta_i, L the original context:
              lambda_i < L/high  -> theta_i (high frequencies kept)
              lambda_i > L/low   -> theta_i / factor (low frequencies interpolated)
              otherwise          -> (1 - a) theta_i / factor + a theta_i,
                                    a = (L/lambda_i - low) / (high - low)
    yarn      theta_i blended between theta_i (extrapolation) and theta_i / factor (interpolation)
              by a linear ramp over the dimensions whose number of rotations over L lies between
              beta_slow and beta_fast; cos and sin scaled by mscale = 0.1 ln(factor) + 1 (or the
              mscale / mscale_all_dim ratio)
"""
from __future__ import annotations

import math

import torch


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """theta_i = base^(-2i/d), [d/2] float64."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_context: int) -> torch.Tensor:
    """Llama-3.1's frequency rule (see the module docstring), [d/2] -> [d/2]."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, out)


def _yarn_correction_dim(rotations: float, dim: int, base: float, context: int) -> float:
    """The dimension whose frequency turns `rotations` times over `context` positions."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(head_dim: int, base: float, factor: float, original_context: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0,
                  round_to_int: bool = True) -> torch.Tensor:
    """YaRN's "NTK-by-parts" frequencies, [d/2] float64."""
    extrapolation = default_inv_freq(head_dim, base)
    interpolation = extrapolation / factor
    low = _yarn_correction_dim(beta_fast, head_dim, base, original_context)
    high = _yarn_correction_dim(beta_slow, head_dim, base, original_context)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001   # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp                        # 1: extrapolate (high frequency), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep


def yarn_mscale(factor: float, mscale: float = 1.0, mscale_all_dim: float = 0.0) -> float:
    """The attention scaling of cos and sin (YaRN's "concentration factor")."""
    def get(scale, m):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if mscale and mscale_all_dim:
        return get(factor, mscale) / get(factor, mscale_all_dim)
    return get(factor, 1.0)


def rope_frequencies(config) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [ceil(r/2)] float32, cos/sin scaling) of a GPTConfig's RoPE, over its
    rotary dimensions r (head_dim, or int(head_dim * --rotary-percent) as Megatron-LM)."""
    d, base = config.rotary_dim, config.rotary_base
    if config.position_embedding_type == "yarn":
        original = config.yarn_original_max_position_embeddings or config.max_position_embeddings
        inv_freq = yarn_inv_freq(d, base, config.yarn_rotary_scaling_factor, original,
                                 config.yarn_beta_fast, config.yarn_beta_slow,
                                 config.yarn_correction_range_round_to_int)
        scale = yarn_mscale(config.yarn_rotary_scaling_factor, config.yarn_mscale,
                            config.yarn_mscale_all_dim)
        return inv_freq.float(), scale
    inv_freq = default_inv_freq(d, base)
    if config.use_rope_scaling:
        inv_freq = llama3_inv_freq(inv_freq, config.rope_scaling_factor,
                                   config.rope_low_freq_factor, config.rope_high_freq_factor,
                                   config.rope_original_max_position_embeddings)
    return inv_freq.float(), 1.0
