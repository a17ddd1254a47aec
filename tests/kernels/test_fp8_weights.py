"""The FP8 (W8A8) matmul's reference (kernels/reference.py ``quantize_fp8_rows``, ``fp8_matmul``): the spec
the GPU's cuBLASLt path (tests/gpu/test_fp8_weights_gpu.py) and the engine's ``--quantization fp8`` follow."""

import torch
from pagedserve.kernels import cpu as cpu_kernels
from pagedserve.kernels import reference


def test_rows_quantize_to_their_max_over_448_nearest_even():
    x = (
        torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
        * torch.tensor([1e-3, 1, 7, 300, 0])[:, None]
    )
    q, scale = reference.quantize_fp8_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5,)
    assert torch.equal(scale[:4], x[:4].abs().amax(dim=1) / 448)
    assert float(q[:4].float().abs().amax(dim=1).min()) == 448.0  # each row's largest value is e4m3's largest
    assert not q[4].float().any() and torch.isfinite(scale).all()  # an all-zero row stays zero
    restored = q.float() * scale[:, None]
    # Nearest e4m3: within half a step, at most 2**-4 of the value, and never past a subnormal step.
    error = (restored - x).abs()
    assert (error <= torch.maximum(x.abs() * 2**-4, scale[:, None] * 2**-10) * 1.0001).all()
    assert torch.equal(q, (x / scale.clamp(min=1e-12)[:, None]).to(torch.float8_e4m3fn))


def test_fp8_matmul_is_the_product_of_the_quantized_rows():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=gen)
    # Inputs exact in bfloat16, the dtype of the call: only its output is rounded (half a step, 2**-9).
    x, bias = (torch.randn(*shape, generator=gen).to(torch.bfloat16).float() for shape in ((3, 64), (48,)))
    wq, ws = reference.quantize_fp8_rows(w)
    xq, xs = reference.quantize_fp8_rows(x)
    expected = (xq.float() * xs[:, None]) @ (wq.float() * ws[:, None]).T + bias
    out = reference.fp8_matmul(x.to(torch.bfloat16), wq, ws, bias.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (3, 48)
    torch.testing.assert_close(out.float(), expected, atol=1e-3, rtol=2**-8)
    # Against the unquantized product: both operands' rounding, a few percent of the output's scale.
    assert ((out.float() - (x @ w.T + bias)).abs().max() / (x @ w.T).abs().max()) < 0.05
    assert cpu_kernels.fp8_matmul is reference.fp8_matmul  # the CPU backend runs the reference
