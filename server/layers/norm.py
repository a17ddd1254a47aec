"""RMSNorm through the kernel backend (``rms_norm`` / ``fused_add_rms_norm``).

Gemma's norms compute ``x * (1 + w)``: ``weight_offset=1.0`` adds the 1 into the weight once, at load
time, so the same kernels serve every family.
"""

from __future__ import annotations

from types import ModuleType

import torch
from pagedserve.server.layers.linear import copy_weight
from torch import nn


class RMSNorm(nn.Module):
    """``forward(x)`` -> normed x; ``forward(x, residual)`` -> ``(norm(x + residual), x + residual)``."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        kernels: ModuleType,
        dtype: torch.dtype,
        device: torch.device,
        weight_offset: float = 0.0,
    ) -> None:
        super().__init__()
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps
        self.kernels = kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if self.weight_offset:
            tensor = tensor.float() + self.weight_offset  # in fp32, as Gemma adds it, then the model dtype
        copy_weight(self, name, tensor)
