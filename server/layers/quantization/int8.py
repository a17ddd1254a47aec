"""Weight-only INT8 linear layers (vLLM's ``--quantization`` mode name "int8" here; w8a16 on GPU).

Format (server/layers/quantization/per_channel.py): ``layer.weight`` int8 ``[out_features, in_features]``
and ``layer.weight_scale`` float32 ``[out_features]``, symmetric per output channel, ``weight_scale[n] =
max|W[n]| / 127``.

The matmul is the backend's ``w8a16_matmul`` (server/backend.py picks the backend once: Triton on
CUDA, kernels/csrc/w8a16_cpu.cpp on the CPU, kernels/reference.py otherwise).
"""

from __future__ import annotations

import torch
from pagedserve.server.layers.quantization.per_channel import PerChannelLinearMethod, ScaledMatmul

INT8_MAX = 127  # symmetric: -127..127, so that -x quantizes to -q


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[N, K]`` -> (int8 ``[N, K]``, float32 scale ``[N]``), round to nearest, per output row."""
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class Int8LinearMethod(PerChannelLinearMethod):
    weight_dtype = torch.int8

    def __init__(self, matmul: ScaledMatmul) -> None:
        super().__init__(matmul, quantize_per_channel)
