"""Triton kernels compiled for the GPU, at real shapes, against the torch references.

bf16 is checked here (the CPU interpreter computes bf16 ``tl.dot`` wrongly), against the reference run
in fp32 on the same bf16 inputs; fp32 (``ieee`` dots) and fp16 too. Also: the decode kernel captured in
a CUDA graph and replayed on new contexts, as the model runner's decode graphs
(server/worker/cuda_graphs.py) are.
"""

import importlib

import pagedserve.kernels as triton_kernels
import pytest
import torch
from pagedserve.kernels import reference
from transformers import LlamaConfig

from pagedserve.testing.gpu import GPU
from pagedserve.testing.kernels import hide_blocks_outside_window, make_paged_case

pytestmark = GPU

# (atol, rtol) against the fp32 reference on the same inputs.
TOLERANCE = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3), torch.float32: (1e-4, 1e-4)}
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in TOLERANCE]
# (num_heads, num_kv_heads, head_dim): Llama-3-8B, the embedded SmolLM2-135M, Llama-2-7B (no GQA).
HEADS = [pytest.param(32, 8, 128, id="llama3-8b"), pytest.param(9, 3, 64, id="smollm2"),
         pytest.param(32, 32, 128, id="mha")]
CUDA = torch.device("cuda")


def fp32(*tensors):
    return [t.float() if torch.is_tensor(t) and t.is_floating_point() else t for t in tensors]


def assert_close(actual, expected, dtype):
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def ragged_contexts(n: int, block_size: int, longest: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, longest + 1, (n,), generator=gen).tolist()
    lens[:3] = [1, 4 * block_size, longest]  # one token, block-aligned, the longest
    return lens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEADS)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("batch", "longest"), [(64, 2048), (3, 8000)], ids=["batch64", "batch3-long"])
def test_paged_attention_decode(batch, longest, block_size, num_heads, num_kv_heads, head_dim, dtype):
    case = make_paged_case(ragged_contexts(batch, block_size, longest, seed=batch), num_heads, num_kv_heads,
                           head_dim, block_size, dtype, CUDA)
    args = (case.q_decode, case.k_cache, case.v_cache, case.block_tables, case.context_lens, head_dim**-0.5)
    expected = reference.paged_attention_decode(*fp32(*args))
    assert_close(triton_kernels.paged_attention_decode(*args), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEADS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_prefill(block_size, num_heads, num_kv_heads, head_dim, dtype):
    # Whole prompts (one token, aligned, long), chunks after cached prefixes, single queries at the end.
    context_lens = [1, 4 * block_size, 1500, 700, 2048, 300, 97]
    q_lens = [1, 4 * block_size, 1500, 200, 512, 1, 5]
    case = make_paged_case(context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, CUDA,
                           q_lens=q_lens)
    args = (case.q_prefill, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens_q,
            case.context_lens, head_dim**-0.5)
    expected = reference.paged_attention_prefill(*fp32(*args))
    assert_close(triton_kernels.paged_attention_prefill(*args), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("sliding_window", "logit_softcap"),
                         [(1000, None), (None, 50.0), (4096, 30.0)], ids=["window", "softcap", "both"])
def test_attention_variants(sliding_window, logit_softcap, dtype):
    """Mistral's sliding window and Gemma 2's soft-cap at Llama-3-8B's heads, long contexts; blocks no
    query sees hold NaN (freed blocks point at the null block), so reading one would show."""
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    context_lens = [1, 4 * block_size, 1500, 700, 8000, 300, 97]
    q_lens = [1, 4 * block_size, 1500, 200, 512, 1, 5]
    case = make_paged_case(context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, CUDA,
                           q_lens=q_lens)
    variant = dict(sliding_window=sliding_window, logit_softcap=logit_softcap)
    for queries, lens in ((case.q_decode, None), (case.q_prefill, q_lens)):
        hidden = case if sliding_window is None else hide_blocks_outside_window(case, sliding_window, lens)
        if lens is None:
            args = (queries, hidden.k_cache, hidden.v_cache, hidden.block_tables, hidden.context_lens,
                    head_dim**-0.5)
            kernel, ref = triton_kernels.paged_attention_decode, reference.paged_attention_decode
        else:
            args = (queries, hidden.k_cache, hidden.v_cache, hidden.block_tables, hidden.cu_seqlens_q,
                    hidden.context_lens, head_dim**-0.5)
            kernel, ref = triton_kernels.paged_attention_prefill, reference.paged_attention_prefill
        assert_close(kernel(*args, **variant), ref(*fp32(*args), **variant), dtype)


def test_attention_on_strided_q_views():
    """q as the model passes it: a column slice of the fused qkv projection, rows not contiguous."""
    num_heads, num_kv_heads, head_dim = 32, 8, 128
    case = make_paged_case([1, 200, 77], num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, CUDA,
                           q_lens=[1, 50, 77])
    for q in (case.q_decode, case.q_prefill):
        qkv = torch.randn(q.shape[0], (num_heads + 2 * num_kv_heads) * head_dim, device=CUDA,
                          dtype=torch.bfloat16)
        qkv[:, : num_heads * head_dim] = q.reshape(q.shape[0], -1)
        strided = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
        assert not strided.is_contiguous()
        if q is case.q_decode:
            args = (case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.1)
            torch.testing.assert_close(triton_kernels.paged_attention_decode(strided, *args),
                                       triton_kernels.paged_attention_decode(q, *args))
        else:
            args = (case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens_q, case.context_lens, 0.1)
            torch.testing.assert_close(triton_kernels.paged_attention_prefill(strided, *args),
                                       triton_kernels.paged_attention_prefill(q, *args))


def test_decode_in_a_cuda_graph_follows_new_contexts():
    """Captured once, replayed with other contexts, queries and block tables, no re-capture."""
    num_heads, num_kv_heads, head_dim, block_size, batch = 32, 8, 128, 16, 8
    width = 4096 // block_size  # the graph's fixed block-table width (max_model_len 4096)
    q = torch.randn(batch, num_heads, head_dim, device=CUDA, dtype=torch.bfloat16)
    tables = torch.zeros(batch, width, dtype=torch.int32, device=CUDA)
    lens = torch.full((batch,), 100, dtype=torch.int32, device=CUDA)
    k_cache = torch.randn(width * batch + 8, block_size, num_kv_heads, head_dim, device=CUDA,
                          dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)

    def run():
        return triton_kernels.paged_attention_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    gen = torch.Generator().manual_seed(1)
    replays = ([1] * batch, [4096, 1, 17, 2048, 33, 4000, 16, 1000], [64 * (i + 1) for i in range(batch)])
    for contexts in replays:
        lens.copy_(torch.tensor(contexts, dtype=torch.int32))
        perm = torch.randperm(k_cache.shape[0], generator=gen)[: batch * width]
        tables.copy_(perm.view(batch, width).to(torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        graph.replay()
        expected = reference.paged_attention_decode(*fp32(q, k_cache, v_cache, tables, lens, head_dim**-0.5))
        assert_close(out, expected, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(8, 128), (3, 64)])
def test_store_kv_cache(num_kv_heads, head_dim, dtype):
    num_blocks, block_size, num_tokens = 512, 16, 3000
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=CUDA, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=CUDA, dtype=dtype)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * block_size, device=CUDA)[:num_tokens]
    slots[::7] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv_cache(k, v, expected_k, expected_v, slots)
    triton_kernels.store_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 4096, 8192])
def test_norms(hidden, dtype):
    x = torch.randn(300, hidden, device=CUDA, dtype=dtype)
    residual = torch.randn_like(x)
    weight = 1 + 0.1 * torch.randn(hidden, device=CUDA, dtype=dtype)
    # Same dtype as the kernel: both round the normalised value to the activation dtype before the weight.
    assert_close(triton_kernels.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), dtype)
    for actual, expected in zip(triton_kernels.fused_add_rms_norm(x, residual, weight, 1e-5),
                                reference.fused_add_rms_norm(x, residual, weight, 1e-5), strict=True):
        assert_close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEADS)
def test_apply_rotary(num_heads, num_kv_heads, head_dim, dtype):
    num_tokens = 1000
    rotary = importlib.import_module("pagedserve.server.layers.rotary")
    config = LlamaConfig(hidden_size=num_heads * head_dim, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, max_position_embeddings=8192,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    cache = rotary.build_cos_sin_cache(config, head_dim, 8192).to(CUDA)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=CUDA, dtype=dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads,
                                                                                   head_dim)
    positions = torch.randint(0, 8192, (num_tokens,), device=CUDA)
    for actual, expected in zip(triton_kernels.apply_rotary(q, k, positions, cache),
                                reference.apply_rotary(q, k, positions, cache), strict=True):
        assert_close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [1536, 14336])
def test_silu_and_mul(intermediate, dtype):
    x = torch.randn(300, 2 * intermediate, device=CUDA, dtype=dtype)
    assert_close(triton_kernels.silu_and_mul(x), reference.silu_and_mul(x), dtype)
