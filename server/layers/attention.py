"""Paged attention over one flattened token batch, with the kernel backend chosen per device.

The model runner orders each step's batch decodes first (one token per sequence), then prefill chunks,
and describes it once in an ``AttentionMetadata`` that every layer shares.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

# "triton" | "cpu" | "torch"; default: triton on CUDA, cpu (the references plus the C++ decode attention)
# elsewhere. "torch" is the pure references.
BACKEND_ENV = "PAGEDSERVE_ATTENTION_BACKEND"


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


def select_backend(device: torch.device, override: str | None = None) -> ModuleType:
    """The kernel module: Triton on CUDA, the CPU backend elsewhere, unless overridden."""
    choice = (override or os.environ.get(BACKEND_ENV) or "").lower()
    if not choice:
        choice = "triton" if device.type == "cuda" else "cpu"
    if choice == "cpu":
        from pagedserve.kernels import cpu

        cpu.load_extension()  # compile now, not inside the first request
        return cpu
    if choice == "torch":
        from pagedserve.kernels import reference

        return reference
    if choice == "triton":
        import pagedserve.kernels as triton_kernels

        return triton_kernels
    raise ValueError(f"{BACKEND_ENV} must be 'triton', 'cpu' or 'torch', got {choice!r}")


class Attention(nn.Module):
    """Stores this layer's new K/V into its paged cache, then attends from the cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        # Bound by the model runner once the cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.kernels: ModuleType | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q ``[num_tokens, num_heads * head_dim]``, k/v ``[num_tokens, num_kv_heads * head_dim]``."""
        kernels = self.kernels
        assert kernels is not None, "the model runner binds the KV cache and kernels before forward"
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
            )
        if meta.num_prefills:
            out[num_decode:] = kernels.paged_attention_prefill(
                q[num_decode:], self.k_cache, self.v_cache, meta.prefill_block_tables,
                meta.prefill_cu_seqlens_q, meta.prefill_context_lens, self.scale,
            )
        return out.view(-1, self.num_heads * self.head_dim)
