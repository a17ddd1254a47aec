"""Mixture-of-experts MLP: every token through its top-k experts, one grouped GEMM launch per projection.

The (token, slot) pairs are sorted by expert and each expert's run is padded to a multiple of
``BLOCK_M`` rows (``align_by_expert``), so that every row tile of the sorted list belongs to one
expert. One launch of ``_grouped_gemm_kernel`` then multiplies every tile by its expert's gate/up
weights; SiLU-and-mul runs on the result (kernels/silu_and_mul.py); a second launch multiplies by the
experts' down weights and by each pair's routing weight; the k partial outputs of a token are summed.
The same plan as vLLM's fused_moe (sort, pad to the block size, one launch per projection), written
here from that description.

Launch sizes depend only on tensor shapes: the padded length is bounded from ``T * k`` and the
number of experts, and tiles past the real padded length (a device tensor) return at once. So the
call needs no host synchronisation and can be captured in a CUDA graph. Batches longer than
``MAX_TOKENS_PER_PASS`` tokens run in passes of that many, to bound the intermediate buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._triton_utils import next_pow2
from .silu_and_mul import silu_and_mul

# Tunables (module-level so that tests and benchmarks can change them).
BLOCK_M_SMALL = 16  # rows per tile when experts get few tokens each (decode)
BLOCK_M_LARGE = 64  # rows per tile for prefill-sized batches
ROWS_PER_EXPERT_FOR_LARGE = 32  # mean (token, slot) rows per expert from which BLOCK_M_LARGE pays
# Tokens per pass: bounds the intermediates ([T * k, 2I] activations, [T * k, H] float32 partial outputs;
# Mixtral's 2048-token chunk needs about 0.5 GiB in bfloat16) whatever the prefill chunk.
MAX_TOKENS_PER_PASS = 2048
MAX_BLOCK_N = 64
MAX_BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 2


@dataclass
class ExpertAlignment:
    """(token, slot) pairs sorted by expert, each expert's run padded to ``block_m`` rows."""

    sorted_rows: torch.Tensor  # int32 [padded_capacity]: flat index token * k + slot, or T * k (padding)
    tile_experts: torch.Tensor  # int32 [padded_capacity // block_m]: the expert of each row tile
    padded_len: torch.Tensor  # int32 [1]: rows in use; tiles from here on are skipped
    block_m: int


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Sort the flattened ``topk_ids`` by expert and pad each expert's run to a multiple of ``block_m``.

    At most ``min(E, T * k)`` experts get rows, each wasting under ``block_m`` rows of padding, which
    bounds the capacity without reading the counts on the host.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_rows, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)
    order = torch.argsort(flat, stable=True)
    experts_in_order = flat[order]
    rank_in_expert = torch.arange(num_rows, device=device) - (counts.cumsum(0) - counts)[experts_in_order]
    num_tiles = triton.cdiv(num_rows, block_m) + min(num_experts, num_rows)
    sorted_rows = torch.full((num_tiles * block_m,), num_rows, dtype=torch.int32, device=device)
    sorted_rows[(padded_ends - padded_counts)[experts_in_order] + rank_in_expert] = order.to(torch.int32)
    tile_starts = torch.arange(0, num_tiles * block_m, block_m, device=device)
    tile_experts = torch.searchsorted(padded_ends, tile_starts, right=True).clamp_(max=num_experts - 1)
    return ExpertAlignment(
        sorted_rows, tile_experts.to(torch.int32), padded_ends[-1:].to(torch.int32), block_m
    )


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, row_weights_ptr,
    sorted_rows_ptr, tile_experts_ptr, padded_len_ptr,
    num_rows, N, K,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    A_ROWS_PER_TOKEN: tl.constexpr, MUL_ROW_WEIGHTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """``c[row] = a[row // A_ROWS_PER_TOKEN] @ b[expert].T`` (times ``row_weights[row]``) for one tile of
    sorted rows and one block of output columns; padding rows are neither read nor written."""
    tile = tl.program_id(0)
    if tile * BLOCK_M >= tl.load(padded_len_ptr):
        return
    rows = tl.load(sorted_rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < num_rows
    a_rows = rows // A_ROWS_PER_TOKEN
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert * stride_be + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :],
                    mask=row_mask[:, None] & (k[None, :] < K), other=0.0)
        b = tl.load(b_base + k[:, None] * stride_bk, mask=(k[:, None] < K) & col_mask[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    if MUL_ROW_WEIGHTS:
        acc = acc * tl.load(row_weights_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    alignment: ExpertAlignment,
    a_rows_per_token: int,
    row_weights: torch.Tensor | None = None,
) -> None:
    """``out[r] = a[r // a_rows_per_token] @ b[expert(r)].T`` for every (token, slot) row ``r``."""
    num_rows, n = out.shape
    k = a.shape[1]
    block_n = max(16, min(MAX_BLOCK_N, next_pow2(n)))
    block_k = max(16, min(MAX_BLOCK_K, next_pow2(k)))
    grid = (alignment.tile_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, out, row_weights if row_weights is not None else out,
        alignment.sorted_rows, alignment.tile_experts, alignment.padded_len,
        num_rows, n, k,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        A_ROWS_PER_TOKEN=a_rows_per_token, MUL_ROW_WEIGHTS=row_weights is not None,
        BLOCK_M=alignment.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )


def choose_block_m(num_rows: int, num_experts: int) -> int:
    return BLOCK_M_LARGE if num_rows >= ROWS_PER_EXPERT_FOR_LARGE * num_experts else BLOCK_M_SMALL


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Same contract as ``reference.fused_moe``."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens <= MAX_TOKENS_PER_PASS:
        block_m = choose_block_m(num_tokens * top_k, w13.shape[0])
        return _fused_moe(hidden, w13, w2, topk_weights, topk_ids, block_m)
    step = MAX_TOKENS_PER_PASS
    passes = [slice(start, start + step) for start in range(0, num_tokens, step)]
    return torch.cat([fused_moe(hidden[p], w13, w2, topk_weights[p], topk_ids[p]) for p in passes])


def _fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_m: int,
) -> torch.Tensor:
    """``fused_moe`` with the row tile given (tests use it to get several tiles per expert)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden_size = w2.shape[0], w2.shape[1]
    if num_tokens == 0:
        return torch.empty((0, hidden_size), dtype=hidden.dtype, device=hidden.device)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    num_rows = num_tokens * top_k
    alignment = align_by_expert(topk_ids, num_experts, block_m)
    gate_up = torch.empty((num_rows, w13.shape[1]), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, gate_up, alignment, a_rows_per_token=top_k)
    activated = silu_and_mul(gate_up)
    # Float32 partial outputs: the k experts of a token are summed before one rounding, as the reference.
    partial = torch.empty((num_rows, hidden_size), dtype=torch.float32, device=hidden.device)
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_gemm(activated, w2, partial, alignment, a_rows_per_token=1, row_weights=weights)
    return partial.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
