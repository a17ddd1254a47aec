"""Write each token's new K and V into its slot of the paged KV cache.

An FP8 cache (``torch.float8_e4m3fn``) gets ``x / scale`` in float32, saturated to +-448 (e4m3fn has
no infinity: an overflow would become NaN), as ``reference.quantize_kv`` writes it, byte for byte.
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import fp8_kv_scales, next_pow2, saturate_round_e4m3


@triton.jit
def _store_kv_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # A negative slot (padding, or a token whose KV is already cached) writes nothing.
    heads_to_write = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (heads[:, None] < heads_to_write) & (dims[None, :] < head_dim)
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    if FP8:  # div_rn: Triton's `/` is PTX's approximate div.full.f32, which moves ties off the reference's
        k = saturate_round_e4m3(tl.math.div_rn(k.to(tl.float32), tl.load(k_scale_ptr)))
        v = saturate_round_e4m3(tl.math.div_rn(v.to(tl.float32), tl.load(v_scale_ptr)))
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write k, v ``[num_tokens, num_kv_heads, head_dim]`` into their slots; negative slots are skipped.
    ``k_scale``/``v_scale`` as in ``reference.store_kv_cache``."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    fp8, k_scale, v_scale = fp8_kv_scales(k_cache, k_scale, v_scale)
    _store_kv_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim),
        FP8=fp8,
    )
