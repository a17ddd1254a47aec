"""FP8 (e4m3) linear layers, vLLM's ``--quantization fp8`` on a float checkpoint: weights quantized as
they load, activations quantized per token at run time (W8A8, dynamic scales).

Format: ``layer.weight`` float8_e4m3fn ``[out_features, in_features]`` and ``layer.weight_scale``
float32 ``[out_features]``: ``W[n] ~= weight[n] * weight_scale[n]``, ``weight_scale[n] = max|W[n]| / 448``
(``reference.quantize_fp8_rows``; per output channel, so each shard of a stacked projection is
quantized alone, as server/layers/quantization/int8.py does). Half a 16-bit weight's bytes, as int8, but
the product runs on the FP8 tensor cores: the backend's ``fp8_matmul`` (cuBLASLt through
``torch._scaled_mm`` on a Hopper GPU, kernels/fp8_matmul.py; the torch reference elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pagedserve.kernels.reference import FP8_KV_DTYPE, quantize_fp8_rows
from pagedserve.server.layers.quantization.base import LinearMethod
from torch import nn

Fp8Matmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class Fp8LinearMethod(LinearMethod):
    quantizes_head = False  # as vLLM's fp8: the head's logits keep the model dtype

    def __init__(self, matmul: Fp8Matmul) -> None:
        self.matmul = matmul

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        layer.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_KV_DTYPE, device=device), requires_grad=False
        )
        layer.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))

    def load_weight(
        self, layer: nn.Module, tensor: torch.Tensor, offset: int = 0, size: int | None = None
    ) -> None:
        rows = layer.weight.shape[0] if size is None else size
        expected = (rows, layer.weight.shape[1])
        if tensor.shape != expected:
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not match {expected}")
        q, scale = quantize_fp8_rows(tensor.to(layer.weight.device))
        layer.weight.data.narrow(0, offset, rows).copy_(q)
        layer.weight_scale.narrow(0, offset, rows).copy_(scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.matmul(x, layer.weight, layer.weight_scale, bias)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return (layer.weight[ids].float() * layer.weight_scale[ids, None]).to(layer.dtype)
