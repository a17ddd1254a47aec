"""INT8 weight-only matmul on the CPU (kernels/csrc/w8a16_cpu.cpp through kernels/cpu.py) against its torch
reference, and the per-channel quantizer's error bound.

Acceptance: the C++ kernel is the reference within 1e-4 relative to the output's magnitude (both
accumulate in fp32, in a different order); quantized weights are within half a step of the fp ones.
"""

import pytest
import torch
from pagedserve.kernels import cpu, reference
from pagedserve.server.layers.quantization.int8 import quantize_per_channel

# The embedded model's projections (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576), and odd
# sizes that leave a K tail (not a multiple of 8) and a channel tail (not a multiple of 4).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (7, 13), (5, 41)]
# Rows: one (decode), tile tails (2, 3, 4, 5), the native limit and one past it (dequantized GEMM).
ROWS = [1, 2, 3, 4, 5, cpu.W8A16_MAX_NATIVE_ROWS, cpu.W8A16_MAX_NATIVE_ROWS + 1, 40]


def random_case(m: int, n: int, k: int, seed: int, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    weight, scale = quantize_per_channel(torch.randn(n, k, generator=gen) * 0.05)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    return x, weight, scale, b


@pytest.mark.skipif(cpu.load_extension() is None, reason="the CPU kernels cannot be built here")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_cpu_kernel_matches_reference(n, k, rows, bias):
    x, weight, scale, b = random_case(rows, n, k, seed=n * k + rows, bias=bias)
    expected = reference.w8a16_matmul(x, weight, scale, b)
    actual = cpu.w8a16_matmul(x, weight, scale, b)
    assert actual.shape == (rows, n) and actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=1e-4 * expected.abs().max().item(), rtol=0)


def test_cpu_kernel_takes_leading_dims():
    x, weight, scale, b = random_case(6, 64, 32, seed=1, bias=True)
    out = cpu.w8a16_matmul(x.view(2, 3, 32), weight, scale, b)
    torch.testing.assert_close(out, reference.w8a16_matmul(x, weight, scale, b).view(2, 3, 64))


def test_reference_is_the_dequantized_matmul():
    x, weight, scale, b = random_case(3, 24, 40, seed=2, bias=True)
    dequantized = weight.float() * scale[:, None]
    torch.testing.assert_close(reference.w8a16_matmul(x, weight, scale, b), x @ dequantized.T + b)


def test_quantize_per_channel_error_within_half_a_step():
    w = torch.randn(64, 100, generator=torch.Generator().manual_seed(3))
    w[5] = 0.0  # an all-zero channel stays zero, with a finite scale
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (64,)
    assert int(q.abs().max()) == 127 and bool((q[5] == 0).all()) and bool(torch.isfinite(scale).all())
    error = (q.float() * scale[:, None] - w).abs()
    assert bool((error <= scale[:, None] / 2 + 1e-7).all())
