"""Weight-only INT8 matmul (w8a16): ``x @ (weight * scale[:, None]).T + bias`` with int8 weights.

Decode on a GPU is memory-bound on the weights; int8 halves the bytes of bf16. Each program computes a
``BLOCK_M x BLOCK_N`` output tile: it loads int8 weight tiles, widens them to the activation dtype in
registers (int8 values are exact in bf16/fp16) and accumulates ``tl.dot`` in float32; the per-output-
channel scale and the bias are applied once, to the accumulator. The reference is
``pagedserve.kernels.reference.w8a16_matmul``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import next_pow2

BLOCK_M_MAX = 64
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4


@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    x_tile = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_tile = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N]: W.T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_tile + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_tile + k0, mask=k_ok[:, None] & col_ok[None, :], other=0)
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    acc *= tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def w8a16_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` ``[..., K]`` (float), ``weight`` int8 ``[N, K]``, ``scale`` ``[N]``, ``bias`` ``[N]`` or
    None -> ``[..., N]`` in ``x``'s dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    (m, k), n = x2.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        block_m = min(BLOCK_M_MAX, max(16, next_pow2(m)))  # tl.dot needs at least 16 rows
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
        _w8a16_kernel[grid](
            x2, weight, scale, bias if bias is not None else scale, out,
            m, n, k,
            x2.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)
