"""Paged attention over one flattened token batch.

The model runner (server/worker/model_runner.py) orders each step's batch decodes first (one token per
sequence), then prefill chunks, and describes it once in an ``AttentionMetadata`` that every layer
shares. The kernels come from the engine's backend (server/backend.py), bound when the model is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from pagedserve.kernels.reference import FP8_MAX
from torch import nn

MIN_KV_SCALE = 1e-6


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of every token (block_id * block_size + offset)
    num_decode_tokens: int  # the first num_decode_tokens tokens are decodes, one per sequence
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor  # [num_decodes] tokens in cache after this step's token
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks]
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefills + 1] offsets of each chunk after the decodes
    prefill_context_lens: torch.Tensor  # [num_prefills] tokens in cache after this step's chunk

    @property
    def num_prefills(self) -> int:
        return self.prefill_context_lens.shape[0]


def allocate_kv_caches(layers: list[Attention], num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> None:
    """Give every layer its K and V cache ``[num_blocks, block_size, its KV heads, head_dim]``. Zeros, not
    empty: the CPU decode reference multiplies padded positions by zero weights, and 0 * NaN from
    uninitialised memory would poison the sum."""
    for layer in layers:
        shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        layer.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        layer.v_cache = torch.zeros(shape, dtype=dtype, device=device)


class Attention(nn.Module):
    """Stores this layer's new K/V into its paged cache, then attends from the cache.

    ``sliding_window``: a query at position ``p`` attends only to keys ``p - sliding_window + 1 .. p``
    (HF Transformers' convention; Mistral, Qwen2, Gemma 2/3's local layers). ``logit_softcap``: the
    scaled scores become ``tanh(score / cap) * cap`` before the softmax (Gemma 2's
    ``attn_logit_softcapping``). Both go to every backend's attention kernels as keyword arguments.

    An FP8 cache (``kv_cache_dtype="fp8"``) holds ``K / k_scale`` and ``V / v_scale`` (vLLM's per-layer,
    per-tensor scales, 1.0 unless ``calculate_kv_scales`` sets them from the first prefill). The scales
    are tensors on the model's device, not floats, so that CUDA graphs captured before they are set
    read their values (server/worker/cuda_graphs.py); caches of other dtypes ignore them.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        kernels: ModuleType,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        if logit_softcap is not None and logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be positive, got {logit_softcap}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.kernels = kernels
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        # Bound by the model runner once the cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale = torch.ones((), dtype=torch.float32, device=device)
        self.v_scale = torch.ones((), dtype=torch.float32, device=device)
        # Armed by the model runner (vLLM's calculate_kv_scales): the next prefill sets the scales.
        self.calculate_kv_scales = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q ``[num_tokens, num_heads * head_dim]``, k/v ``[num_tokens, num_kv_heads * head_dim]``."""
        kernels = self.kernels
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.calculate_kv_scales and meta.num_prefills:
            self._calculate_kv_scales(k, v)
        kernels.store_kv_cache(
            k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale
        )
        num_decode = meta.num_decode_tokens
        out = torch.empty_like(q)
        if num_decode:
            out[:num_decode] = kernels.paged_attention_decode(
                q[:num_decode], self.k_cache, self.v_cache,
                meta.decode_block_tables, meta.decode_context_lens, self.scale,
                sliding_window=self.sliding_window, logit_softcap=self.logit_softcap,
                k_scale=self.k_scale, v_scale=self.v_scale,
            )
        if meta.num_prefills:
            out[num_decode:] = kernels.paged_attention_prefill(
                q[num_decode:], self.k_cache, self.v_cache, meta.prefill_block_tables,
                meta.prefill_cu_seqlens_q, meta.prefill_context_lens, self.scale,
                sliding_window=self.sliding_window, logit_softcap=self.logit_softcap,
                k_scale=self.k_scale, v_scale=self.v_scale,
            )
        return out.view(-1, self.num_heads * self.head_dim)

    def _calculate_kv_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Once: each scale maps this step's largest magnitude to e4m3's 448 (in place, see above). A
        floor keeps an all-zero batch from giving a zero scale (the store divides by it)."""
        for x, scale in ((k, self.k_scale), (v, self.v_scale)):
            scale.copy_((x.detach().abs().amax().float() / FP8_MAX).clamp(min=MIN_KV_SCALE))
        self.calculate_kv_scales = False
