"""GGUF-block matmul on the CPU (kernels/csrc/gguf_cpu.cpp through kernels/cpu.py) against its torch
reference (kernels/reference.py ``gguf_matmul``), and the reference against the blocks' plain meaning.

Acceptance: the C++ kernel equals the reference within 1e-5 of the output's magnitude (both quantize the
activations to the same int8 blocks, bit for bit, and sum exact integer block products; only the float32
accumulation order differs); the reference is within activation-quantization error (2% of the output's
magnitude) of ``x @ dequantize(W).T``, and its dequantization is the ``gguf`` package's.
"""

import numpy as np
import pytest
import torch
from pagedserve.kernels import cpu, reference

from pagedserve.testing.kernels import GGUF_TYPES as TYPES
from pagedserve.testing.kernels import random_gguf_blocks as random_blocks

# The embedded model's projections (qkv 576->960, gate_up 576->3072, down 1536->576), a channel tail (not a
# multiple of the 4-channel tile), one block, and a K with an odd number of blocks.
SHAPES = [(960, 576), (3072, 576), (576, 1536), (37, 64), (5, 32), (66, 96)]
# Rows: one (decode), 2-5, up to ~70 (a batch of decodes), a prefill chunk.
ROWS = [1, 2, 3, 5, 17, 70, 129]

needs_kernels = pytest.mark.skipif(cpu.load_extension() is None, reason="no CPU kernels here")


@needs_kernels
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("qtype", TYPES.values(), ids=TYPES.keys())
def test_cpu_kernel_matches_reference(qtype, n, k, rows, bias):
    gen = torch.Generator().manual_seed(n * k + rows + qtype)
    qs, scales, mins = random_blocks(n, k, qtype, gen)
    x = torch.randn(rows, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    expected = reference.gguf_matmul(x, qs, scales, mins, qtype, b)
    actual = cpu.gguf_matmul(x, qs, scales, mins, qtype, b)
    assert actual.shape == (rows, n) and actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


@needs_kernels
def test_cpu_kernel_takes_leading_dims_and_zero_rows():
    gen = torch.Generator().manual_seed(4)
    qs, scales, mins = random_blocks(40, 64, reference.GGUF_Q4_1, gen)
    x = torch.randn(6, 64, generator=gen)
    x[2, :32] = 0.0  # an all-zero activation block: scale 0, no division by zero
    out = cpu.gguf_matmul(x.view(2, 3, 64), qs, scales, mins, reference.GGUF_Q4_1)
    expected = reference.gguf_matmul(x, qs, scales, mins, reference.GGUF_Q4_1).view(2, 3, 40)
    torch.testing.assert_close(out, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    assert bool(torch.isfinite(out).all())


@needs_kernels
def test_cpu_kernel_refuses_bad_shapes():
    gen = torch.Generator().manual_seed(5)
    qs, scales, _ = random_blocks(8, 64, reference.GGUF_Q8_0, gen)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu.load_extension().gguf_matmul(torch.randn(1, 63), qs, scales, None, reference.GGUF_Q8_0, None)
    with pytest.raises(RuntimeError, match="mins"):
        q4, s4, _ = random_blocks(8, 64, reference.GGUF_Q4_1, gen)
        cpu.load_extension().gguf_matmul(torch.randn(1, 64), q4, s4, None, reference.GGUF_Q4_1, None)
    with pytest.raises(RuntimeError, match="block type"):
        cpu.load_extension().gguf_matmul(torch.randn(1, 64), qs, scales, None, 12, None)


def test_reference_refuses_k_not_a_multiple_of_32():
    gen = torch.Generator().manual_seed(6)
    qs, scales, mins = random_blocks(8, 64, reference.GGUF_Q8_0, gen)
    with pytest.raises(ValueError, match="multiple of 32"):
        reference.gguf_matmul(torch.randn(1, 63), qs, scales, mins, reference.GGUF_Q8_0)


@pytest.mark.parametrize("qtype", TYPES.values(), ids=TYPES.keys())
def test_reference_is_the_dequantized_matmul_within_activation_rounding(qtype):
    gen = torch.Generator().manual_seed(7 + qtype)
    qs, scales, mins = random_blocks(48, 256, qtype, gen)
    x, b = torch.randn(3, 256, generator=gen), torch.randn(48, generator=gen)
    exact = x @ reference.dequantize_gguf(qs, scales, mins, qtype).T + b
    approx = reference.gguf_matmul(x, qs, scales, mins, qtype, b)
    error = (approx - exact).abs().max().item()
    assert 0 < error <= 2e-2 * exact.abs().max().item()


def test_activation_blocks_round_half_to_even_within_half_a_step():
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(8))
    q, d, sums = reference.quantize_activation_blocks(x)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert bool((sums == q.to(torch.int32).sum(-1)).all())
    error = (q.float() * d[..., None] - x.view(4, 3, 32)).abs()
    assert bool((error <= d[..., None] / 2 + 1e-7).all())


@pytest.mark.parametrize("name", TYPES.keys())
def test_dequantize_is_the_gguf_packages(name):
    gguf = pytest.importorskip("gguf")
    qtype = TYPES[name]
    gen = torch.Generator().manual_seed(9)
    qs, scales, mins = random_blocks(6, 128, qtype, gen)
    # the file's block bytes: d [, m], then the values
    parts = [scales.view(torch.uint8).view(6, 4, 2)]
    if mins is not None:
        parts.append(mins.view(torch.uint8).view(6, 4, 2))
    parts.append(qs.view(6, 4, -1))
    raw = torch.cat(parts, dim=-1).reshape(6, -1).numpy()
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).astype(np.float32)
    torch.testing.assert_close(reference.dequantize_gguf(qs, scales, mins, qtype), torch.from_numpy(expected))


@needs_kernels
@pytest.mark.parametrize(("n", "k"), [(3072, 576), (576, 1536), (37, 64)])
@pytest.mark.parametrize("qtype", TYPES.values(), ids=TYPES.keys())
def test_dense_copy_is_the_dequantized_blocks_in_bfloat16_bit_for_bit(qtype, n, k):
    gen = torch.Generator().manual_seed(n + k + qtype)
    qs, scales, mins = random_blocks(n, k, qtype, gen)
    scales[0, 0] = float("nan")  # a corrupt block stays NaN, as torch's rounding keeps it
    expected = reference.dequantize_gguf(qs, scales, mins, qtype).to(torch.bfloat16)
    actual = cpu.load_extension().gguf_dequantize_bf16(qs, scales, mins, qtype)
    assert actual.dtype == torch.bfloat16 and actual.shape == (n, k)
    assert bool(actual[0, :32].isnan().all())
    assert torch.equal(actual.view(torch.int16)[:, 32:], expected.view(torch.int16)[:, 32:])
    assert torch.equal(actual.view(torch.int16)[1:], expected.view(torch.int16)[1:])
    if cpu.dense_dtype() == torch.bfloat16:  # what a layer keeps on this CPU: the same, packed
        packed = cpu.gguf_dense_weight(qs, scales, mins, qtype)
        assert packed.is_mkldnn and torch.equal(packed.to_dense().view(torch.int16), actual.view(torch.int16))


# The rows around this CPU's threshold (its copies' dtype: kernels/cpu.py dense_dtype).
DENSE_ROWS = cpu.GGUF_DENSE_ROWS[cpu.dense_dtype()]


@needs_kernels
@pytest.mark.parametrize("rows", [DENSE_ROWS - 1, DENSE_ROWS, 129])
@pytest.mark.parametrize("qtype", TYPES.values(), ids=TYPES.keys())
def test_batched_rows_multiply_by_the_dense_copy(qtype, rows):
    """From GGUF_DENSE_ROWS[dtype] rows the product is x times the layer's dense copy. A bfloat16 copy (CPUs
    with a native bfloat16 dot product) takes x rounded to bfloat16, sums in float32 and rounds to bfloat16
    (within half a bfloat16 step, at most 2**-8 relative, of the float32 sum); a float32 copy (every other
    CPU) is the float32 product of the dequantized blocks. Below it the int8 kernel's, copy or not."""
    gen = torch.Generator().manual_seed(rows + qtype)
    qs, scales, mins = random_blocks(96, 576, qtype, gen)
    x, b = torch.randn(rows, 576, generator=gen), torch.randn(96, generator=gen)
    dense = cpu.gguf_dense_weight(qs, scales, mins, qtype)  # as layers keep it: packed for oneDNN
    assert dense is not None and dense.is_mkldnn and dense.dtype == cpu.dense_dtype()
    actual = cpu.gguf_matmul(x, qs, scales, mins, qtype, b, dense=dense)
    if rows < DENSE_ROWS:
        expected = reference.gguf_matmul(x, qs, scales, mins, qtype, b)
        torch.testing.assert_close(actual, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    elif dense.dtype == torch.bfloat16:
        product = x.to(torch.bfloat16).float() @ dense.to_dense().float().T
        torch.testing.assert_close(actual - b, product, atol=1e-5 * product.abs().max().item(), rtol=2**-8)
    else:
        expected = x @ reference.dequantize_gguf(qs, scales, mins, qtype).T + b
        torch.testing.assert_close(actual, expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5)


def test_the_dense_copy_is_bfloat16_only_with_a_native_bfloat16_dot_product(monkeypatch):
    features = cpu.cpu_features()
    without = type(features)(features.flags - {"avx512_bf16", "amx_bf16"}, "avx2")
    monkeypatch.setattr(cpu, "cpu_features", lambda: without)
    assert cpu.dense_dtype() == torch.float32
    monkeypatch.setattr(cpu, "cpu_features", lambda: type(features)(features.flags | {"avx512_bf16"}, None))
    assert cpu.dense_dtype() == torch.bfloat16
