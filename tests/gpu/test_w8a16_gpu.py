"""The Triton w8a16 matmul compiled for CUDA against its torch reference (fp32, fp16 and bf16: the
interpreter cannot check bf16), at the embedded model's and Llama-3-8B's projection shapes; and the
engine serving an int8 model on the GPU, agreeing with the same engine in the model dtype."""

import pytest
import torch
from pagedserve.kernels import reference
from pagedserve.server.layers.quantization.int8 import quantize_per_channel

from pagedserve.testing.gpu import GPU, PROJECTION_SHAPES, engine_greedy, prompts

pytestmark = GPU

# (atol, rtol) against the fp32 reference on the same inputs (bf16/fp16 outputs are rounded once).
TOLERANCE = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3), torch.float32: (1e-4, 1e-4)}
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in TOLERANCE]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize(("n", "k"), PROJECTION_SHAPES)
def test_w8a16_matmul_matches_reference(n, k, rows, dtype):
    from pagedserve.kernels.w8a16_matmul import w8a16_matmul

    gen = torch.Generator(device="cuda").manual_seed(n + k + rows)
    weight, scale = quantize_per_channel(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype)
    expected = reference.w8a16_matmul(x.float(), weight, scale, bias.float())
    actual = w8a16_matmul(x, weight, scale, bias)
    assert actual.dtype == dtype
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected, atol=atol * expected.abs().max().item(), rtol=rtol)


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize(("n", "k"), PROJECTION_SHAPES)
def test_fused_reduce_is_the_reduce_launch_bit_for_bit(n, k, rows):
    """The last split of each tile sums the partials (kernels/split_k.py's tickets): the separate reduce
    launch's bits, launch after launch (a ticket counted wrong, or a partial read before it is written,
    would show as a differing or stale tile), also replayed in a CUDA graph."""
    from pagedserve.kernels.w8a16_matmul import DecodeLaunch, w8a16_matmul_with

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    weight, scale = quantize_per_channel(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    two_launches = DecodeLaunch(block_n=32, block_k=256, programs_per_sm=8)
    fused = DecodeLaunch(block_n=32, block_k=256, programs_per_sm=8, fused_reduce=True)
    expected = w8a16_matmul_with(x, weight, scale, None, two_launches)
    for _ in range(20):
        assert torch.equal(w8a16_matmul_with(x, weight, scale, None, fused), expected)
    out = torch.empty_like(expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(w8a16_matmul_with(x, weight, scale, None, fused))
    for _ in range(20):
        out.zero_()
        graph.replay()
        assert torch.equal(out, expected)


def test_engine_int8_follows_bf16(random_model_path, monkeypatch):
    """Greedy int8 continuations mostly equal bf16's (quantization moves near-ties); the first token of
    most prompts agrees. A wrong kernel gives unrelated tokens from the first step."""
    from transformers import AutoConfig

    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "triton")
    ids = prompts(AutoConfig.from_pretrained(random_model_path).vocab_size, seed=3)
    engine = {"kv_cache_memory_bytes": 2 << 30, "dtype": "bfloat16"}
    plain = engine_greedy(random_model_path, ids, 8, **engine)
    int8 = engine_greedy(random_model_path, ids, 8, quantization="int8", **engine)
    first_equal = sum(a[0] == b[0] for a, b in zip(plain, int8, strict=True)) / len(ids)
    assert first_equal >= 0.75, (plain, int8)
