"""Pure-torch references of every kernel, with the same signatures as the Triton versions.

They are the engine's ``torch`` backend and what its ``cpu`` backend (kernels/cpu.py) runs for ops
or dtypes its C++ does not cover (so they must be vectorised, not merely correct), and the oracle the
Triton and C++ kernels are tested against. The kernel contract, shared by all three: ``k_cache`` and
``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``; the other shapes are in each
function's docstring. Both attention kernels take the variants as keywords, ``None`` meaning none:
``sliding_window`` (HF's: a query at position ``p`` sees keys ``p - sliding_window + 1 .. p``; table
entries before those are never read) and ``logit_softcap`` (``tanh(score / cap) * cap``, Gemma 2).

An FP8 cache (``torch.float8_e4m3fn``, vLLM's ``kv_cache_dtype="fp8"``) holds ``x / scale`` saturated to
e4m3's range and is read as ``cache * scale``, with a per-tensor ``k_scale`` and ``v_scale`` (float32
tensors of one element, ``None`` meaning 1.0; see "FP8 KV cache" at the end). Caches of other dtypes
ignore the scales, as vLLM's do with ``kv_cache_dtype="auto"``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    An FP8 cache stores ``x / scale`` saturated to +-448 (``quantize_kv``)."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    for x, cache, x_scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = _storage_view(cache).view(-1, cache.shape[2], cache.shape[3])
        rows.index_copy_(0, slot_mapping, _storage_view(quantize_kv(x, cache.dtype, x_scale)))


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int, first: int = 0
) -> torch.Tensor:
    """Cached vectors ``first .. context_len - 1`` of one sequence, from the start of ``first``'s block:
    ``[context_len - first_block * block_size, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    first_block = first // block_size
    num_blocks = (context_len + block_size - 1) // block_size
    used = block_table[first_block:num_blocks].long()
    blocks = _storage_view(cache).index_select(0, used).view(cache.dtype)
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[: context_len - first_block * block_size]


def window_start(position: torch.Tensor | int, sliding_window: int | None) -> torch.Tensor | int:
    """The first key position a query at ``position`` attends to.

    HF Transformers' convention (transformers/masking_utils.py ``sliding_window_overlay``: ``kv_idx >
    q_idx - sliding_window``): the query sees itself and the ``sliding_window - 1`` keys before it.
    """
    if sliding_window is None:
        return position * 0
    start = position - sliding_window + 1
    return start.clamp(min=0) if isinstance(start, torch.Tensor) else max(start, 0)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    logit_softcap: float | None,
    is_causal: bool = False,
) -> torch.Tensor:
    """q ``[B, H, L, D]`` over keys/values ``[B, Hkv, S, D]`` where ``mask`` (``[B or 1, 1, L, S]``,
    True = attend) allows. SDPA where it can; soft-capping needs the scores, so then the math by hand."""
    group = q.shape[1] // keys.shape[1]
    if logit_softcap is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=group > 1
        )
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    # Gemma 2's attn_logit_softcapping: squash the scaled scores before the mask and the softmax.
    scores = torch.tanh(scores / logit_softcap) * logit_softcap
    if is_causal:
        mask = torch.ones(q.shape[2], keys.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values)


DECODE_CHUNK = 16  # sequences attended together; chunks of similar length keep padding small


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

    The query sits at position ``context_len - 1``. ``sliding_window``: it attends only to the last
    ``sliding_window`` positions (itself included), so block-table entries before those are never read
    and may be a placeholder. ``logit_softcap``: scores become ``tanh(score / cap) * cap`` after the
    scale, before the softmax (Gemma 2).

    On a CPU the cost is gathering every sequence's blocks into a padded batch, so sequences are sorted
    by context length and attended in chunks, each padded only to its own longest (windowed) context.
    """
    num_seqs = q.shape[0]
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    order = torch.argsort(context_lens.to(q.device), stable=True)
    for start in range(0, num_seqs, DECODE_CHUNK):
        rows = order[start:start + DECODE_CHUNK]
        out[rows] = _decode_chunk(
            q[rows], k_cache, v_cache, block_tables[rows], context_lens[rows], scale, sliding_window,
            logit_softcap, k_scale, v_scale,
        )
    return out


def _decode_chunk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    lens = context_lens.to(q.device).long()
    # Each sequence's blocks from the one holding its first visible key: a window bounds the gather.
    first_pos = window_start(lens - 1, sliding_window)
    first_block = first_pos // block_size
    num_blocks = int(((lens + block_size - 1) // block_size - first_block).max())
    columns = first_block[:, None] + torch.arange(num_blocks, device=q.device)[None, :]
    table = block_tables.to(q.device).long().gather(1, columns.clamp(max=block_tables.shape[1] - 1))
    padded_len = num_blocks * block_size
    # [num_seqs, num_kv_heads, padded_len, head_dim], computed in fp32 whatever the cache dtype.
    batch = (num_seqs, padded_len, num_kv_heads, head_dim)
    keys = _gather_blocks(k_cache, table, k_scale).view(batch).transpose(1, 2)
    values = _gather_blocks(v_cache, table, v_scale).view(batch).transpose(1, 2)
    key_pos = (first_block * block_size)[:, None] + torch.arange(padded_len, device=q.device)[None, :]
    valid = (key_pos < lens[:, None]) & (key_pos >= first_pos[:, None])
    out = _attend(
        q.float().view(num_seqs, num_heads, 1, head_dim), keys, values, valid[:, None, None, :], scale,
        logit_softcap,
    )
    return out.view(num_seqs, num_heads, head_dim).to(q.dtype)


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
    """Packed variable-length queries, each attending causally to its cached context.

    Query ``i`` of a sequence sits at absolute position ``context_len - q_len + i``, so earlier chunks
    and prefix-cache hits are attended to from the cache like any other token. ``sliding_window`` and
    ``logit_softcap`` as in ``paged_attention_decode``: a query at position ``p`` sees keys
    ``p - sliding_window + 1 .. p``.
    """
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for seq, context_len in enumerate(lens):
        start, end = starts[seq], starts[seq + 1]
        q_len = end - start
        if q_len == 0:
            continue
        first = window_start(context_len - q_len, sliding_window)
        keys = _gather_context(k_cache, block_tables[seq], context_len, first)
        values = _gather_context(v_cache, block_tables[seq], context_len, first)
        keys, values = dequantize_kv(keys, k_scale, q.dtype), dequantize_kv(values, v_scale, q.dtype)
        out[start:end] = _causal_attention(q[start:end], keys, values, scale, sliding_window, logit_softcap)
    return out


def _causal_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """q ``[q_len, H, D]`` at the last q_len positions of the keys ``[ctx, Hkv, D]`` (which may start
    after position 0: relative positions are all that matter)."""
    q_len, context_len = q.shape[0], keys.shape[0]
    # [1, heads, len, D]: with a batch dimension the CPU SDPA takes its flash kernel, without one the
    # math path (4x slower).
    q = q.transpose(0, 1)[None]
    keys, values = keys.transpose(0, 1)[None].to(q.dtype), values.transpose(0, 1)[None].to(q.dtype)
    if q_len == context_len and sliding_window is None:  # a whole prompt: SDPA's causal mask is right
        out = _attend(q, keys, values, None, scale, logit_softcap, is_causal=True)
    else:  # after a cached prefix: SDPA's is_causal aligns top-left, these queries need bottom-right
        query_pos = torch.arange(context_len - q_len, context_len, device=q.device)
        key_pos = torch.arange(context_len, device=q.device)[None, :]
        mask = (key_pos <= query_pos[:, None]) & (key_pos >= window_start(query_pos, sliding_window)[:, None])
        out = _attend(q, keys, values, mask, scale, logit_softcap)
    return out[0].transpose(0, 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``: the normed input and the new residual."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding, as Llama checkpoints in HF format expect.

    q ``[num_tokens, num_heads, head_dim]``, k ``[num_tokens, num_kv_heads, head_dim]``,
    ``cos_sin_cache`` ``[max_position, head_dim]``: cos in the first half, sin in the second.
    """
    cos, sin = cos_sin_cache.index_select(0, positions.long()).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for the fused gate/up projection."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- mixture of experts (kernels/fused_moe.py is the Triton version) -----------------------------------


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Each token through its top-k experts' SwiGLU MLPs, weighted and summed: ``[T, H]``.

    hidden ``[T, H]``; w13 ``[E, 2I, H]``, every expert's gate rows then its up rows; w2 ``[E, H, I]``;
    topk_weights ``[T, k]`` (any float dtype); topk_ids ``[T, k]`` (any integer dtype). The plain loop over
    experts, as HF Transformers' ``MixtralExperts`` runs it: one gather, two matmuls and one weighted
    scatter-add per expert that got tokens. Sums accumulate in float32.
    """
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == expert)
        if token.numel() == 0:
            continue
        expert_out = F.linear(silu_and_mul(F.linear(hidden[token], w13[expert])), w2[expert])
        out.index_add_(0, token, expert_out.float() * topk_weights[token, slot, None].float())
    return out.to(hidden.dtype)


# --- FP8 KV cache (vLLM's kv_cache_dtype "fp8", e4m3) ----------------------------------------------------

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448: e4m3fn has no infinity, an overflow would be NaN


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` as a cache of ``cache_dtype`` holds it: for FP8, ``x / scale`` in float32, saturated to
    +-448, rounded to nearest even; otherwise a plain cast (the scale is ignored)."""
    if cache_dtype != FP8_KV_DTYPE:
        return x.to(cache_dtype)
    x = x.float() if scale is None else x.float() / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(cached: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as ``dtype`` values: an FP8 row times its scale (in float32), others cast."""
    if cached.dtype != FP8_KV_DTYPE:
        return cached.to(dtype)
    values = cached.float()
    return (values if scale is None else values * scale).to(dtype)


def _storage_view(cache: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as their bytes: ATen's CPU indexing ops do not all take float8 types, and copying
    bytes is what they would do anyway."""
    return cache.view(torch.uint8) if cache.dtype == FP8_KV_DTYPE else cache


def _gather_blocks(cache: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``cache[table]`` in float32, FP8 blocks times their scale."""
    return dequantize_kv(_storage_view(cache)[table].view(cache.dtype), scale, torch.float32)


def w8a16_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Weight-only INT8 matmul: ``x @ (weight * scale[:, None]).T + bias``.

    ``x`` ``[..., K]`` float, ``weight`` int8 ``[N, K]``, ``scale`` ``[N]`` (one per output channel),
    ``bias`` ``[N]`` or None -> ``[..., N]`` in ``x``'s dtype. The int8 values are exact in every float
    dtype, so the product runs in ``x``'s dtype and the scale is applied to it, once per output.
    """
    out = F.linear(x, weight.to(x.dtype)) * scale.to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[M, K]`` -> (e4m3 ``[M, K]``, float32 scale ``[M]``): each row divided by ``max|row| / 448``,
    rounded to nearest even. The weights' per-output-channel quantization at load, and the activations'
    per-token one at run time (vLLM's dynamic FP8 scheme)."""
    scale = x.float().abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # an all-zero row stays zero
    return quantize_kv(x, FP8_KV_DTYPE, scale[:, None]), scale


def fp8_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """FP8 (W8A8) matmul, vLLM's ``--quantization fp8``: ``x``'s rows quantized to e4m3 with a scale each
    (``quantize_fp8_rows``), multiplied by the e4m3 ``weight`` ``[N, K]`` (scale ``[N]`` per output
    channel) in float32, then both scales and the bias -> ``[..., N]`` in ``x``'s dtype. e4m3 products
    are exact in float32, so only the summation order may differ from a GPU's FP8 tensor cores."""
    rows, row_scale = quantize_fp8_rows(x.reshape(-1, x.shape[-1]))
    out = (rows.float() @ weight.float().T) * row_scale[:, None] * scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


# ---- GGUF blocks: Q8_0 / Q4_0 / Q4_1 weights, int8 x int8 dot products ---------------------------------
#
# A weight row of K values is K / 32 blocks. ``qs`` uint8 ``[N, K / 32 * QBYTES]``: per block 32 int8 values
# (Q8_0, stored as their bytes) or 16 bytes of nibbles (Q4_0 / Q4_1: the low nibbles are the block's values
# 0..15, the high nibbles 16..31, as in the GGUF file); ``scales`` float16 ``[N, K / 32]`` (the file's d);
# ``mins`` float16 ``[N, K / 32]`` for Q4_1 (the file's m), else None. Values: Q8_0 ``d * q``; Q4_0
# ``d * (q - 8)``; Q4_1 ``d * q + m``. The activation row is quantized once to the same blocks of 32
# (``quantize_activation_blocks``), so each block's product is an exact integer sum; Q4_0 is Q4_1 with
# ``m = -8 d``. kernels/csrc/gguf_cpu.cpp computes exactly this, accumulating in a different order.

GGUF_BLOCK = 32
GGUF_Q8_0, GGUF_Q4_0, GGUF_Q4_1 = 8, 2, 3  # ggml's type ids (gguf.GGMLQuantizationType)
GGUF_QBYTES = {GGUF_Q8_0: 32, GGUF_Q4_0: 16, GGUF_Q4_1: 16}  # bytes of quantized values per block


def quantize_activation_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float ``[M, K]`` (K a multiple of 32) -> (int8 ``[M, K/32, 32]``, float32 scale ``[M, K/32]``, int32
    block sums ``[M, K/32]``): ``d = max|x| / 127`` per block, ``q = round(x * (1 / d))`` (half to even),
    0 for an all-zero block."""
    blocks = x.to(torch.float32).reshape(x.shape[0], -1, GGUF_BLOCK)
    d = blocks.abs().amax(dim=-1) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None]).to(torch.int8)
    return q, d, q.to(torch.int32).sum(dim=-1, dtype=torch.int32)


def gguf_block_values(qs: torch.Tensor, qtype: int) -> torch.Tensor:
    """The integer values ``[N, K/32, 32]`` (int32) of packed blocks: Q8_0 -128..127, Q4 0..15."""
    if qtype not in GGUF_QBYTES:
        raise ValueError(f"unsupported GGUF block type {qtype}")
    blocks = qs.reshape(qs.shape[0], -1, GGUF_QBYTES[qtype])
    if qtype == GGUF_Q8_0:
        return blocks.view(torch.int8).to(torch.int32)
    nibbles = blocks.to(torch.int32)
    return torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)


def gguf_block_mins(scales: torch.Tensor, mins: torch.Tensor | None, qtype: int) -> torch.Tensor | None:
    """The per-block offset ``m`` in float32 (Q4_0: ``-8 d``), None for Q8_0."""
    if qtype == GGUF_Q8_0:
        return None
    if qtype == GGUF_Q4_0:
        return -8 * scales.to(torch.float32)
    if mins is None:
        raise ValueError("Q4_1 blocks need their mins")
    return mins.to(torch.float32)


def dequantize_gguf(
    qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, qtype: int
) -> torch.Tensor:
    """The float32 matrix ``[N, K]`` the blocks stand for (for prefill-sized GEMMs and embedding rows)."""
    values = gguf_block_values(qs, qtype).to(torch.float32) * scales.to(torch.float32)[..., None]
    m = gguf_block_mins(scales, mins, qtype)
    if m is not None:
        values = values + m[..., None]
    return values.reshape(qs.shape[0], -1)


def gguf_matmul(
    x: torch.Tensor,
    qs: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    qtype: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` for GGUF-block weights ``W`` (layout above), ``x`` ``[..., K]`` float, K a
    multiple of 32 -> ``[..., N]`` float32. Per block ``b``: ``d_w d_x sum(q_w q_x) + m_w (d_x sum(q_x))``
    (the second term only for Q4_0 / Q4_1), summed over the blocks in float32."""
    k = x.shape[-1]
    if k % GGUF_BLOCK:
        raise ValueError(f"GGUF blocks need K a multiple of {GGUF_BLOCK}, got {k}")
    x2 = x.reshape(-1, k)
    xq, dx, sx = quantize_activation_blocks(x2)
    wq = gguf_block_values(qs, qtype).to(torch.float32)  # products sum to < 2^24: exact in float32
    dw = scales.to(torch.float32)
    mw = gguf_block_mins(scales, mins, qtype)
    out = torch.zeros(x2.shape[0], qs.shape[0], dtype=torch.float32)
    xqf = xq.to(torch.float32)
    for b in range(k // GGUF_BLOCK):
        sums = xqf[:, b] @ wq[:, b].T  # [M, N] exact integers
        out += (dx[:, b, None] * dw[None, :, b]) * sums
        if mw is not None:
            out += mw[None, :, b] * (dx[:, b] * sx[:, b].to(torch.float32))[:, None]
    if bias is not None:
        out += bias.to(torch.float32)
    return out.view(*x.shape[:-1], qs.shape[0])


# ---- LoRA: many adapters in one batch (Punica / S-LoRA's shrink and expand) ---------------------------
#
# A layer's resident adapters sit in slots ``0 .. S-1`` of two stacked tensors; ``token_slots[t]`` is the
# slot of token ``t``'s adapter, ``-1`` for a base-model token. A projection that merges several
# checkpoint projections (q/k/v, gate/up) keeps one A and one B per slice and stacks them block-diagonally,
# so one shrink and one expand serve the whole merged matrix: slice ``i``'s A is rows ``i*r .. (i+1)*r``
# of ``lora_a``; its B fills output rows ``offset_i .. offset_i + size_i`` and columns ``i*r .. (i+1)*r``
# of ``lora_b``, zeros elsewhere. Smaller ranks and untargeted slices are zero padding, and PEFT's
# ``alpha / r`` is folded into B at load, so the kernels take no scaling.


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """``buf[t] = x[t] @ lora_a[token_slots[t]].T``, zeros where the slot is -1.

    ``x`` ``[T, in]``, ``lora_a`` ``[S, R, in]``, ``token_slots`` int ``[T]`` -> ``[T, R]`` float32
    (the rank-sized intermediate is kept in float32 whatever ``x``'s dtype, as vLLM's punica does).
    """
    has_lora = token_slots >= 0
    a = lora_a[token_slots.clamp(min=0).long()].float()  # [T, R, in]
    buf = torch.bmm(a, x.float().unsqueeze(-1)).squeeze(-1)
    return buf * has_lora.unsqueeze(-1)


def lora_expand(
    y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """``y[t] += buf[t] @ lora_b[token_slots[t]].T`` in place, rows whose slot is -1 unchanged; returns ``y``.

    ``y`` ``[T, out]``, ``buf`` ``[T, R]`` (``lora_shrink``'s), ``lora_b`` ``[S, out, R]``.
    """
    has_lora = token_slots >= 0
    b = lora_b[token_slots.clamp(min=0).long()].float()  # [T, out, R]
    delta = torch.bmm(b, buf.float().unsqueeze(-1)).squeeze(-1) * has_lora.unsqueeze(-1)
    return y.add_(delta.to(y.dtype))
