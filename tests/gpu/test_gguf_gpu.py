"""The Triton GGUF-block matmul (kernels/gguf_matmul.py) compiled for CUDA, at the embedded model's and
Llama-3-8B's projection shapes, for each block type and activation dtype (the interpreter run,
tests/kernels/test_gguf_triton.py, covers small shapes in fp32 and fp16 only; bf16 needs a GPU).

Compared with ``x @ reference.dequantize_gguf(W).T + bias`` in float32: the kernel dequantizes in
registers and keeps the activations in their dtype, so its error is the output's one rounding plus the
tf32 products (bf16/fp16 inputs) summed over K.
"""

import pytest
import torch
from pagedserve.kernels import reference

from pagedserve.testing.gpu import GPU, PROJECTION_SHAPES
from pagedserve.testing.kernels import GGUF_TYPES, random_gguf_blocks

pytestmark = GPU

# Max abs error over the output's max magnitude.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 2e-2}
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in TOLERANCE]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize(("n", "k"), PROJECTION_SHAPES)
@pytest.mark.parametrize("qtype", GGUF_TYPES.values(), ids=GGUF_TYPES.keys())
def test_gguf_matmul_matches_dequantized_reference(qtype, n, k, rows, dtype):
    from pagedserve.kernels.gguf_matmul import gguf_matmul

    gen = torch.Generator().manual_seed(n + k + rows + qtype)
    qs, scales, mins = (t.cuda() if t is not None else None for t in random_gguf_blocks(n, k, qtype, gen))
    x = torch.randn(rows, k, generator=gen).to("cuda", dtype)
    bias = torch.randn(n, generator=gen).to("cuda", dtype)
    expected = x.float() @ reference.dequantize_gguf(qs, scales, mins, qtype).T + bias.float()
    actual = gguf_matmul(x, qs, scales, mins, qtype, bias)
    assert actual.shape == (rows, n) and actual.dtype == dtype
    error = (actual.float() - expected).abs().max().item()
    assert error <= TOLERANCE[dtype] * max(1.0, expected.abs().max().item()), f"max abs error {error}"
