"""``PerChannelLinearMethod``: the weight formats held as ``[out_features, in_features]`` values of one
narrow dtype and a float32 scale per output channel, ``W[n] ~= weight[n] * weight_scale[n]``: INT8
(server/layers/quantization/int8.py) and FP8 (server/layers/quantization/fp8.py).

Rows are independent, so each shard of a stacked projection (q/k/v, gate/up) is quantized alone as it
is loaded, one checkpoint tensor at a time: no float copy of the model is kept. The scale is a buffer,
not a parameter, so the checkpoint is not asked for it. A format names its dtype, its quantizer and the
backend kernel that multiplies by it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pagedserve.server.layers.quantization.base import LinearMethod
from torch import nn

# (x, weight, scale, bias) -> x @ (weight * scale[:, None]).T + bias, in x's dtype
ScaledMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# float [N, K] -> (weight [N, K] in the format's dtype, float32 scale [N])
Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class PerChannelLinearMethod(LinearMethod):
    weight_dtype: torch.dtype

    def __init__(self, matmul: ScaledMatmul, quantize: Quantizer) -> None:
        self.matmul = matmul
        self.quantize = quantize

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        weight = torch.empty(out_features, in_features, dtype=self.weight_dtype, device=device)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))

    def load_weight(
        self, layer: nn.Module, tensor: torch.Tensor, offset: int = 0, size: int | None = None
    ) -> None:
        rows = layer.weight.shape[0] if size is None else size
        expected = (rows, layer.weight.shape[1])
        if tensor.shape != expected:
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not match {expected}")
        q, scale = self.quantize(tensor.to(layer.weight.device))
        layer.weight.data.narrow(0, offset, rows).copy_(q)
        layer.weight_scale.narrow(0, offset, rows).copy_(scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.matmul(x, layer.weight, layer.weight_scale, bias)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return (layer.weight[ids].float() * layer.weight_scale[ids][..., None]).to(layer.dtype)
