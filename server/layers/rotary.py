"""Rotary position embedding: a precomputed ``cos_sin_cache`` and the backend's ``apply_rotary``.

The inverse frequencies follow Hugging Face Transformers formula for formula (default, linear, llama3,
yarn), so positions rotate exactly as in the reference implementation. The cache is fp32
``[max_position, head_dim]``: cos in the first half, sin in the second (the kernel contract).
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE settings as one flat dict with ``rope_type`` and ``rope_theta``.

    Reads both the Transformers 5 form (``rope_parameters``) and the older one (``rope_theta`` plus
    ``rope_scaling``).
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    return params


def compute_inv_freq(head_dim: int, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2], attention_scaling)`` for the RoPE settings ``params``."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    base = float(params["rope_theta"])
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    return _yarn(base, dim, params, max_position)


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(base: float, dim: int, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original_max

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def build_cos_sin_cache(
    head_dim: int, max_position: int, params: dict[str, Any], device: torch.device
) -> torch.Tensor:
    """fp32 ``[max_position, head_dim]``: ``cos(p * f) * s`` then ``sin(p * f) * s``, computed on CPU."""
    inv_freq, scaling = compute_inv_freq(head_dim, params, max_position)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
    cache = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
    return cache.to(device)


class RotaryEmbedding(nn.Module):
    """Rotates q ``[T, num_heads, head_dim]`` and k ``[T, num_kv_heads, head_dim]`` by their positions."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: dict[str, Any],
        kernels: ModuleType,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.register_buffer(
            "cos_sin_cache", build_cos_sin_cache(head_dim, max_position, params, device), persistent=False
        )

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.apply_rotary(q, k, positions, self.cos_sin_cache)
