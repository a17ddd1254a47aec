"""The gated activation of the fused gate/up projection: ``act(x[..., :d]) * x[..., d:]``.

SiLU (Llama, Qwen, Mistral, Phi-3, OLMo 2, Granite) runs the backend's fused ``silu_and_mul`` kernel.
The GELUs (Gemma's ``gelu_pytorch_tanh``, the exact ``gelu``) are torch's own ``F.gelu``, the function
Transformers' ``ACT2FN`` entries call, on any device and dtype.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

# hidden_act name -> F.gelu's ``approximate`` argument.
_GELUS = {"gelu": "none", "gelu_pytorch_tanh": "tanh"}
SUPPORTED_ACTIVATIONS = ("silu", *_GELUS)


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` ``[num_tokens, 2 * d]``."""

    def __init__(self, kernels: ModuleType) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(x)


class GeluAndMul(nn.Module):
    """``gelu(x[..., :d]) * x[..., d:]``, exact or with the tanh approximation."""

    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


def get_act_and_mul(name: str, kernels: ModuleType) -> nn.Module:
    if name == "silu":
        return SiluAndMul(kernels)
    if name in _GELUS:
        return GeluAndMul(_GELUS[name])
    raise ValueError(f"unsupported hidden_act {name!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
