"""RMSNorm, plain and fused with the residual add that precedes it in every decoder layer."""

import torch
import triton
import triton.language as tl

from ._triton_utils import elementwise_warps, next_pow2, rows_view


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype first, as the reference's ``x + residual`` is.
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    shape = x.shape
    x2 = rows_view(x)
    n_rows, n_cols = x2.shape
    residual_out = None
    if residual is not None:
        r2 = rows_view(residual)
        residual_out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, residual.dtype),
                                   device=x.device)
        act_dtype = residual_out.dtype
    else:
        r2 = x2
        act_dtype = x.dtype
    out = torch.empty(x2.shape, dtype=torch.promote_types(act_dtype, weight.dtype), device=x.device)
    if n_rows:
        block = next_pow2(n_cols)
        ro = residual_out if residual_out is not None else out
        _rms_norm_kernel[(n_rows,)](
            x2, r2, weight, out, ro,
            x2.stride(0), r2.stride(0), out.stride(0), ro.stride(0),
            n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=elementwise_warps(block),
        )
    if residual_out is None:
        return out.view(shape)
    return out.view(shape), residual_out.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``: the normed input and the new residual."""
    return _launch(x, residual, weight, eps)
