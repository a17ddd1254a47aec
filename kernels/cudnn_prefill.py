"""Whole-prompt prefill attention through cuDNN's fused attention, as torch builds it.

``torch.ops.aten._cudnn_attention_forward`` with cumulative sequence lengths is the kernel torch's
nested-tensor SDPA runs on packed variable-length sequences. On an H200, torch's default SDPA (cuDNN)
runs causal attention at about 600 TFLOP/s at head dim 128, where the Triton paged kernel
(kernels/paged_attention_prefill.py) and torch's FlashAttention-2 both reach about 230-340
(benchmarks/gpu/README.md). It reads packed K/V, not the paged cache, so it takes only batches in which
every chunk is a whole prompt (``PrefillBounds.whole_prompts``): their K/V are the chunks' own, just
stored, and no query needs a key from before its chunk (causal alignment is then the same from either
corner). Everything else stays on the Triton kernel: chunks after a cached prefix or an earlier chunk,
an FP8 cache (the kernel must read what the cache holds), logit soft-capping, sliding windows, fp32,
head dims that are not a multiple of 8 or exceed 128 (torch's own cuDNN limit for packed sequences),
GPUs before Hopper (not measured).

cuDNN addresses packed sequences by offsets that assume each token's heads are contiguous and tokens
back to back, so strided views (a column slice of the fused qkv projection) are copied first. Where
torch's cuDNN build refuses fewer K/V heads than query heads, K/V are repeated per query head instead,
once found for the process.
"""

from __future__ import annotations

import functools

import torch

from .prefill_bounds import PrefillBounds

MAX_HEAD_DIM = 128
_expand_kv_heads = False  # set once cuDNN has refused grouped K/V heads in this process


@functools.cache
def _cudnn_on(index: int) -> bool:
    return (torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()
            and torch.cuda.get_device_capability(index) >= (9, 0))


def takes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    bounds: PrefillBounds,
    sliding_window: int | None,
    logit_softcap: float | None,
) -> bool:
    """Whether this prefill goes to cuDNN (see the module docstring for what does not)."""
    head_dim = q.shape[-1]
    return (bounds.whole_prompts and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and k_cache.dtype == q.dtype and sliding_window is None and logit_softcap is None
            and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM
            and _cudnn_on(q.device.index if q.device.index is not None else torch.cuda.current_device()))


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, bounds: PrefillBounds,
    scale: float,
) -> torch.Tensor:
    """Causal attention of whole prompts packed as ``cu_seqlens`` describes: q ``[tokens, heads, dim]``,
    k/v ``[tokens, kv_heads, dim]`` (the chunks' own); ``[tokens, heads, dim]``."""
    global _expand_kv_heads
    if bounds.total_q == 0:
        return torch.empty_like(q)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    group = q.shape[1] // k.shape[1]
    if group > 1 and not _expand_kv_heads:
        try:
            return _cudnn(q, k, v, cu_seqlens, bounds.max_q_len, scale)
        except RuntimeError:  # this build wants K/V at the query's head count
            _expand_kv_heads = True
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return _cudnn(q, k, v, cu_seqlens, bounds.max_q_len, scale)


def _cudnn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    return torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu_seqlens, cu_seqlens, max_len, max_len, False, 0.0, True, False, scale=scale,
    )[0]
