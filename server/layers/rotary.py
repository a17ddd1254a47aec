"""Rotary position embedding: a precomputed ``cos_sin_cache`` and the backend's ``apply_rotary``.

The inverse frequencies come from Hugging Face Transformers' own functions (``ROPE_INIT_FUNCTIONS`` in
``transformers.modeling_rope_utils``: linear, dynamic, yarn, longrope, llama3, ...), so positions rotate
exactly as in the reference implementation. The cache is fp32 ``[max_position, rotary_dim]``: cos in the
first half, sin in the second (the kernel contract); ``rotary_dim < head_dim`` (a
``partial_rotary_factor``) rotates the first ``rotary_dim`` features of each head and passes the rest.

Two RoPE types change their frequencies with the sequence length in Transformers (its
``dynamic_rope_update``): ``longrope`` (short factors up to ``original_max_position_embeddings``, long
ones past it) and ``dynamic`` (NTK: the base grows once the sequence passes ``max_position_embeddings``).
A paged KV cache keeps keys rotated as they were computed, so here every position has its own row: the
row of position ``p`` is what Transformers computes for a sequence of ``p + 1`` tokens. That equals
Transformers' ``generate`` token for token when the prompt fits below the threshold and decoding goes past
it (each decode step there recomputes the frequencies for ``p + 1`` and keeps the cached keys). What
differs: a prompt that is longer than the threshold at once, which Transformers rotates entirely with the
frequencies of its full length (vLLM differs there too: it picks one set per batch).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

# "default" is Transformers' per-model default; the rest its ROPE_INIT_FUNCTIONS that we have tested.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's RoPE settings for ``layer_type`` (Gemma 3 nests them by attention type) as one flat
    dict with ``rope_type`` and ``rope_theta``, after Transformers' own standardisation."""
    standardize = getattr(hf_config, "standardize_rope_params", None)
    if standardize is not None:
        standardize()
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    params = dict(params)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    return params


def _nested(hf_config: Any, layer_type: str | None) -> str | None:
    """``layer_type`` where the config nests RoPE settings by it (Transformers' argument), else None."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return layer_type if layer_type is not None and isinstance(params.get(layer_type), dict) else None


def compute_inv_freq(
    hf_config: Any, head_dim: int, layer_type: str | None = None, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim // 2], attention_scaling)`` as Transformers computes them for ``seq_len``."""
    params = rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (float(params["rope_theta"]) ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](
        hf_config, torch.device("cpu"), seq_len=seq_len, layer_type=_nested(hf_config, layer_type)
    )
    return inv_freq.float(), float(scaling)


def _per_position_threshold(hf_config: Any, params: dict[str, Any]) -> int | None:
    """The first sequence length whose frequencies differ, for the length-dependent RoPE types."""
    if params["rope_type"] == "longrope":
        return int(params["original_max_position_embeddings"])
    if params["rope_type"] == "dynamic":
        return int(hf_config.max_position_embeddings)
    return None


def _dynamic_inv_freqs(
    params: dict[str, Any], inv_freq: torch.Tensor, threshold: int, end: int
) -> torch.Tensor:
    """``[end - threshold, rotary_dim // 2]``: Transformers' ``_compute_dynamic_ntk_parameters`` for every
    ``seq_len = p + 1``, ``p`` in ``threshold .. end - 1``, at once (one call each takes seconds for a
    real model's table). Its base is a Python float (a double) raised to float32 exponents."""
    dim = 2 * inv_freq.shape[0]
    factor = float(params["factor"])
    seq_lens = torch.arange(threshold + 1, end + 1, dtype=torch.float64)
    bases = float(params["rope_theta"]) * ((factor * seq_lens / threshold) - (factor - 1)) ** (
        dim / (dim - 2)
    )
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (bases.float()[:, None] ** exponents[None, :])


def rope_max_position(hf_config: Any, layer_type: str | None = None) -> int:
    """How many positions the rotary table covers: ``max_position_embeddings``, times ``factor`` for
    dynamic NTK (whose point is to run past it)."""
    params = rope_parameters(hf_config, layer_type)
    limit = int(hf_config.max_position_embeddings)
    if params["rope_type"] == "dynamic":
        return int(limit * float(params["factor"]))
    return limit


def build_cos_sin_cache(
    hf_config: Any, head_dim: int, max_position: int, layer_type: str | None = None
) -> torch.Tensor:
    """fp32 ``[max_position, rotary_dim]``: ``cos(p * f) * s`` then ``sin(p * f) * s``, computed on CPU."""
    params = rope_parameters(hf_config, layer_type)
    inv_freq, scaling = compute_inv_freq(hf_config, head_dim, layer_type)
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    threshold = _per_position_threshold(hf_config, params)
    if threshold is not None and threshold < max_position:
        if params["rope_type"] == "longrope":  # one long set for every position past the threshold
            long_freq, _ = compute_inv_freq(hf_config, head_dim, layer_type, seq_len=threshold + 1)
            freqs[threshold:] = torch.outer(positions[threshold:], long_freq)
        else:  # dynamic: a base of its own for every sequence length past the threshold
            freqs[threshold:] = positions[threshold:, None] * _dynamic_inv_freqs(
                params, inv_freq, threshold, max_position
            )
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotates q ``[T, num_heads, head_dim]`` and k ``[T, num_kv_heads, head_dim]`` by their positions."""

    def __init__(
        self,
        hf_config: Any,
        head_dim: int,
        max_position: int,
        kernels: ModuleType,
        device: torch.device,
        layer_type: str | None = None,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.head_dim = head_dim
        cache = build_cos_sin_cache(hf_config, head_dim, max_position, layer_type)
        self.rotary_dim = cache.shape[-1]
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary_dim == self.head_dim:
            return self.kernels.apply_rotary(q, k, positions, self.cos_sin_cache)
        rot = self.rotary_dim
        q_rot, k_rot = self.kernels.apply_rotary(
            q[..., :rot].contiguous(), k[..., :rot].contiguous(), positions, self.cos_sin_cache
        )
        return torch.cat((q_rot, q[..., rot:]), dim=-1), torch.cat((k_rot, k[..., rot:]), dim=-1)


class MRotaryEmbedding(nn.Module):
    """Multimodal RoPE (Qwen2-VL, Qwen2.5-VL): positions ``[3, T]`` (temporal, height, width), each of the
    rotary frequencies taking its angle from one of the three as ``mrope_section`` splits them (Transformers'
    ``apply_multimodal_rotary_pos_emb``). Text tokens have three equal positions, where it is plain RoPE:
    1-D positions go to the wrapped table's kernel as they are."""

    def __init__(self, rotary: RotaryEmbedding, mrope_section: list[int]) -> None:
        super().__init__()
        if sum(mrope_section) * 2 != rotary.rotary_dim:
            raise ValueError(f"mrope_section {mrope_section} does not split the rotary dimension "
                             f"{rotary.rotary_dim} (its sum must be half of it)")
        self.rotary = rotary
        self.mrope_section = list(mrope_section)

    @property
    def cos_sin_cache(self) -> torch.Tensor:
        return self.rotary.cos_sin_cache

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return self.rotary(positions, q, k)
        cos, sin = self.rotary.cos_sin_cache[positions.long()].chunk(2, dim=-1)  # [3, T, rot / 2] each
        cos = torch.cat([part[i % 3] for i, part in enumerate(cos.split(self.mrope_section, -1))], -1)
        sin = torch.cat([part[i % 3] for i, part in enumerate(sin.split(self.mrope_section, -1))], -1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rot = self.rotary.rotary_dim
        return _rotated(q, cos, sin, rot), _rotated(k, cos, sin, rot)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    """Neox-style rotation of ``x``'s first ``rot`` dimensions, in float32 as the kernels compute it."""
    x1, x2 = x[..., :rot].float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return torch.cat((rotated, x[..., rot:]), dim=-1) if rot < x.shape[-1] else rotated
