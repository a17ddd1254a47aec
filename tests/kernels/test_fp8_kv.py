"""The FP8 KV cache's torch reference (kernels/reference.py) and the cpu backend's use of it.

The reference is the spec the Triton kernels are held to (test_fp8_kv_triton.py, tests/gpu/): a store
writes ``x / scale`` saturated to +-448 and rounded to nearest even e4m3, and attention reads
``cache * scale``. Here it is checked against those definitions directly, and its error against the
unquantized cache is bounded: QUANTIZATION_ATOL, for unit-variance K/V stored at scales that use about a
fifth of e4m3's range (e4m3 keeps 3 mantissa bits: a relative rounding error of at most 2**-4).
"""

import pytest
import torch
from pagedserve.kernels import cpu, reference

from pagedserve.testing.kernels import contexts, fp8_paged_case, hide_blocks_outside_window, make_paged_case

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.05, 0.02  # randn values up to ~4.5: stored up to ~90 and ~225, below 448
# Max abs error of the attention output, FP8 cache against the fp32 cache it was made from. A one-token
# context returns its V row, whose rounding error reaches half an e4m3 step, |v| * 2**-5: 0.16 at the
# cases' largest |v| of about 5. Measured: at most 0.112 (decode 0.083).
QUANTIZATION_ATOL = 0.16


def test_store_writes_scaled_saturated_nearest_even_bytes():
    # Every finite e4m3 value, the midpoints between neighbours (ties: to even) and values past 448.
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].sort().values
    midpoints = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, midpoints, torch.tensor([449.0, -1e6, 1e30, 3e-5])])
    x = torch.cat([x, torch.zeros(-x.numel() % 8)]).view(-1, 1, 8)
    scale = torch.tensor([0.5])
    k_cache = torch.zeros(x.shape[0], 1, 1, 8, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(x.shape[0])
    reference.store_kv_cache(x * 0.5, x, k_cache, v_cache, slots, scale, torch.tensor([1.0]))
    stored = k_cache.view(-1).float()
    assert not stored.isnan().any(), "values past 448 must saturate, not become NaN"
    assert torch.equal(v_cache.view(-1).float(), stored)  # (x * 0.5) / 0.5 == x / 1
    expected = x.view(-1).clamp(-448, 448)
    assert torch.equal(stored[: grid.numel()], grid)
    # Ties to even: between two neighbours, the one whose last mantissa bit is 0.
    lower, upper = grid[:-1], grid[1:]
    even_is_lower = (lower.to(FP8).view(torch.uint8) & 1) == 0
    tie = stored[grid.numel(): grid.numel() + midpoints.numel()]
    assert torch.equal(tie, torch.where(even_is_lower, lower, upper))
    assert stored[grid.numel() + midpoints.numel()].item() == 448.0
    assert stored[grid.numel() + midpoints.numel() + 1].item() == -448.0
    assert stored[grid.numel() + midpoints.numel() + 2].item() == 448.0
    assert expected.numel() == stored.numel()


def test_store_skips_negative_slots_and_ignores_scales_of_other_caches():
    k = torch.randn(3, 2, 8)
    fp8_cache = torch.zeros(2, 4, 2, 8, dtype=FP8)
    slots = torch.tensor([5, -1, 0])
    two = torch.tensor([2.0])
    reference.store_kv_cache(k, k, fp8_cache, fp8_cache.clone(), slots, two, two)
    rows = fp8_cache.view(-1, 2, 8)
    assert torch.equal(rows[5].float(), (k[0] / 2).to(FP8).float())
    assert torch.equal(rows[0].float(), (k[2] / 2).to(FP8).float())
    assert rows[1:5].float().abs().sum() == 0
    fp32_cache = torch.zeros(2, 4, 2, 8)
    reference.store_kv_cache(k, k, fp32_cache, fp32_cache.clone(), slots, two, two)
    assert torch.equal(fp32_cache.view(-1, 2, 8)[5], k[0])


def fp8_and_dequantized(block_size: int, q_lens: list[int] | None = None):
    case = make_paged_case(contexts(block_size), 6, 2, 64, block_size, q_lens=q_lens)
    fp8, k_scale, v_scale = fp8_paged_case(case, K_SCALE, V_SCALE)
    dequantized = (fp8.k_cache.float() * K_SCALE, fp8.v_cache.float() * V_SCALE)
    return case, fp8, k_scale, v_scale, dequantized


@pytest.mark.parametrize(("sliding_window", "logit_softcap"), [(None, None), (20, None), (None, 2.5)])
def test_decode_reads_cache_times_scale(sliding_window, logit_softcap):
    case, fp8, k_scale, v_scale, (k_deq, v_deq) = fp8_and_dequantized(16)
    variant = dict(sliding_window=sliding_window, logit_softcap=logit_softcap)
    common = (case.block_tables, case.context_lens, 0.125)
    out = reference.paged_attention_decode(case.q_decode, fp8.k_cache, fp8.v_cache, *common, **variant,
                                           k_scale=k_scale, v_scale=v_scale)
    on_dequantized = reference.paged_attention_decode(case.q_decode, k_deq, v_deq, *common, **variant)
    torch.testing.assert_close(out, on_dequantized, atol=1e-5, rtol=1e-5)
    unquantized = reference.paged_attention_decode(
        case.q_decode, case.k_cache, case.v_cache, *common, **variant
    )
    assert (out - unquantized).abs().max().item() <= QUANTIZATION_ATOL


@pytest.mark.parametrize(("sliding_window", "logit_softcap"), [(None, None), (20, None), (None, 2.5)])
def test_prefill_reads_cache_times_scale(sliding_window, logit_softcap):
    q_lens = [1, 32, 7, 1, 7]
    case, fp8, k_scale, v_scale, (k_deq, v_deq) = fp8_and_dequantized(16, q_lens)
    variant = dict(sliding_window=sliding_window, logit_softcap=logit_softcap)
    common = (case.block_tables, case.cu_seqlens_q, case.context_lens, 0.125)
    out = reference.paged_attention_prefill(case.q_prefill, fp8.k_cache, fp8.v_cache, *common, **variant,
                                            k_scale=k_scale, v_scale=v_scale)
    on_dequantized = reference.paged_attention_prefill(case.q_prefill, k_deq, v_deq, *common, **variant)
    torch.testing.assert_close(out, on_dequantized, atol=1e-5, rtol=1e-5)
    unquantized = reference.paged_attention_prefill(case.q_prefill, case.k_cache, case.v_cache, *common,
                                                    **variant)
    assert (out - unquantized).abs().max().item() <= QUANTIZATION_ATOL


@pytest.fixture(scope="module")
def cpu_op():
    compiled = cpu.load_extension()
    assert compiled is not None, "the CPU kernels did not build (see the warning above)"  # a bug, not a skip
    return compiled


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (6, 2, 40), (3, 1, 20)],  # the embedded model; the vector tail; head_dim % 8 != 0: scalar
    ids=["smollm2", "d40", "d20"],
)
@pytest.mark.parametrize(("sliding_window", "logit_softcap"), [(None, None), (5, None), (37, 3.0)])
def test_cpu_kernel_reads_fp8_caches(
    cpu_op, num_heads, num_kv_heads, head_dim, sliding_window, logit_softcap
):
    """The C++ decode (kernels/csrc/paged_attention_cpu.cpp) widens FP8 rows itself: the reference's FP8
    path within float32 rounding, with scales, windows (unread blocks hold NaN) and soft-capping."""
    case = make_paged_case(contexts(16), num_heads, num_kv_heads, head_dim, 16)
    if sliding_window is not None:
        case = hide_blocks_outside_window(case, sliding_window)
    fp8, k_scale, v_scale = fp8_paged_case(case, K_SCALE, V_SCALE)
    args = (case.q_decode, fp8.k_cache, fp8.v_cache, case.block_tables, case.context_lens, head_dim**-0.5)
    variant = dict(
        sliding_window=sliding_window, logit_softcap=logit_softcap, k_scale=k_scale, v_scale=v_scale
    )
    expected = reference.paged_attention_decode(*args, **variant)
    torch.testing.assert_close(cpu.paged_attention_decode(*args, **variant), expected, atol=1e-5, rtol=1e-5)


def test_cpu_kernel_widens_every_fp8_value(cpu_op):
    """Every byte, through the vector path (head_dim 64) and the scalar one (head_dim 4): a one-token
    context returns its V row times v_scale exactly, NaN for e4m3fn's two NaN bytes (whose 16-byte groups
    the vector path hands to the table)."""
    for head_dim in (64, 4):
        values = torch.arange(256, dtype=torch.uint8).view(FP8)
        rows = torch.cat([values, values[: -values.numel() % head_dim]]).view(-1, 1, 1, head_dim)
        k_cache = torch.zeros(rows.shape[0], 1, 1, head_dim, dtype=FP8)
        tables = torch.arange(rows.shape[0], dtype=torch.int32)[:, None]
        out = cpu_op.paged_attention_decode(
            torch.randn(rows.shape[0], 1, head_dim), k_cache, rows, tables,
            torch.ones(rows.shape[0], dtype=torch.int32), 0.125, 0, 0.0, 1.0, 2.0,
        )
        expected = rows.view(-1).float() * 2.0
        assert expected.isnan().sum() >= 2
        torch.testing.assert_close(out.view(-1), expected, rtol=0, atol=0, equal_nan=True)
