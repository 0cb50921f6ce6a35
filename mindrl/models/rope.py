"""RoPE scaling: the rotary frequencies and the attention factor of each scaling mindrl builds.

One set of formulas for the trainer and the Megatron rollout engine, written as HF transformers'
rope initialisers and vLLM compute them (vLLM gets the same scaling from the config.json), so the
actor, both engines and HF score the same tokens alike. `dynamic` is plain RoPE: HF and vLLM change
the frequencies only beyond max_position_embeddings, which no mindrl sequence reaches.
"""

from __future__ import annotations

import math

import torch

from mindrl.config import ModelArch


def _plain(arch: ModelArch) -> torch.Tensor:
    dim = arch.rotary_dim
    return 1.0 / (arch.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def _original(arch: ModelArch) -> int:
    return arch.rope_scaling_original_max_position_embeddings or arch.max_position_embeddings


def _llama3(arch: ModelArch, inv_freq: torch.Tensor) -> torch.Tensor:
    factor, low, high, original = (arch.rope_scaling_factor, arch.low_freq_factor, arch.high_freq_factor,
                                   _original(arch))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, blended, scaled)


def _yarn(arch: ModelArch) -> torch.Tensor:
    """Interpolated frequencies (÷ factor) below beta_slow rotations over the original context, the plain ones
    above beta_fast, a linear ramp between (HF's truncated correction range)."""
    dim, base, factor, original = arch.rotary_dim, arch.rotary_base, arch.rope_scaling_factor, _original(arch)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(arch.beta_fast)), 0)
    high = min(math.ceil(correction_dim(arch.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    powers = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated = 1 - ramp
    return (1.0 / (factor * powers)) * (1 - extrapolated) + (1.0 / powers) * extrapolated


def inv_freq(arch: ModelArch) -> torch.Tensor:
    """The [rotary_dim / 2] fp32 rotary frequencies of `arch`, its scaling applied."""
    kind = arch.rope_scaling_type
    if kind == "yarn":
        return _yarn(arch)
    plain = _plain(arch)
    if kind == "llama3":
        return _llama3(arch, plain)
    if kind == "linear":
        return plain / arch.rope_scaling_factor
    return plain


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(arch: ModelArch) -> float:
    """What YaRN multiplies the rotated queries and keys by (HF scales cos and sin); 1 for every other scaling."""
    if arch.rope_scaling_type != "yarn":
        return 1.0
    factor, mscale, all_dim = arch.rope_scaling_factor, arch.rope_scaling_mscale, arch.rope_scaling_mscale_all_dim
    if mscale and all_dim:
        return _mscale(factor, mscale) / _mscale(factor, all_dim)
    return _mscale(factor)


def softmax_factor(arch: ModelArch) -> float:
    """What the scaling multiplies the attention scores by. YaRN scales the rotated queries and keys alike, which
    scales a wholly rotated head's scores by the factor's square; multi-latent attention rotates part of each head
    only, and DeepSeek's YaRN scales its scores by mscale(factor, mscale_all_dim)² instead (its attention factor is
    1: ModelArch requires rope_scaling_mscale = rope_scaling_mscale_all_dim)."""
    if not arch.multi_latent_attention:
        return attention_factor(arch) ** 2
    if arch.rope_scaling_type != "yarn":
        return 1.0
    return _mscale(arch.rope_scaling_factor, arch.rope_scaling_mscale_all_dim) ** 2


def yarn_positions(arch: ModelArch) -> int | None:
    """The positions a YaRN model's scaling reaches, original context × factor (vLLM's rotary table has that many
    rows and reads past them unchecked); None for every other scaling."""
    if arch.rope_scaling_type != "yarn":
        return None
    return int(_original(arch) * arch.rope_scaling_factor)
