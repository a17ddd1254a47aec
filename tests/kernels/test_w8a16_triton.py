"""The Triton w8a16 matmul (kernels/w8a16_matmul.py) against its torch reference, in Triton's CPU
interpreter (test_triton_interpreter.py runs this file in a child with ``TRITON_INTERPRET=1``; in any
other process it is skipped here: tests/gpu/test_w8a16_gpu.py covers real CUDA).

Acceptance: max abs error <= 1e-3 of the output's magnitude in fp32, 2e-2 in fp16 (bf16 only on a GPU:
the interpreter computes bf16 ``tl.dot`` wrongly). Shapes are small: the interpreter is slow.
"""

import importlib

import pytest

pytest.importorskip("triton")

import torch
from pagedserve.kernels import reference
from pagedserve.kernels._triton_utils import interpreter_active
from pagedserve.server.layers.quantization.int8 import quantize_per_channel

pytestmark = pytest.mark.skipif(not interpreter_active(), reason="run by test_triton_interpreter.py")

TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
# rows: one, a partial tile, more than one BLOCK_M tile; n, k: tails of BLOCK_N / BLOCK_K and whole tiles.
# Up to split_k.ROWS rows take the split-K launch: (3, 40, 600) and (16, 40, 600) split K three ways, the
# last split a partial step.
@pytest.mark.parametrize(("m", "n", "k"),
                         [(1, 70, 96), (5, 64, 64), (70, 30, 130), (3, 40, 600), (16, 40, 600)])
def test_w8a16_matmul_matches_reference(m, n, k, bias, dtype):
    w8a16 = importlib.import_module("pagedserve.kernels.w8a16_matmul")  # the package exports the function
    w8a16_matmul = w8a16.w8a16_matmul
    split_k = importlib.import_module("pagedserve.kernels.split_k")

    gen = torch.Generator().manual_seed(m * n + k)
    weight, scale = quantize_per_channel(torch.randn(n, k, generator=gen) * 0.05)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    expected = reference.w8a16_matmul(x.float(), weight, scale, None if b is None else b.float())
    if m <= split_k.ROWS and k == 600:
        launch = w8a16.DecodeLaunch()
        assert split_k.plan(n, k, launch.block_n, launch.block_k, x.device)[0] == 3
    actual = w8a16_matmul(x, weight, scale, b)
    assert actual.shape == (m, n) and actual.dtype == dtype
    error = (actual.float() - expected).abs().max().item()
    assert error <= TOLERANCE[dtype] * max(1.0, expected.abs().max().item()), f"max abs error {error}"


@pytest.mark.parametrize(("m", "n", "k"), [(1, 70, 600), (16, 40, 600)])
def test_fused_reduce_equals_the_reduce_launch(m, n, k):
    """The last split of each tile sums the partials itself: the same bits as the separate reduce
    launch (same split order), and the ticket counters are back at zero for the next launch."""
    w8a16 = importlib.import_module("pagedserve.kernels.w8a16_matmul")
    split_k = importlib.import_module("pagedserve.kernels.split_k")
    gen = torch.Generator().manual_seed(k)
    weight, scale = quantize_per_channel(torch.randn(n, k, generator=gen) * 0.05)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    two_launches = w8a16.DecodeLaunch(block_n=16, block_k=64)
    fused = w8a16.DecodeLaunch(block_n=16, block_k=64, fused_reduce=True)
    assert split_k.plan(n, k, 16, 64, x.device)[0] > 1
    expected = w8a16.w8a16_matmul_with(x, weight, scale, bias, two_launches)
    for _ in range(2):  # the second launch finds the counters reset
        assert torch.equal(w8a16.w8a16_matmul_with(x, weight, scale, bias, fused), expected)
        assert not split_k.tickets(x.device, 1).any()
    wanted = reference.w8a16_matmul(x, weight, scale, bias)
    assert (expected - wanted).abs().max().item() <= TOLERANCE[torch.float32] * wanted.abs().max().item()


def test_tuned_launches_are_launches():
    """Every entry of kernels/configs/w8a16_decode.json (benchmarks/gpu/tune_w8a16.py's output) is a
    launch the kernel takes: an ``NxK`` shape, tiles tl.dot accepts, a positive programs-per-SM."""
    import json

    w8a16 = importlib.import_module("pagedserve.kernels.w8a16_matmul")
    table = json.loads(w8a16.TUNED_LAUNCHES.read_text())
    assert table
    for device, shapes in table.items():
        for shape, entry in shapes.items():
            n, k = (int(d) for d in shape.split("x"))
            launch = w8a16._tuned(device)[shape]
            assert launch == w8a16.DecodeLaunch(**entry) and n > 0 and k > 0
            assert launch.block_n >= 16 and launch.block_n & (launch.block_n - 1) == 0
            assert launch.block_k >= 16 and launch.block_k & (launch.block_k - 1) == 0
            assert launch.programs_per_sm >= 1 and launch.num_warps in (1, 2, 4, 8, 16)
