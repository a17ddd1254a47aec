"""SwiGLU activation of the fused gate/up projection: ``silu(x[..., :d]) * x[..., d:]``."""

import torch
import triton
import triton.language as tl

from ._triton_utils import elementwise_warps, next_pow2, rows_view


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    # Rounded to the activation dtype between the two steps, as F.silu(gate) * up is.
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for the fused gate/up projection."""
    d = x.shape[-1] // 2
    x2 = rows_view(x)
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    if x2.shape[0] and d:
        block = min(next_pow2(d), 2048)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=block, num_warps=elementwise_warps(block),
        )
    return out.view(*x.shape[:-1], d)
