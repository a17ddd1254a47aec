"""Paged attention over one flattened token batch.

The model runner (server/worker/model_runner.py) orders each step's batch decodes first (one token per
sequence), then prefill chunks, and describes it once in an ``AttentionMetadata`` that every layer
shares. The kernels come from the engine's backend (server/backend.py), bound when the model is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn


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


class Attention(nn.Module):
    """Stores this layer's new K/V into its paged cache, then attends from the cache.

    ``sliding_window``: a query at position ``p`` attends only to keys ``p - sliding_window + 1 .. p``
    (HF Transformers' convention; Mistral, Qwen2, Gemma 2/3's local layers). ``logit_softcap``: the
    scaled scores become ``tanh(score / cap) * cap`` before the softmax (Gemma 2's
    ``attn_logit_softcapping``). Both go to every backend's attention kernels as keyword arguments.
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

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q ``[num_tokens, num_heads * head_dim]``, k/v ``[num_tokens, num_kv_heads * head_dim]``."""
        kernels = self.kernels
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        kernels.store_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        num_decode = meta.num_decode_tokens
        out = torch.empty_like(q)
        if num_decode:
            out[:num_decode] = kernels.paged_attention_decode(
                q[:num_decode], self.k_cache, self.v_cache,
                meta.decode_block_tables, meta.decode_context_lens, self.scale,
                sliding_window=self.sliding_window, logit_softcap=self.logit_softcap,
            )
        if meta.num_prefills:
            out[num_decode:] = kernels.paged_attention_prefill(
                q[num_decode:], self.k_cache, self.v_cache, meta.prefill_block_tables,
                meta.prefill_cu_seqlens_q, meta.prefill_context_lens, self.scale,
                sliding_window=self.sliding_window, logit_softcap=self.logit_softcap,
            )
        return out.view(-1, self.num_heads * self.head_dim)
