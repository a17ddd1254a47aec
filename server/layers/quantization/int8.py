"""Weight-only INT8 linear layers (vLLM's ``--quantization`` mode name "int8" here; w8a16 on GPU).

Format: ``layer.weight`` int8 ``[out_features, in_features]`` and ``layer.weight_scale`` float32
``[out_features]``, symmetric per output channel: ``W[n] ~= weight[n] * weight_scale[n]`` with
``weight_scale[n] = max|W[n]| / 127``. Rows are independent, so each shard of a stacked projection
(q/k/v, gate/up) is quantized alone as it is loaded, one checkpoint tensor at a time: no fp32 copy of
the model is kept. The scale is a buffer, not a parameter, so the checkpoint is not asked for it.

The matmul is the backend's ``w8a16_matmul`` (server/backend.py picks the backend once: Triton on
CUDA, kernels/csrc/w8a16_cpu.cpp on the CPU, kernels/reference.py otherwise).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from pagedserve.server.layers.quantization.base import LinearMethod
from torch import nn

Int8Matmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
INT8_MAX = 127  # symmetric: -127..127, so that -x quantizes to -q


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[N, K]`` -> (int8 ``[N, K]``, float32 scale ``[N]``), round to nearest, per output row."""
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class Int8LinearMethod(LinearMethod):
    def __init__(self, matmul: Int8Matmul) -> None:
        self.matmul = matmul

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        layer.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.int8, device=device), requires_grad=False
        )
        layer.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))

    def load_weight(
        self, layer: nn.Module, tensor: torch.Tensor, offset: int = 0, size: int | None = None
    ) -> None:
        rows = layer.weight.shape[0] if size is None else size
        expected = (rows, layer.weight.shape[1])
        if tensor.shape != expected:
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not match {expected}")
        q, scale = quantize_per_channel(tensor.to(layer.weight.device))
        layer.weight.data.narrow(0, offset, rows).copy_(q)
        layer.weight_scale.narrow(0, offset, rows).copy_(scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.matmul(x, layer.weight, layer.weight_scale, bias)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, layer.weight).to(layer.dtype)
        return rows * F.embedding(ids, layer.weight_scale[:, None]).to(layer.dtype)
