"""Batched LoRA shrink and expand in Triton: every token through its own adapter, one launch each.

The contract is ``reference.lora_shrink`` / ``reference.lora_expand`` (kernels/reference.py, "LoRA"):
``token_slots[t]`` is the adapter slot of token ``t``, -1 for a base-model token. As in Punica's SGMV and
vLLM's punica kernels, the token indices are sorted by slot once per call (``group_by_slot``), so that a
program multiplies a tile of one slot's tokens by that slot's A (shrink) or B (expand) and reads each
adapter matrix once per tile instead of once per token. The grid is ``(token tiles, column blocks,
slots)``, sized from the shapes alone; a program whose tile lies past its slot's token count returns at
once, and base-model tokens (sorted last) have no program at all. Nothing is read back on the host, so
the calls can be captured in a CUDA graph.

Shrink (``[T, in] -> [T, R]``, a long reduction into a few columns) splits the reduction over
``split_k`` programs that add their partial sums into the float32 output atomically, so that a decode
batch still fills the GPU. Expand (``[T, R] -> [T, out]``, a short reduction into many columns) adds its
float32 product, rounded to ``y``'s dtype, into ``y`` in place, as the reference does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._triton_utils import next_pow2, num_sms

# Tunables (module-level so that tests and benchmarks can change them).
BLOCK_M_SMALL = 16  # tokens per tile when slots get few tokens each (decode); tl.dot needs 16
BLOCK_M_LARGE = 64  # tokens per tile for prefill-sized batches
TOKENS_PER_SLOT_FOR_LARGE = 32  # mean tokens per slot from which BLOCK_M_LARGE pays
SHRINK_BLOCK_K = 64
EXPAND_BLOCK_N = 64
MAX_SPLIT_K = 16
NUM_WARPS = 4


@dataclass
class SlotGrouping:
    """Token indices sorted by adapter slot; base-model tokens (slot -1) after every slot's."""

    sorted_tokens: torch.Tensor  # int32 [T]
    slot_counts: torch.Tensor  # int32 [S]: tokens of each slot
    slot_starts: torch.Tensor  # int32 [S]: where each slot's tokens begin in sorted_tokens


def group_by_slot(token_slots: torch.Tensor, num_slots: int) -> SlotGrouping:
    """Sort the tokens by slot on the device, without a host read (``scatter_add_`` rather than
    ``bincount``, which synchronises on CUDA). Once per call: the kernels keep the references' signature
    (tests/kernels/test_triton_kernels.py checks it), so a step's layers cannot share one grouping."""
    slots = token_slots.to(torch.int64)
    keys = torch.where(slots < 0, num_slots, slots)  # base-model tokens last, in a group with no program
    order = torch.argsort(keys, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=slots.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    starts = counts.cumsum(0) - counts
    return SlotGrouping(
        order.to(torch.int32), counts[:num_slots].to(torch.int32), starts[:num_slots].to(torch.int32)
    )


@triton.jit
def _slot_tile(sorted_tokens_ptr, slot_counts_ptr, slot_starts_ptr, slot, BLOCK_M: tl.constexpr):
    """The token indices of this program's tile of ``slot``'s tokens, and which of them exist."""
    offsets = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_slot = offsets < tl.load(slot_counts_ptr + slot)
    start = tl.load(slot_starts_ptr + slot)
    tokens = tl.load(sorted_tokens_ptr + start + offsets, mask=in_slot, other=0).to(tl.int64)
    return tokens, in_slot


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, out_ptr,
    sorted_tokens_ptr, slot_counts_ptr, slot_starts_ptr,
    R, K,
    stride_xm, stride_as, stride_ar, stride_om,
    SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``out[t, cols] (+)= x[t] @ a[slot, cols].T`` over this program's share of the reduction."""
    slot = tl.program_id(2)
    if tl.program_id(0) * BLOCK_M >= tl.load(slot_counts_ptr + slot):
        return
    tokens, in_slot = _slot_tile(sorted_tokens_ptr, slot_counts_ptr, slot_starts_ptr, slot, BLOCK_M)
    col_block, k_split = tl.program_id(1) // SPLIT_K, tl.program_id(1) % SPLIT_K
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < R
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + tokens[:, None] * stride_xm + ks[None, :]
    a_tile = a_ptr + slot.to(tl.int64) * stride_as + cols[None, :].to(tl.int64) * stride_ar + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_split * BLOCK_K, K, BLOCK_K * SPLIT_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_tile + k0, mask=in_slot[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_tile + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(x, a.to(x.dtype), input_precision=PRECISION)
    out = out_ptr + tokens[:, None] * stride_om + cols[None, :]
    mask = in_slot[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc, mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


@triton.jit
def _lora_expand_kernel(
    buf_ptr, b_ptr, y_ptr,
    sorted_tokens_ptr, slot_counts_ptr, slot_starts_ptr,
    N, R,
    stride_bufm, stride_bs, stride_bn, stride_ym, stride_yn,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``y[t, cols] += (buf[t] @ b[slot, cols].T)`` rounded to ``y``'s dtype, for one tile of tokens."""
    slot = tl.program_id(2)
    if tl.program_id(0) * BLOCK_M >= tl.load(slot_counts_ptr + slot):
        return
    tokens, in_slot = _slot_tile(sorted_tokens_ptr, slot_counts_ptr, slot_starts_ptr, slot, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    buf_tile = buf_ptr + tokens[:, None] * stride_bufm + ks[None, :]
    b_tile = b_ptr + slot.to(tl.int64) * stride_bs + cols[None, :].to(tl.int64) * stride_bn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, R, BLOCK_K):
        k_ok = (k0 + ks) < R
        buf = tl.load(buf_tile + k0, mask=in_slot[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        b = tl.load(b_tile + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(buf, b, input_precision=PRECISION)
    y_tile = y_ptr + tokens[:, None] * stride_ym + cols[None, :] * stride_yn
    mask = in_slot[:, None] & col_ok[None, :]
    y = tl.load(y_tile, mask=mask)
    tl.store(y_tile, y + acc.to(y_ptr.dtype.element_ty), mask=mask)


def choose_block_m(num_tokens: int, num_slots: int) -> int:
    return BLOCK_M_LARGE if num_tokens >= TOKENS_PER_SLOT_FOR_LARGE * max(num_slots, 1) else BLOCK_M_SMALL


def choose_split_k(num_tokens: int, rank: int, in_features: int, block_m: int, device: torch.device) -> int:
    """Reduction splits for shrink: enough programs to fill the device's SMs at decode sizes, each with
    at least two ``SHRINK_BLOCK_K`` steps of the reduction."""
    tiles = max(1, triton.cdiv(num_tokens, block_m) * triton.cdiv(rank, _shrink_block_n(rank)))
    most = max(1, min(MAX_SPLIT_K, in_features // (2 * SHRINK_BLOCK_K)))
    return max(1, min(most, num_sms(device) // tiles))


def _shrink_block_n(rank: int) -> int:
    return max(16, min(64, next_pow2(rank)))


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _shrink(
    x: torch.Tensor, lora_a: torch.Tensor, grouping: SlotGrouping, block_m: int, split_k: int
) -> torch.Tensor:
    (num_tokens, in_features), (num_slots, rank) = x.shape, lora_a.shape[:2]
    out = torch.zeros((num_tokens, rank), dtype=torch.float32, device=x.device)  # base-model rows stay 0
    if num_tokens == 0 or num_slots == 0 or rank == 0:
        return out
    x, lora_a = _last_dim_contiguous(x), _last_dim_contiguous(lora_a)
    block_n = _shrink_block_n(rank)
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(rank, block_n) * split_k, num_slots)
    _lora_shrink_kernel[grid](
        x, lora_a, out,
        grouping.sorted_tokens, grouping.slot_counts, grouping.slot_starts,
        rank, in_features,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0),
        SPLIT_K=split_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=SHRINK_BLOCK_K, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def _expand(
    y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, grouping: SlotGrouping, block_m: int
) -> torch.Tensor:
    (num_tokens, out_features), (num_slots, _, rank) = y.shape, lora_b.shape
    if num_tokens == 0 or num_slots == 0 or rank == 0 or out_features == 0:
        return y
    buf, lora_b = _last_dim_contiguous(buf), _last_dim_contiguous(lora_b)
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(out_features, EXPAND_BLOCK_N), num_slots)
    _lora_expand_kernel[grid](
        buf, lora_b, y,
        grouping.sorted_tokens, grouping.slot_counts, grouping.slot_starts,
        out_features, rank,
        buf.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0), y.stride(1),
        PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=EXPAND_BLOCK_N, BLOCK_K=max(16, min(64, next_pow2(rank))),
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return y


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.lora_shrink``."""
    num_tokens, (num_slots, rank, in_features) = x.shape[0], lora_a.shape
    block_m = choose_block_m(num_tokens, num_slots)
    split_k = choose_split_k(num_tokens, rank, in_features, block_m, x.device)
    return _shrink(x, lora_a, group_by_slot(token_slots, num_slots), block_m, split_k)


def lora_expand(
    y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """Same contract as ``reference.lora_expand`` (``y`` updated in place and returned)."""
    num_slots = lora_b.shape[0]
    grouping = group_by_slot(token_slots, num_slots)
    return _expand(y, buf, lora_b, grouping, choose_block_m(y.shape[0], num_slots))
