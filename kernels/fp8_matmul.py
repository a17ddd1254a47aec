"""FP8 (W8A8) matmul on a GPU, vLLM's ``--quantization fp8``: the contract is ``reference.fp8_matmul``.

The activation rows are quantized to e4m3 with a scale each (torch ops: a row max, a division, a cast),
and the product is cuBLASLt's FP8 GEMM through ``torch._scaled_mm`` with row-wise scales: the per-token
activation scale and the per-channel weight scale are applied to its float32 accumulator. Row-wise
scaling needs a Hopper GPU (compute capability 9.0) and K, N multiples of 16; elsewhere the reference
runs (correct, and slow: it widens the weight for every product).
"""

from __future__ import annotations

import functools

import torch

from . import reference


@functools.cache
def _rowwise_scaled_mm(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def fp8_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Same arguments as ``reference.fp8_matmul`` -> ``[..., N]`` in ``x``'s dtype."""
    (n, k), device = weight.shape, x.device
    if device.type != "cuda" or k % 16 or n % 16 or not _rowwise_scaled_mm(device.index or 0):
        return reference.fp8_matmul(x, weight, scale, bias)
    rows, row_scale = reference.quantize_fp8_rows(x.reshape(-1, k))
    # Row-wise scales give a bfloat16 product only; weight.t() is the column-major operand cuBLASLt takes.
    out = torch._scaled_mm(rows, weight.t(), scale_a=row_scale[:, None], scale_b=scale.float()[None, :],
                           out_dtype=torch.bfloat16)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(x.dtype).view(*x.shape[:-1], n)
