"""The Triton GGUF-block matmul (kernels/gguf_matmul.py) in Triton's CPU interpreter
(test_triton_interpreter.py runs this file in a child with ``TRITON_INTERPRET=1``; in any other process it
is skipped). It dequantizes blocks in registers and multiplies float activations, so it is compared with
``x @ reference.dequantize_gguf(W).T + bias``; the reference's int8 activation blocks are the CPU kernel's.

Acceptance: max abs error <= 1e-3 of the output's magnitude in fp32, 2e-2 in fp16.
"""

import pytest

pytest.importorskip("triton")

import torch
from pagedserve.kernels import reference
from pagedserve.kernels._triton_utils import interpreter_active

from pagedserve.testing.kernels import GGUF_TYPES as TYPES
from pagedserve.testing.kernels import random_gguf_blocks as random_blocks

pytestmark = pytest.mark.skipif(not interpreter_active(), reason="run by test_triton_interpreter.py")

TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 70, 96), (5, 64, 64), (20, 30, 128)])
@pytest.mark.parametrize("qtype", TYPES.values(), ids=TYPES.keys())
def test_gguf_matmul_matches_dequantized_reference(qtype, m, n, k, bias, dtype):
    from pagedserve.kernels.gguf_matmul import gguf_matmul

    gen = torch.Generator().manual_seed(m * n + k + qtype)
    qs, scales, mins = random_blocks(n, k, qtype, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    expected = x.float() @ reference.dequantize_gguf(qs, scales, mins, qtype).T
    if b is not None:
        expected += b.float()
    actual = gguf_matmul(x, qs, scales, mins, qtype, b)
    assert actual.shape == (m, n) and actual.dtype == dtype
    error = (actual.float() - expected).abs().max().item()
    assert error <= TOLERANCE[dtype] * max(1.0, expected.abs().max().item()), f"max abs error {error}"
