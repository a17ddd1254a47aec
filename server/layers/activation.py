"""The gated activation of the fused gate/up projection, through the kernel backend."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

SUPPORTED_ACTIVATIONS = ("silu",)


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` ``[num_tokens, 2 * d]``."""

    def __init__(self, kernels: ModuleType) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(x)


def get_act_and_mul(name: str, kernels: ModuleType) -> nn.Module:
    if name not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
    return SiluAndMul(kernels)
