"""The CPU backend's C++ kernels against the torch references."""

import pytest
import torch
from pagedserve.kernels import cpu, reference

from pagedserve.testing.kernels import contexts, hide_blocks_outside_window, make_paged_case

# (sliding_window, logit_softcap): today's full attention, Mistral's window (shorter than a block, and
# several blocks long), Gemma 2's soft-capping, both.
VARIANTS = [
    pytest.param(None, None, id="full"),
    pytest.param(5, None, id="window5"),
    pytest.param(70, None, id="window70"),
    pytest.param(None, 2.5, id="softcap"),
    pytest.param(37, 3.0, id="window-softcap"),
]


@pytest.fixture(scope="module")
def op():
    compiled = cpu.load_extension()
    # CI and development machines have g++ and ninja: a build failure here is a bug, not a skip.
    assert compiled is not None, "the CPU kernels did not build (see the warning above)"
    return compiled


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [
        (4, 4, 64),  # no GQA
        (9, 3, 64),  # the embedded model
        (16, 2, 128),  # GQA 8, Llama-3 head_dim
        (6, 2, 40),  # head_dim under 64: values eight dims at a time
        (4, 2, 96),  # Phi-3's head_dim: values 64 dims, then eight at a time
        (3, 1, 20),  # head_dim not a multiple of 8: scalar scores, and a scalar tail of values
    ],
)
@pytest.mark.parametrize(("sliding_window", "logit_softcap"), VARIANTS)
def test_matches_reference(op, num_heads, num_kv_heads, head_dim, block_size, sliding_window, logit_softcap):
    case = make_paged_case(
        contexts(block_size, long_blocks=9), num_heads, num_kv_heads, head_dim, block_size, seed=3
    )
    if sliding_window is not None:  # blocks before the window hold NaN: reading one would show
        case = hide_blocks_outside_window(case, sliding_window)
    args = (case.q_decode, case.k_cache, case.v_cache, case.block_tables, case.context_lens, head_dim**-0.5)
    variant = dict(sliding_window=sliding_window, logit_softcap=logit_softcap)
    actual = cpu.paged_attention_decode(*args, **variant)
    expected = reference.paged_attention_decode(*args, **variant)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert (actual - expected).abs().max().item() <= 1e-5


def test_large_scores_stay_finite(op):
    """Scores in the hundreds: the softmax must subtract the max before exponentiating."""
    case = make_paged_case([300, 17], 9, 3, 64, 16, seed=4)
    args = (case.q_decode * 40, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 1.0)
    actual = cpu.paged_attention_decode(*args)
    assert torch.isfinite(actual).all()
    assert (actual - reference.paged_attention_decode(*args)).abs().max().item() <= 1e-4


def test_bad_block_table_is_refused(op):
    """An error, not a read outside the cache."""
    case = make_paged_case([40, 17], 9, 3, 64, 16, seed=6)
    args = [case.q_decode, case.k_cache, case.v_cache, case.block_tables.clone(), case.context_lens, 0.125]
    args[3][1, 0] = case.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu.paged_attention_decode(*args)
    too_long = 16 * case.block_tables.shape[1] + 1
    args[3], args[4] = case.block_tables, torch.tensor([40, too_long], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        cpu.paged_attention_decode(*args)


def test_other_dtypes_use_the_reference(op):
    case = make_paged_case(contexts(16, long_blocks=9), 9, 3, 64, 16, dtype=torch.bfloat16, seed=5)
    args = (case.q_decode, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125)
    assert torch.equal(cpu.paged_attention_decode(*args), reference.paged_attention_decode(*args))


def test_kernels_run_on_torchs_threads(op):
    """The kernels split work with at::parallel_for, which needs the build's -fopenmp (kernels/cpu.py):
    without it every kernel ran on one thread, whatever torch.set_num_threads said, and nothing failed."""
    threads = torch.get_num_threads()
    try:
        for wanted in (2, 1):
            torch.set_num_threads(wanted)
            assert op.parallel_workers() == wanted
    finally:
        torch.set_num_threads(threads)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-5) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert (actual - expected).abs().max().item() <= tolerance


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("width", [576, 100])  # a multiple of 8 and not: vector and scalar tails
def test_norms_match_reference(op, rows, width):
    gen = torch.Generator().manual_seed(rows + width)
    x, residual = torch.randn(rows, width, generator=gen) * 3, torch.randn(rows, width, generator=gen)
    weight = torch.randn(width, generator=gen)
    assert_close(cpu.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    for actual, expected in zip(
        cpu.fused_add_rms_norm(x, residual, weight, 1e-6),
        reference.fused_add_rms_norm(x, residual, weight, 1e-6),
        strict=True,
    ):
        assert_close(actual, expected)


@pytest.mark.parametrize("shape", [(1, 3072), (64, 3072), (5, 2, 18)])
def test_silu_and_mul_matches_reference(op, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 6  # reaches exp's clamps
    x[0, ..., 0] = 100.0
    x[0, ..., 1] = -100.0
    assert_close(cpu.silu_and_mul(x), reference.silu_and_mul(x), 1e-4)


@pytest.mark.parametrize("shape", [(64, 3072), (3, 2, 22)])  # vector and scalar tails
def test_silu_and_mul_in_bfloat16_rounds_as_the_reference(op, shape):
    """bfloat16 in and out, each step rounded as torch's bfloat16 ops round it (F.silu's result, then the
    product): the same bits as the reference but where the kernel's exp and torch's, a few ulp of float32
    apart, straddle a rounding boundary of bfloat16 (then one bfloat16 step apart)."""
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * 6).to(torch.bfloat16)
    actual, expected = cpu.silu_and_mul(x), reference.silu_and_mul(x)
    assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape
    step = expected.float().abs() * 2**-7 + 1e-30  # one bfloat16 step (8 significant bits) at most
    assert ((actual.float() - expected.float()).abs() <= step).all()
    assert (actual == expected).float().mean() > 0.99


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (2, 1, 10)])
def test_apply_rotary_matches_reference(op, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(11, (heads + 2 * kv_heads) * head_dim, generator=gen)
    # Views into a fused projection, as the model passes them: not contiguous.
    q = qkv[:, : heads * head_dim].view(11, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(11, kv_heads, head_dim)
    positions = torch.randint(0, 500, (11,), generator=gen)
    cache = torch.randn(512, head_dim, generator=gen)
    for actual, expected in zip(
        cpu.apply_rotary(q, k, positions, cache), reference.apply_rotary(q, k, positions, cache), strict=True
    ):
        assert_close(actual, expected)
    with pytest.raises(RuntimeError, match="position out of range"):
        cpu.apply_rotary(q, k, torch.full((11,), 512), cache)

