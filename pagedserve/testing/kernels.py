"""Random scenarios shared by the kernel tests (CPU interpreter and GPU) and benchmarks: paged KV caches,
mixture-of-experts routing, batched LoRA adapters and GGUF weight blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], every slot random
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, width] int32; entries past a context point at other blocks
    context_lens: torch.Tensor  # [num_seqs] int32
    q_decode: torch.Tensor  # [num_seqs, num_heads, head_dim]
    q_prefill: torch.Tensor  # [sum(q_lens), num_heads, head_dim]
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32


def contexts(block_size: int, long_blocks: int = 4) -> list[int]:
    """Context lengths for ``make_paged_case``: one token, exactly block-aligned, ragged, long and ragged
    (``long_blocks`` blocks and a bit), and a few tokens."""
    return [1, 2 * block_size, 2 * block_size + 5, long_blocks * block_size + 3, 7]


def make_paged_case(
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    q_lens: list[int] | None = None,
    extra_width: int = 1,
    seed: int = 0,
) -> PagedCase:
    """Sequences with the given contexts, their blocks scattered over a shuffled cache.

    ``q_lens`` (default: all 1) sizes the packed prefill queries; each must be <= its context.
    ``extra_width`` adds table columns beyond the longest context, so reads past a context would hit
    another sequence's data instead of going unnoticed.
    """
    gen = torch.Generator().manual_seed(seed)
    q_lens = q_lens if q_lens is not None else [1] * len(context_lens)
    assert all(0 <= q <= c for q, c in zip(q_lens, context_lens, strict=True))
    blocks_per_seq = [(c + block_size - 1) // block_size for c in context_lens]
    width = max(blocks_per_seq, default=0) + extra_width
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.empty(len(context_lens), width, dtype=torch.int32)
    used = 0
    for seq, n in enumerate(blocks_per_seq):
        tables[seq, :n] = torch.tensor(order[used:used + n], dtype=torch.int32)
        used += n
        # Padding columns: valid block ids that belong to someone else.
        tables[seq, n:] = torch.randint(0, num_blocks, (width - n,), generator=gen, dtype=torch.int32)

    device = torch.device(device)
    values = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=values, device=device).to(dtype)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    return PagedCase(
        k_cache=rand(*shape),
        v_cache=rand(*shape),
        block_tables=tables.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        q_decode=rand(len(context_lens), num_heads, head_dim),
        q_prefill=rand(cu[-1], num_heads, head_dim),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
    )


def hide_blocks_outside_window(
    case: PagedCase, sliding_window: int, q_lens: list[int] | None = None
) -> PagedCase:
    """``case`` with every block-table entry wholly before each sequence's first query's window pointing
    at one extra block full of NaN, as the KV cache manager's null block replaces freed blocks: a kernel
    that reads any of them returns NaN. ``q_lens`` as given to ``make_paged_case`` (default: all 1)."""
    block_size = case.k_cache.shape[1]
    null_block = case.k_cache.shape[0]
    nan_block = torch.full_like(case.k_cache[:1], float("nan"))
    tables = case.block_tables.clone()
    q_lens = q_lens if q_lens is not None else [1] * tables.shape[0]
    for seq, (context_len, q_len) in enumerate(zip(case.context_lens.tolist(), q_lens, strict=True)):
        first_visible = max(context_len - q_len - sliding_window + 1, 0)
        tables[seq, : first_visible // block_size] = null_block
    return PagedCase(
        k_cache=torch.cat([case.k_cache, nan_block]),
        v_cache=torch.cat([case.v_cache, nan_block]),
        block_tables=tables,
        context_lens=case.context_lens,
        q_decode=case.q_decode,
        q_prefill=case.q_prefill,
        cu_seqlens_q=case.cu_seqlens_q,
    )


@dataclass
class MoECase:
    hidden: torch.Tensor  # [T, H]
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    topk_weights: torch.Tensor  # float32 [T, k], each row summing to 1
    topk_ids: torch.Tensor  # int64 [T, k], distinct experts per token
    idle_experts: list[int]  # experts no token is routed to


def make_moe_case(
    num_tokens: int,
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    top_k: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    num_idle: int = 1,
    seed: int = 0,
) -> MoECase:
    """Random weights and random top-k routing that never picks the last ``num_idle`` experts (so some
    expert gets no tokens whatever ``num_tokens`` is); weights scaled to keep activations O(1)."""
    assert top_k <= num_experts - num_idle
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

    scores = torch.rand(num_tokens, num_experts, generator=gen)
    scores[:, num_experts - num_idle:] = -1.0
    top_scores, topk_ids = scores.topk(top_k, dim=-1)
    return MoECase(
        hidden=rand(num_tokens, hidden_size),
        w13=rand(num_experts, 2 * intermediate_size, hidden_size, scale=hidden_size**-0.5),
        w2=rand(num_experts, hidden_size, intermediate_size, scale=intermediate_size**-0.5),
        topk_weights=(top_scores / top_scores.sum(-1, keepdim=True)).to(device),
        topk_ids=topk_ids.to(device),
        idle_experts=list(range(num_experts - num_idle, num_experts)),
    )


def fp8_paged_case(
    case: PagedCase, k_scale: float, v_scale: float
) -> tuple[PagedCase, torch.Tensor, torch.Tensor]:
    """``case`` with its caches stored as FP8 (``reference.quantize_kv``) under the given scales, and the
    scales as the kernels take them (float32 tensors of one element on the case's device)."""
    from pagedserve.kernels import reference

    device = case.k_cache.device
    scales = [torch.tensor([s], dtype=torch.float32, device=device) for s in (k_scale, v_scale)]
    fp8 = PagedCase(
        k_cache=reference.quantize_kv(case.k_cache, reference.FP8_KV_DTYPE, scales[0]),
        v_cache=reference.quantize_kv(case.v_cache, reference.FP8_KV_DTYPE, scales[1]),
        block_tables=case.block_tables,
        context_lens=case.context_lens,
        q_decode=case.q_decode,
        q_prefill=case.q_prefill,
        cu_seqlens_q=case.cu_seqlens_q,
    )
    return fp8, scales[0], scales[1]


@dataclass
class LoRACase:
    x: torch.Tensor  # [T, in]
    lora_a: torch.Tensor  # [S, R, in]
    lora_b: torch.Tensor  # [S, out, R]
    y: torch.Tensor  # [T, out]: the base projection's output that lora_expand adds into
    token_slots: torch.Tensor  # int64 [T], -1 for a base-model token


def make_lora_case(
    token_slots: list[int],
    num_slots: int,
    rank: int,
    in_features: int,
    out_features: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> LoRACase:
    """Random adapters for ``lora_shrink`` / ``lora_expand`` with the given slot per token; weights scaled
    to keep the shrink and the delta O(1)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

    return LoRACase(
        x=rand(len(token_slots), in_features),
        lora_a=rand(num_slots, rank, in_features, scale=in_features**-0.5),
        lora_b=rand(num_slots, out_features, rank, scale=rank**-0.5),
        y=rand(len(token_slots), out_features),
        token_slots=torch.tensor(token_slots, dtype=torch.int64, device=device),
    )


GGUF_TYPES = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3}  # kernels/reference.py GGUF_Q8_0 / GGUF_Q4_0 / GGUF_Q4_1


def random_gguf_blocks(
    n: int, k: int, qtype: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(qs, scales, mins) in kernels/reference.py's GGUF layout for an ``[n, k]`` matrix: random bytes,
    scales and mins of a trained model's size."""
    from pagedserve.kernels.reference import GGUF_BLOCK, GGUF_Q4_1, GGUF_QBYTES

    nb = k // GGUF_BLOCK
    qs = torch.randint(0, 256, (n, nb * GGUF_QBYTES[qtype]), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, nb, generator=gen) * 0.01).half()
    mins = (torch.randn(n, nb, generator=gen) * 0.05).half() if qtype == GGUF_Q4_1 else None
    return qs, scales, mins
