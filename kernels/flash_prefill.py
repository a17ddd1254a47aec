"""Prefill attention through FlashAttention-2 as torch builds it, for the batches it can take.

``torch.ops.aten._flash_attention_forward`` is the kernel behind SDPA's flash backend and
``torch.nn.attention.varlen``: packed variable-length sequences, GQA, a causal mask aligned at the
bottom right when a sequence has more keys than queries (so queries after a cached prefix see all of
it). On an H200 it runs causal prefill at about 600 TFLOP/s at head dim 128, where the Triton kernel
(kernels/paged_attention_prefill.py) reaches about 320 (benchmarks/gpu/README.md). It reads K/V packed,
not paged, so:

- when every chunk is a whole prompt (``PrefillBounds.whole_prompts``) and the cache holds the query's
  dtype, it reads the chunk's own K/V, the values just stored;
- otherwise ``gather_context`` copies each sequence's context out of the paged cache into one packed
  K/V, FP8 rows dequantized as ``reference.dequantize_kv`` does (one read and write of the context:
  a few percent of the attention's time at long contexts).

Left to the Triton kernel: logit soft-capping (torch's build has none), sliding windows (the blocks a
window has left may be freed and hold anything; the Triton kernel never reads them), fp32, head dims
that are not a multiple of 8 or exceed 256, GPUs before sm80.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._triton_utils import fp8_kv_scales, next_pow2
from .prefill_bounds import PrefillBounds

GATHER_TOKENS = 16  # context tokens per gather program
GATHER_WIDTH = 1024  # row elements (num_kv_heads * head_dim) per gather program


@functools.cache
def _flash_on(index: int) -> bool:
    capability = torch.cuda.get_device_capability(index)
    return torch.backends.cuda.is_flash_attention_available() and capability >= (8, 0)


def takes(
    q: torch.Tensor, k_cache: torch.Tensor, sliding_window: int | None, logit_softcap: float | None
) -> bool:
    """Whether this prefill goes to FlashAttention (see the module docstring for what does not)."""
    head_dim = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and sliding_window is None
            and logit_softcap is None and head_dim % 8 == 0 and head_dim <= 256 and k_cache.is_contiguous()
            and _flash_on(q.device.index if q.device.index is not None else torch.cuda.current_device()))


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    bounds: PrefillBounds,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    chunk_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``paged_attention_prefill``'s result for a batch ``takes`` accepts. ``chunk_kv``: the chunks' own
    K/V ``[num_tokens, num_kv_heads, head_dim]``, used in place of the cache for whole prompts."""
    if bounds.total_q == 0:
        return torch.empty_like(q)
    if chunk_kv is not None and bounds.whole_prompts and k_cache.dtype == q.dtype:
        keys, values = chunk_kv
    else:
        keys, values = gather_context(k_cache, v_cache, block_tables, bounds, q.dtype, k_scale, v_scale)
    out = torch.ops.aten._flash_attention_forward(
        q, keys, values, cu_seqlens_q, bounds.cu_seqlens_k, bounds.max_q_len, bounds.max_context_len,
        0.0, True, False, scale=scale,
    )[0]
    return out


@triton.jit
def _gather_kernel(
    k_cache_ptr, v_cache_ptr, table_ptr, cu_seqlens_ptr, k_out_ptr, v_out_ptr, k_scale_ptr, v_scale_ptr,
    stride_cb, stride_cs, stride_table, row_width,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    start = tl.load(cu_seqlens_ptr + seq)
    length = tl.load(cu_seqlens_ptr + seq + 1) - start
    pos = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    pos_ok = pos < length
    block = tl.load(table_ptr + seq.to(tl.int64) * stride_table + pos // BLOCK_SIZE, mask=pos_ok, other=0)
    row = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs
    src = row[:, None] + cols[None, :]
    dst = (start + pos).to(tl.int64)[:, None] * row_width + cols[None, :]
    mask = pos_ok[:, None] & (cols < row_width)[None, :]
    keys = tl.load(k_cache_ptr + src, mask=mask, other=0.0)
    values = tl.load(v_cache_ptr + src, mask=mask, other=0.0)
    if FP8:  # as reference.dequantize_kv: the value times its scale in float32, then the query's dtype
        keys = keys.to(tl.float32) * tl.load(k_scale_ptr)
        values = values.to(tl.float32) * tl.load(v_scale_ptr)
    tl.store(k_out_ptr + dst, keys.to(k_out_ptr.dtype.element_ty), mask=mask)
    tl.store(v_out_ptr + dst, values.to(v_out_ptr.dtype.element_ty), mask=mask)


def gather_context(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    bounds: PrefillBounds,
    dtype: torch.dtype,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's cached K and V, positions ``0 .. context_len - 1``, packed in sequence order
    (``bounds.cu_seqlens_k``): ``[total_context, num_kv_heads, head_dim]`` in ``dtype``."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    shape = (bounds.total_context, num_kv_heads, head_dim)
    keys = torch.empty(shape, dtype=dtype, device=k_cache.device)
    values = torch.empty(shape, dtype=dtype, device=k_cache.device)
    num_seqs = bounds.cu_seqlens_k.shape[0] - 1
    if bounds.total_context == 0 or num_seqs == 0:
        return keys, values
    fp8, k_scale, v_scale = fp8_kv_scales(k_cache, k_scale, v_scale)
    row_width = num_kv_heads * head_dim
    block_w = min(GATHER_WIDTH, next_pow2(row_width))
    grid = (num_seqs, triton.cdiv(bounds.max_context_len, GATHER_TOKENS), triton.cdiv(row_width, block_w))
    _gather_kernel[grid](
        k_cache, v_cache, block_tables, bounds.cu_seqlens_k, keys, values, k_scale, v_scale,
        k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), row_width,
        BLOCK_SIZE=block_size, BLOCK_T=GATHER_TOKENS, BLOCK_W=block_w, FP8=fp8,
    )  # fmt: skip
    return keys, values
