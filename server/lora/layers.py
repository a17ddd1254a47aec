"""The LoRA state of one ``Linear`` and the step's token -> slot mapping all of them read.

Each LoRA-capable projection holds its resident adapters in two tensors allocated once,
``lora_a [max_loras, slices * max_lora_rank, in]`` and ``lora_b [max_loras, out, slices * max_lora_rank]``,
laid out as kernels/reference.py's comment block says (block-diagonal slices, scaling folded into B).
The runner sets ``LoRAMapping.token_slots`` once before the forward pass (vLLM's punica wrapper does the
same); ``None`` means no token of the step uses an adapter, and the projections skip LoRA altogether.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass
class LoRAMapping:
    """The step's slot per token of the flattened batch (int64 ``[T]``, -1: the base model), or None."""

    token_slots: torch.Tensor | None = None


class LinearLoRA:
    """Attached to a ``Linear`` as ``linear.lora``: ``y += B[slot] @ (A[slot] @ x)`` per token."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        max_loras: int,
        max_lora_rank: int,
        kernels: ModuleType,
        mapping: LoRAMapping,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.in_features, self.output_sizes = in_features, list(output_sizes)
        self.max_lora_rank = max_lora_rank
        rank_size = len(output_sizes) * max_lora_rank
        self.lora_a = torch.zeros(max_loras, rank_size, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, sum(output_sizes), rank_size, dtype=dtype, device=device)
        self.kernels, self.mapping = kernels, mapping

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        slots = self.mapping.token_slots
        if slots is None:
            return y
        buf = self.kernels.lora_shrink(x, self.lora_a, slots)
        return self.kernels.lora_expand(y, buf, self.lora_b, slots)

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Copy an adapter's (A, B) of this layer into ``slot``; None (the adapter leaves it alone): zeros."""
        if weights is None:
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
            return
        a, b = weights
        self.lora_a[slot].copy_(a, non_blocking=True)
        self.lora_b[slot].copy_(b, non_blocking=True)
