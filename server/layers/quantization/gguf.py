"""GGUF-block linear layers (vLLM's ``--quantization gguf``): the weights stay in the file's blocks.

A GGUF checkpoint's Q8_0 / Q4_0 / Q4_1 tensors reach ``load_weight`` as their raw rows (uint8 ``[rows,
K / 32 * block bytes]``, server/loader/gguf.py reads them); the block type follows from the bytes per
block (34, 18, 20). Each block is split once into the kernels' layout (kernels/reference.py "GGUF blocks":
``layer.weight`` the quantized values, ``layer.weight_scales`` the float16 d, ``layer.weight_mins`` Q4_1's
float16 m) — a copy of the bytes, never a float32 matrix. Tensors of other types (F32, F16, K-quants)
reach it already dequantized to float (the loader logs each) and stay float, multiplied by ``linear``.
One layer holds one format: shards of a merged projection (q/k/v, gate/up) of different block types are
refused with the names of the types, not mixed.

The matmul is the backend's ``gguf_matmul`` (kernels/csrc/gguf_cpu.cpp on the CPU, Triton on CUDA). Once
loaded, a layer also gets the backend's bfloat16 copy of its blocks where the backend offers one
(kernels/cpu.py ``gguf_dense_weight``: CPUs with a native bfloat16 dot product): a decode step's few rows
read the blocks (4.5 bits a weight), batched rows are compute-bound and go through the copy instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from pagedserve.kernels.reference import (
    GGUF_BLOCK,
    GGUF_Q4_0,
    GGUF_Q4_1,
    GGUF_Q8_0,
    GGUF_QBYTES,
    dequantize_gguf,
)
from pagedserve.server.layers.quantization.base import LinearMethod
from torch import nn

GGUFMatmul = Callable[..., torch.Tensor]
# The backend's bfloat16 copy of a layer's blocks for batched products (kernels/cpu.py gguf_dense_weight)
DenseWeight = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor | None]
FLOAT = 0  # layer.gguf_type of a layer whose checkpoint tensors arrived as floats
BLOCK_BYTES = {34: GGUF_Q8_0, 18: GGUF_Q4_0, 20: GGUF_Q4_1}  # bytes per block of 32 -> ggml type id
TYPE_NAMES = {GGUF_Q8_0: "Q8_0", GGUF_Q4_0: "Q4_0", GGUF_Q4_1: "Q4_1", FLOAT: "float"}


def split_blocks(raw: torch.Tensor, k: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Raw GGUF rows uint8 ``[N, K / 32 * block bytes]`` -> (type, qs, scales, mins or None)."""
    nb = k // GGUF_BLOCK
    if k % GGUF_BLOCK or raw.shape[1] % nb or raw.shape[1] // nb not in BLOCK_BYTES:
        raise ValueError(f"GGUF rows of {raw.shape[1]} bytes are not Q8_0/Q4_0/Q4_1 blocks of a {k}-wide row")
    qtype = BLOCK_BYTES[raw.shape[1] // nb]
    blocks = raw.reshape(raw.shape[0], nb, -1)
    scales = _halves(blocks[..., 0:2])
    mins = _halves(blocks[..., 2:4]) if qtype == GGUF_Q4_1 else None
    qs = blocks[..., -GGUF_QBYTES[qtype] :].reshape(raw.shape[0], -1)
    return qtype, qs, scales, mins


def _halves(pairs: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, nb, 2]`` (a block's little-endian float16) -> float16 ``[N, nb]``."""
    return pairs.contiguous().view(torch.float16).squeeze(-1)


class GGUFLinearMethod(LinearMethod):
    def __init__(self, matmul: GGUFMatmul, dense_weight: DenseWeight | None = None) -> None:
        self.matmul = matmul
        self.dense_weight = dense_weight

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        # The format is the checkpoint's: allocated by the first shard that arrives (_allocate).
        layer.gguf_type = None
        layer.weight = nn.Parameter(torch.empty(out_features, 0, dtype=torch.uint8, device=device),
                                    requires_grad=False)
        layer.weight_scales = layer.weight_mins = layer.weight_dense = None
        layer.gguf_shape = (out_features, in_features)

    def load_weight(
        self, layer: nn.Module, tensor: torch.Tensor, offset: int = 0, size: int | None = None
    ) -> None:
        n, k = layer.gguf_shape
        rows = n if size is None else size
        if tensor.dtype == torch.uint8:
            qtype, qs, scales, mins = split_blocks(tensor, k)
        else:
            if tuple(tensor.shape) != (rows, k):
                raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not match {(rows, k)}")
            qtype, qs, scales, mins = FLOAT, tensor, None, None
        if qs.shape[0] != rows:
            raise ValueError(f"checkpoint rows {qs.shape[0]} do not match {rows}")
        self._allocate(layer, qtype, qs.shape[1], qs.dtype)
        layer.weight.data.narrow(0, offset, rows).copy_(qs)
        if scales is not None:
            layer.weight_scales.narrow(0, offset, rows).copy_(scales)
        if mins is not None:
            layer.weight_mins.narrow(0, offset, rows).copy_(mins)

    @staticmethod
    def _allocate(layer: nn.Module, qtype: int, width: int, dtype: torch.dtype) -> None:
        if layer.gguf_type is not None:
            if layer.gguf_type != qtype:
                raise ValueError(
                    f"a merged projection's GGUF tensors have different types ({TYPE_NAMES[layer.gguf_type]} "
                    f"and {TYPE_NAMES[qtype]}); --quantization gguf keeps one block type per layer"
                )
            return
        (n, k), device = layer.gguf_shape, layer.weight.device
        layer.gguf_type = qtype
        layer.weight = nn.Parameter(torch.empty(n, width, dtype=dtype if qtype == FLOAT else torch.uint8,
                                                device=device), requires_grad=False)
        if qtype != FLOAT:
            layer.weight_scales = torch.empty(n, k // GGUF_BLOCK, dtype=torch.float16, device=device)
        if qtype == GGUF_Q4_1:
            layer.weight_mins = torch.empty(n, k // GGUF_BLOCK, dtype=torch.float16, device=device)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.dense_weight is not None and layer.gguf_type not in (None, FLOAT):
            layer.weight_dense = self.dense_weight(layer.weight, layer.weight_scales, layer.weight_mins,
                                                   layer.gguf_type)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.gguf_type == FLOAT:
            from pagedserve.server.layers.linear import linear

            return linear(x.to(layer.dtype), layer.weight.to(layer.dtype), bias)
        dense = {} if layer.weight_dense is None else {"dense": layer.weight_dense}
        return self.matmul(x, layer.weight, layer.weight_scales, layer.weight_mins, layer.gguf_type, bias,
                           **dense)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if layer.gguf_type == FLOAT:
            return F.embedding(ids, layer.weight).to(layer.dtype)
        flat = ids.reshape(-1)
        mins = None if layer.weight_mins is None else layer.weight_mins[flat]
        rows = dequantize_gguf(layer.weight[flat], layer.weight_scales[flat], mins, layer.gguf_type)
        return rows.to(layer.dtype).view(*ids.shape, -1)
