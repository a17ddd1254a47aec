"""Decode attention over the paged KV cache: one query per sequence, split-K (flash-decoding).

Each program takes one sequence, one KV head with all the query heads that share it (GQA; the group is
padded to 16 rows for ``tl.dot``), and one partition of the context. With few sequences the context is
cut into several partitions so that long contexts still occupy every SM; a second kernel then merges
the partitions' softmax statistics. Launch sizes depend only on tensor shapes (never on the values of
``context_lens``), so the call needs no host synchronisation and can be captured in a CUDA graph.

An FP8 cache (``torch.float8_e4m3fn``) is read as ``cache * scale``: its tiles are cast to the query's
dtype (exact: every e4m3 value is a bf16, fp16 and fp32 value), ``k_scale`` joins the score scale and
``v_scale`` multiplies the output, so the loop does no more arithmetic than with a 16-bit cache.

With a sliding window the partitions cover the window, not the context: they start at the sequence's
first visible key, so a long context costs as much as its window and the blocks before it are never read.
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import dot_dim, fp8_kv_scales, next_pow2, num_sms, softcap_scores

LOG2E = 1.4426950408889634
# Tunables (module-level so that benchmarks can sweep them).
BLOCK_N = 64  # context tokens per inner iteration
MIN_PARTITION = 256  # fewest context tokens worth giving a program of their own
PROGRAMS_PER_SM = 4  # split the context until about this many programs per SM exist
NUM_WARPS = 4
NUM_STAGES = 2
NO_WINDOW = 1 << 30  # the kernels' window when there is none: wider than any context


@triton.jit
def _first_key(context_len, window):
    """The first key the query at ``context_len - 1`` sees: HF's ``kv_idx > q_idx - window``."""
    return tl.maximum(context_len - window, 0)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_stats_ptr,
    k_scale_ptr, v_scale_ptr, qk_scale, softcap,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    num_heads, partition_size, window,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    start = _first_key(context_len, window) + split * partition_size
    end = tl.minimum(start + partition_size, context_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)

    if FP8:  # the cache holds K / k_scale and V / v_scale: both scales apply once, outside the loop
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_offset = kv_head.to(tl.int64) * stride_ch
    for tile in range(start, end, BLOCK_N):
        t = tile + tl.arange(0, BLOCK_N)
        tmask = t < end
        block = tl.load(table + t // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        offs = block * stride_cb + (t % BLOCK_SIZE).to(tl.int64) * stride_cs + head_offset
        kv_mask = tmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP8:  # e4m3 values are exact in every q dtype; the scale is in qk_scale
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if SOFTCAP:
            s = softcap_scores(s, softcap)
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    has_keys = l_i > 0
    acc = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    if FP8:  # partials too: the merge is linear in them
        acc = acc * tl.load(v_scale_ptr)
    if NUM_SPLITS == 1:
        dst = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
    else:
        # Partials: out [seqs, heads, NUM_SPLITS, head_dim]; stats [2 (max, sum), seqs, heads, NUM_SPLITS].
        row = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc,
                 mask=gmask[:, None] & dmask[None, :])
        num_rows = tl.num_programs(0).to(tl.int64) * num_heads * NUM_SPLITS
        tl.store(part_stats_ptr + row, m_i, mask=gmask)
        tl.store(part_stats_ptr + num_rows + row, l_i, mask=gmask)


@triton.jit
def _merge_kernel(
    part_out_ptr, part_stats_ptr, context_lens_ptr, out_ptr,
    stride_os, stride_oh, num_heads, partition_size, window,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    used = tl.cdiv(context_len - _first_key(context_len, window), partition_size)
    sp = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, BLOCK_D)
    smask = sp < used
    dmask = d < HEAD_DIM
    row = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + sp
    num_rows = tl.num_programs(0).to(tl.int64) * num_heads * NUM_SPLITS
    m = tl.load(part_stats_ptr + row, mask=smask, other=-1.0e30)
    total_exp = tl.load(part_stats_ptr + num_rows + row, mask=smask, other=0.0)
    weight = tl.where(smask, tl.exp2(m - tl.max(m, axis=0)) * total_exp, 0.0)
    partial = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
                      mask=smask[:, None] & dmask[None, :], other=0.0)
    total = tl.sum(weight, axis=0)
    out = tl.sum(partial * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    dst = out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dmask)


def _partition(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> tuple[int, int]:
    """``(num_splits, partition_size)`` from shapes alone: enough programs to fill the device."""
    max_context = max(max_context, 1)
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms(device), num_seqs * num_kv_heads)
    splits = max(1, min(wanted, triton.cdiv(max_context, MIN_PARTITION)))
    partition = triton.cdiv(triton.cdiv(max_context, splits), BLOCK_N) * BLOCK_N
    return triton.cdiv(max_context, partition), partition


def _decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, partition,
            sliding_window=None, logit_softcap=None, k_scale=None, v_scale=None):
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if num_splits > 1:
        part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                               device=q.device)
        part_stats = torch.empty((2, num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_stats = out
    block_d = dot_dim(head_dim)
    fp8, k_scale, v_scale = fp8_kv_scales(k_cache, k_scale, v_scale)
    window = NO_WINDOW if sliding_window is None else sliding_window
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        out, part_out, part_stats,
        k_scale, v_scale, scale * LOG2E, (logit_softcap or 1.0) * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_heads, partition, window,
        HEAD_DIM=head_dim, GROUP=group, BLOCK_SIZE=block_size, BLOCK_G=dot_dim(group),
        BLOCK_D=block_d, BLOCK_N=BLOCK_N, NUM_SPLITS=num_splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SOFTCAP=logit_softcap is not None,
        FP8=fp8, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if num_splits > 1:
        _merge_kernel[(num_seqs, num_heads)](
            part_out, part_stats, context_lens, out,
            out.stride(0), out.stride(1), num_heads, partition, window,
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_SPLITS=next_pow2(num_splits),
            BLOCK_D=block_d,
        )
    return out


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence against its cached context. q ``[num_seqs, num_heads, head_dim]``.
    ``sliding_window``, ``logit_softcap`` and the FP8 cache's ``k_scale``/``v_scale`` as in
    ``reference.paged_attention_decode``.

    The context is bounded by the block table's width (``block_tables.shape[1] * block_size``); give the
    kernel a table no wider than the step needs so that the split-K partitions fit the real contexts.
    """
    max_context = block_tables.shape[1] * k_cache.shape[1]
    if sliding_window is not None:  # the keys any query sees: the partitions split only those
        max_context = min(max_context, sliding_window)
    num_splits, partition = _partition(q.shape[0], k_cache.shape[2], max_context, q.device)
    return _decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, partition,
                   sliding_window, logit_softcap, k_scale, v_scale)

