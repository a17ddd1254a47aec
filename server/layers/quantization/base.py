"""``LinearMethod``: how a ``Linear`` (server/layers/linear.py) holds, loads and multiplies its weight.

vLLM's ``LinearMethodBase`` in small: the method creates the layer's weight tensors, turns each loaded
checkpoint shard into them, and runs the matmul. ``Linear`` keeps the shard bookkeeping (which rows a
stacked projection fills) and delegates the rest, so a new weight format is one new method.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class LinearMethod(ABC):
    # Whether the LM head (and a tied embedding, which is the head) takes this format too
    # (server/layers/quantization/__init__.py ``quantize_linears``).
    quantizes_head = True

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Register the layer's (uninitialised) weight tensors; ``layer.weight`` is always one of them."""

    @abstractmethod
    def load_weight(
        self, layer: nn.Module, tensor: torch.Tensor, offset: int = 0, size: int | None = None
    ) -> None:
        """Fill output rows ``offset:offset+size`` (all rows when ``size`` is None) from a checkpoint
        tensor ``[size, in_features]``."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (optional hook)
        """Once every shard is loaded: derive what the matmul needs from the loaded weight (vLLM's hook of
        the same name). Nothing by default."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` for ``x`` ``[..., in_features]``, in the dtype the method computed it in:
        the model dtype, or another (the CPU's GGUF products in bfloat16, kernels/cpu.py ``gguf_matmul``)
        that ``Linear.forward`` converts. A method that returns another dtype takes it as ``x`` too (the
        next projection's input, ``Linear.forward``'s ``keep_product_dtype``)."""

    @abstractmethod
    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of ``W`` in the model dtype (a tied embedding: server/layers/linear.py
        ``VocabEmbedding``)."""
