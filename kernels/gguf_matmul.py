"""GGUF-block weights (Q8_0 / Q4_0 / Q4_1) times float activations on a GPU: ``x @ W.T + bias``.

The layout is kernels/reference.py's (``qs`` uint8 ``[N, K/32 * QBYTES]``, float16 ``scales`` and Q4_1
``mins`` ``[N, K/32]``). On a GPU the activations stay in their float dtype: each program loads a
``BLOCK_N`` x 32 slice of blocks per step along K, dequantizes it in registers (nibbles or int8 bytes
times the block's scale, plus the offset) and accumulates ``tl.dot`` in float32. So it equals the
reference's dequantized product (``reference.dequantize_gguf``), not its activation quantization: the
int8 activation blocks are the CPU kernel's way to use integer dot products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import next_pow2
from .reference import GGUF_BLOCK, GGUF_Q4_0, GGUF_Q4_1, GGUF_Q8_0, GGUF_QBYTES

BLOCK_M_MAX = 64
BLOCK_N = 64
NUM_WARPS = 4


@triton.jit
def _gguf_kernel(
    x_ptr, qs_ptr, d_ptr, m_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_om,
    QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, 32)
    row_ok, col_ok = rows < M, cols < N
    nb = K // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, nb):
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + b * 32 + ks[None, :],
                    mask=row_ok[:, None], other=0.0)
        base = qs_ptr + cols[None, :].to(tl.int64) * stride_qn
        if QTYPE == 8:  # Q8_0: 32 int8 bytes per block
            q = tl.load(base + b * 32 + ks[:, None], mask=col_ok[None, :], other=0).to(tl.int8, bitcast=True)
            w = q.to(tl.float32)
        else:  # Q4: byte j % 16 of the block, its low nibble for values 0..15, its high one for 16..31
            byte = tl.load(base + b * 16 + (ks[:, None] % 16), mask=col_ok[None, :], other=0).to(tl.int32)
            w = tl.where(ks[:, None] < 16, byte & 0x0F, byte >> 4).to(tl.float32)
        d = tl.load(d_ptr + cols.to(tl.int64) * nb + b, mask=col_ok, other=0.0).to(tl.float32)
        w = w * d[None, :]
        if QTYPE == 2:
            w = w - 8.0 * d[None, :]
        if QTYPE == 3:
            m = tl.load(m_ptr + cols.to(tl.int64) * nb + b, mask=col_ok, other=0.0).to(tl.float32)
            w = w + m[None, :]
        acc += tl.dot(x.to(tl.float32), w, input_precision=PRECISION)  # [BLOCK_M, 32] x [32, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def gguf_matmul(
    x: torch.Tensor,
    qs: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    qtype: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same arguments as ``reference.gguf_matmul`` -> ``[..., N]`` in ``x``'s dtype."""
    if qtype not in (GGUF_Q8_0, GGUF_Q4_0, GGUF_Q4_1):
        raise ValueError(f"unsupported GGUF block type {qtype}")
    if qtype == GGUF_Q4_1 and mins is None:
        raise ValueError("Q4_1 blocks need their mins")
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    (m, k), n = x2.shape, qs.shape[0]
    if k % GGUF_BLOCK or qs.shape[1] != k // GGUF_BLOCK * GGUF_QBYTES[qtype]:
        raise ValueError(f"GGUF blocks need K a multiple of {GGUF_BLOCK} and qs [N, K/32 * block bytes]")
    qs, scales = qs.contiguous(), scales.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        block_m = min(BLOCK_M_MAX, max(16, next_pow2(m)))  # tl.dot needs at least 16 rows
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
        _gguf_kernel[grid](
            x2, qs, scales, mins.contiguous() if mins is not None else scales,
            bias if bias is not None else scales, out,
            m, n, k,
            x2.stride(0), qs.stride(0), out.stride(0),
            QTYPE=qtype, HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=block_m, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)
