"""Neox-style (rotate-half) rotary position embedding of q and k, in one launch."""

import torch
import triton
import triton.language as tl

from ._triton_utils import next_pow2


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
    num_heads, num_kv_heads, half,
    BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < half
    cos = tl.load(cos_sin_ptr + pos * stride_cache + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cache + half + d, mask=dmask, other=0.0).to(tl.float32)[None, :]

    h = tl.arange(0, BLOCK_H)
    mask = (h[:, None] < num_heads) & dmask[None, :]
    src = q_ptr + token * stride_qt + h[:, None] * stride_qh + d[None, :]
    dst = q_out_ptr + token * stride_qot + h[:, None] * stride_qoh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)

    kh = tl.arange(0, BLOCK_KH)
    kmask = (kh[:, None] < num_kv_heads) & dmask[None, :]
    src = k_ptr + token * stride_kt + kh[:, None] * stride_kh + d[None, :]
    dst = k_out_ptr + token * stride_kot + kh[:, None] * stride_koh + d[None, :]
    x1 = tl.load(src, mask=kmask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=kmask, other=0.0).to(tl.float32)
    tl.store(dst, (x1 * cos - x2 * sin).to(k_out_ptr.dtype.element_ty), mask=kmask)
    tl.store(dst + half, (x2 * cos + x1 * sin).to(k_out_ptr.dtype.element_ty), mask=kmask)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[num_tokens, num_heads, head_dim]``, k ``[num_tokens, num_kv_heads, head_dim]``,
    ``cos_sin_cache`` ``[max_position, head_dim]`` (cos in the first half, sin in the second)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cos_sin_cache = cos_sin_cache.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            q, k, q_out, k_out, positions, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
            num_heads, num_kv_heads, half,
            BLOCK_H=next_pow2(num_heads), BLOCK_KH=next_pow2(num_kv_heads), BLOCK_HALF=next_pow2(half),
        )
    return q_out, k_out
