"""Prefill attention over the paged KV cache for packed variable-length query chunks.

Query ``i`` of a sequence sits at absolute position ``context_len - q_len + i`` and attends causally to
every cached key up to it, so chunked prefill and prefix-cache hits read their earlier tokens from the
cache like any other. The chunk's own K/V must already be stored (``store_kv_cache`` runs first).

Programs are laid out without knowing the chunk lengths on the host: sequence ``s`` owns the query
tiles numbered from ``cu_seqlens_q[s] // BLOCK_M + s``, a numbering that never overlaps and stays below
``num_tokens // BLOCK_M + num_seqs``; each program finds its sequence by binary search and programs past
the end of their sequence's chunk do nothing.

An FP8 cache is read as ``cache * scale`` as in kernels/paged_attention_decode.py: tiles cast to the
query's dtype, ``k_scale`` in the score scale, ``v_scale`` on the output.

With a sliding window a query tile's key loop starts at its first query's first visible key, so a
chunk late in a long prompt costs its window, not its whole context. Only the key tiles that some of a
query tile's queries must not see (the causal diagonal, a window's edge, the end) compute a mask.
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import dot_dim, fp8_kv_scales, softcap_scores

LOG2E = 1.4426950408889634
BLOCK_M = 64  # query tokens per program
BLOCK_N = 64  # context tokens per inner iteration
NUM_WARPS = 4
NUM_STAGES = 2
NO_WINDOW = 1 << 30  # the kernels' window when there is none: wider than any context


@triton.jit
def _load(ptrs, mask, USE_MASK: tl.constexpr, other):
    """``tl.load`` with ``mask`` only where it may be false: an unmasked load vectorizes and pipelines."""
    if USE_MASK:
        values = tl.load(ptrs, mask=mask, other=other)
    else:
        values = tl.load(ptrs)
    return values


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table, head_offset, tile, q_pos, kv_end,
    qk_scale, softcap, window, stride_cb, stride_cs, d,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr, MASKED: tl.constexpr,
):
    """One online-softmax step over keys ``tile .. tile + BLOCK_N``. ``MASKED`` tiles hold keys past the
    end, or keys some of the tile's queries must not see (the causal diagonal, a window's edge); the
    others are read and used whole, with no mask to compute."""
    n = tile + tl.arange(0, BLOCK_N)
    n_ok = n < kv_end
    block = _load(table + n // BLOCK_SIZE, n_ok, MASKED, 0)
    offs = block.to(tl.int64) * stride_cb + (n % BLOCK_SIZE).to(tl.int64) * stride_cs + head_offset
    kv_ptrs = offs[:, None] + d[None, :]
    kv_mask = (d < HEAD_DIM)[None, :]  # the padded dims (dot_dim); an inner tile has no other
    if MASKED:
        kv_mask = n_ok[:, None] & kv_mask
    k = _load(k_cache_ptr + kv_ptrs, kv_mask, MASKED or BLOCK_D != HEAD_DIM, 0.0)
    if FP8:  # e4m3 values are exact in every q dtype; the scale is in qk_scale
        k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if SOFTCAP:
        s = softcap_scores(s, softcap)
    if MASKED:
        visible = (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - window) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _load(v_cache_ptr + kv_ptrs, kv_mask, MASKED or BLOCK_D != HEAD_DIM, 0.0)
    if FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr, qk_scale, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    num_seqs, window,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SEARCH_STEPS: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, FP8: tl.constexpr,
):
    # Heads vary fastest in launch order: the GROUP query heads that read one KV head's keys run side by
    # side and share them in L2.
    head = tl.program_id(0)
    tile_id = tl.program_id(1)
    kv_head = head // GROUP

    # The last sequence whose first tile number is <= tile_id.
    lo = num_seqs * 0
    hi = num_seqs - 1
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(cu_seqlens_ptr + mid).to(tl.int32) // BLOCK_M + mid
        found = first_tile <= tile_id
        lo = tl.where(found, mid, lo)
        hi = tl.where(found, hi, mid - 1)
    seq = lo
    q_start = tl.load(cu_seqlens_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int32) - q_start
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    # A chunk's last query tile sees the most keys: its programs take the chunk's first tile numbers, so
    # the longest work starts first and the short tiles fill in at the end. Numbers past the chunk's
    # tiles (the layout reserves one spare per sequence) get first_query = q_len: nothing to do.
    local = tile_id - (q_start // BLOCK_M + seq)
    num_tiles = tl.cdiv(q_len, BLOCK_M)
    first_query = tl.where(local < num_tiles, (num_tiles - 1 - local) * BLOCK_M, q_len)

    m_idx = first_query + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = m_idx < q_len
    dmask = d < HEAD_DIM
    q_pos = context_len - q_len + m_idx
    tokens = (q_start + m_idx).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=m_mask[:, None] & dmask[None, :], other=0.0)
    # Keys up to the tile's last query; none at all for a tile past the end of its chunk.
    first_pos = context_len - q_len + first_query
    last_pos = context_len - q_len + tl.minimum(first_query + BLOCK_M, q_len) - 1
    kv_end = tl.where(first_query < q_len, last_pos + 1, 0)
    # HF's sliding window, kv_idx > q_idx - window: nothing before the tile's first query's window.
    kv_start = tl.maximum(first_pos - window + 1, 0)
    # Keys every query of the tile sees: after the last query's window start, up to the first query.
    # Whole BLOCK_N tiles of them, from the first tile boundary past the window's edge, need no mask;
    # the tiles before (the window's edge) and after (the diagonal) are masked.
    full_start = tl.minimum(
        kv_start + tl.cdiv(tl.maximum(last_pos - window + 1 - kv_start, 0), BLOCK_N) * BLOCK_N, kv_end)
    full_end = full_start + tl.maximum(tl.minimum(first_pos + 1, kv_end) - full_start, 0) // BLOCK_N * BLOCK_N

    if FP8:  # the cache holds K / k_scale and V / v_scale: both scales apply once, outside the loop
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_offset = kv_head.to(tl.int64) * stride_ch
    for tile in range(kv_start, full_start, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table, head_offset, tile, q_pos, kv_end,
            qk_scale, softcap, window, stride_cb, stride_cs, d,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, PRECISION, SOFTCAP, FP8, True)
    for tile in range(full_start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table, head_offset, tile, q_pos, kv_end,
            qk_scale, softcap, window, stride_cb, stride_cs, d,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, PRECISION, SOFTCAP, FP8, False)
    for tile in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table, head_offset, tile, q_pos, kv_end,
            qk_scale, softcap, window, stride_cb, stride_cs, d,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, PRECISION, SOFTCAP, FP8, True)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if FP8:
        out = out * tl.load(v_scale_ptr)
    dst = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & dmask[None, :])


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed variable-length queries ``[num_tokens, num_heads, head_dim]``, each attending causally to
    its cached context (see the module docstring); ``sliding_window``, ``logit_softcap`` and the FP8
    cache's ``k_scale``/``v_scale`` as in ``reference.paged_attention_prefill``."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    fp8, k_scale, v_scale = fp8_kv_scales(k_cache, k_scale, v_scale)
    grid = (num_heads, num_tokens // BLOCK_M + num_seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        k_scale, v_scale, scale * LOG2E, (logit_softcap or 1.0) * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_seqs, NO_WINDOW if sliding_window is None else sliding_window,
        HEAD_DIM=head_dim, GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, BLOCK_D=dot_dim(head_dim), SEARCH_STEPS=max(1, num_seqs.bit_length()),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SOFTCAP=logit_softcap is not None,
        FP8=fp8, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out
