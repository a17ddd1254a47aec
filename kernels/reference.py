"""Pure-torch references of every kernel, with the same signatures as the Triton versions.

They are the engine's ``torch`` backend and what its ``cpu`` backend (kernels/cpu.py) runs for ops
or dtypes its C++ does not cover (so they must be vectorised, not merely correct), and the oracle the
Triton and C++ kernels are tested against. The kernel contract, shared by all three: ``k_cache`` and
``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``; the other shapes are in each
function's docstring. Both attention kernels take the variants as keywords, ``None`` meaning none:
``sliding_window`` (HF's: a query at position ``p`` sees keys ``p - sliding_window + 1 .. p``; table
entries before those are never read) and ``logit_softcap`` (``tanh(score / cap) * cap``, Gemma 2).
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
) -> None:
    """Write k, v ``[num_tokens, num_kv_heads, head_dim]`` into their slots; negative slots are skipped."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int, first: int = 0
) -> torch.Tensor:
    """Cached vectors ``first .. context_len - 1`` of one sequence, from the start of ``first``'s block:
    ``[context_len - first_block * block_size, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    first_block = first // block_size
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[first_block:num_blocks].long())
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
            logit_softcap,
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
    keys = k_cache[table].view(num_seqs, padded_len, num_kv_heads, head_dim).transpose(1, 2).float()
    values = v_cache[table].view(num_seqs, padded_len, num_kv_heads, head_dim).transpose(1, 2).float()
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
