"""Every Triton kernel against its torch reference, run by Triton's CPU interpreter.

Collected only in a process started with ``TRITON_INTERPRET=1`` (conftest.py); a normal test run gets
there through test_triton_interpreter.py.

Acceptance: max abs error <= 1e-3 in fp32 and <= 2e-2 in fp16. bf16 is covered on a GPU only
(tests/gpu): the interpreter computes bf16 ``tl.dot`` wrongly.
"""

import importlib

import pagedserve.kernels as triton_kernels
import pytest
import torch
from pagedserve.kernels import reference

from pagedserve.testing.kernels import contexts, hide_blocks_outside_window, make_paged_case

TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]
# Two KV heads checks the head indexing; one suffices at GQA 8 (the interpreter's tl.dot is slow).
KV_HEADS = {1: 2, 3: 2, 8: 1}
decode_module = importlib.import_module("pagedserve.kernels.paged_attention_decode")
prefill_module = importlib.import_module("pagedserve.kernels.paged_attention_prefill")


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    error = (actual.float() - expected.float()).abs().max().item() if actual.numel() else 0.0
    assert error <= TOLERANCE[expected.dtype], f"max abs error {error}"


ATTENTION_SHAPES = [
    pytest.param(group, head_dim, block_size, id=f"gqa{group}-d{head_dim}-bs{block_size}")
    for group in (1, 3, 8)
    for head_dim in (64, 128)
    for block_size in (16, 32)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "head_dim", "block_size"), ATTENTION_SHAPES)
def test_paged_attention_decode(group, head_dim, block_size, dtype):
    case = make_paged_case(
        contexts(block_size), KV_HEADS[group] * group, KV_HEADS[group], head_dim, block_size, dtype
    )
    args = (case.q_decode, case.k_cache, case.v_cache, case.block_tables, case.context_lens, head_dim**-0.5)
    expected = reference.paged_attention_decode(*args)
    assert_close(triton_kernels.paged_attention_decode(*args), expected)
    # Split-K: partitions that end mid-block, and contexts that leave some partitions empty.
    assert_close(decode_module._decode(*args, num_splits=4, partition=block_size + 8), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "head_dim", "block_size"), ATTENTION_SHAPES)
def test_paged_attention_prefill(group, head_dim, block_size, dtype, monkeypatch):
    # Small tiles: the interpreter's tl.dot costs in proportion to the tile, mostly padding here; they
    # also give several query tiles per chunk. The default tiles run in the next test.
    monkeypatch.setattr(prefill_module, "BLOCK_M", 32)
    monkeypatch.setattr(prefill_module, "BLOCK_N", 32)
    context_lens = contexts(block_size)
    # A whole one-token prompt, a whole aligned prompt, a chunk after a cached prefix (prefix hit or
    # earlier chunk), a single query at the end of a long context and a whole short prompt.
    q_lens = [1, 2 * block_size, 7, 1, 7]
    case = make_paged_case(
        context_lens, KV_HEADS[group] * group, KV_HEADS[group], head_dim, block_size, dtype, q_lens=q_lens
    )
    args = (
        case.q_prefill,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.cu_seqlens_q,
        case.context_lens,
        head_dim**-0.5,
    )
    assert_close(triton_kernels.paged_attention_prefill(*args), reference.paged_attention_prefill(*args))


def test_paged_attention_prefill_many_tiles_and_empty_chunks():
    """Default tiles; chunks longer than one query tile, beside sequences with no query this step."""
    context_lens = [150, 9, 70, 1]
    q_lens = [130, 0, 70, 0]
    case = make_paged_case(context_lens, 4, 2, 64, 16, q_lens=q_lens, seed=1)
    args = (
        case.q_prefill,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.cu_seqlens_q,
        case.context_lens,
        0.125,
    )
    assert_close(triton_kernels.paged_attention_prefill(*args), reference.paged_attention_prefill(*args))


# (sliding_window, logit_softcap): a window shorter than a block, one of several blocks, Gemma 2's
# soft-capping, both. Fewer shapes than above: the interpreter is slow and the variants only change
# which keys a query sees and how its scores are squashed.
VARIANTS = [
    pytest.param(5, None, id="window5"),
    pytest.param(40, None, id="window40"),
    pytest.param(None, 2.5, id="softcap"),
    pytest.param(37, 3.0, id="window-softcap"),
]
VARIANT_SHAPES = [pytest.param(1, 64, 16, id="gqa1-d64-bs16"), pytest.param(3, 128, 32, id="gqa3-d128-bs32")]


def variant_case(group, head_dim, block_size, dtype, sliding_window, q_lens=None):
    heads, kv_heads = KV_HEADS[group] * group, KV_HEADS[group]
    case = make_paged_case(contexts(block_size), heads, kv_heads, head_dim, block_size, dtype, q_lens=q_lens)
    # Blocks before every query's window hold NaN, as freed blocks point at the null block: unread.
    return case if sliding_window is None else hide_blocks_outside_window(case, sliding_window, q_lens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "head_dim", "block_size"), VARIANT_SHAPES)
@pytest.mark.parametrize(("sliding_window", "logit_softcap"), VARIANTS)
def test_paged_attention_decode_variants(group, head_dim, block_size, dtype, sliding_window, logit_softcap):
    case = variant_case(group, head_dim, block_size, dtype, sliding_window)
    args = (case.q_decode, case.k_cache, case.v_cache, case.block_tables, case.context_lens, head_dim**-0.5)
    variant = dict(sliding_window=sliding_window, logit_softcap=logit_softcap)
    expected = reference.paged_attention_decode(*args, **variant)
    assert_close(triton_kernels.paged_attention_decode(*args, **variant), expected)
    assert_close(decode_module._decode(*args, num_splits=4, partition=block_size + 8, **variant), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "head_dim", "block_size"), VARIANT_SHAPES)
@pytest.mark.parametrize(("sliding_window", "logit_softcap"), VARIANTS)
def test_paged_attention_prefill_variants(
    group, head_dim, block_size, dtype, sliding_window, logit_softcap, monkeypatch
):
    monkeypatch.setattr(prefill_module, "BLOCK_M", 32)
    monkeypatch.setattr(prefill_module, "BLOCK_N", 32)
    q_lens = [1, 2 * block_size, 7, 1, 7]
    case = variant_case(group, head_dim, block_size, dtype, sliding_window, q_lens)
    args = (case.q_prefill, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens_q,
            case.context_lens, head_dim**-0.5)
    variant = dict(sliding_window=sliding_window, logit_softcap=logit_softcap)
    assert_close(triton_kernels.paged_attention_prefill(*args, **variant),
                 reference.paged_attention_prefill(*args, **variant))


def test_paged_attention_decode_splits_only_the_window(monkeypatch):
    """A long context with a window: split-K partitions cover the window alone, not the context (so a
    long context costs its window), and the answer is the reference's."""
    window = 100
    case = hide_blocks_outside_window(make_paged_case([700, 1, 90], 4, 1, 64, 16, seed=2), window)
    args = (case.q_decode, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125)
    launches = []
    real_decode = decode_module._decode

    def recording_decode(*call):
        launches.append(call[6:8])  # (num_splits, partition)
        return real_decode(*call)

    monkeypatch.setattr(decode_module, "_decode", recording_decode)
    actual = triton_kernels.paged_attention_decode(*args, sliding_window=window)
    assert_close(actual, reference.paged_attention_decode(*args, sliding_window=window))
    (num_splits, partition), = launches
    assert (num_splits - 1) * partition < window  # no partition starts past the window's keys


def test_paged_attention_decode_long_context_splits():
    """The automatic split-K choice at a context long enough to split on the interpreter's nominal SMs."""
    case = make_paged_case([700, 1], 4, 1, 64, 16, seed=2)
    assert decode_module._partition(2, 1, case.block_tables.shape[1] * 16, case.q_decode.device)[0] > 1
    args = (case.q_decode, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125)
    assert_close(triton_kernels.paged_attention_decode(*args), reference.paged_attention_decode(*args))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (3, 128), (2, 80)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_cache(num_kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_tokens = 6, 11
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    # k and v as the model produces them: column slices of one fused qkv projection.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen).to(dtype)
    k = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # skipped tokens
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv_cache(k, v, expected_k, expected_v, slots)
    triton_kernels.store_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576])
def test_rms_norm(hidden, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    assert_close(triton_kernels.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576])
def test_fused_add_rms_norm(hidden, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, hidden, generator=gen).to(dtype)
    residual = torch.randn(7, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    normed, summed = triton_kernels.fused_add_rms_norm(x, residual, weight, 1e-6)
    expected_normed, expected_summed = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert_close(normed, expected_normed)
    assert_close(summed, expected_summed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 128), (4, 4, 64)])
def test_apply_rotary(num_heads, num_kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(0)
    num_tokens, max_position = 6, 40
    # q and k as column slices of one fused qkv projection, like the model passes them.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)
    positions = torch.tensor([0, 39, 5, 5, 17, 1])
    actual_q, actual_k = triton_kernels.apply_rotary(q, k, positions, cos_sin_cache)
    expected_q, expected_k = reference.apply_rotary(q, k, positions, cos_sin_cache)
    assert_close(actual_q, expected_q)
    assert_close(actual_k, expected_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2 * 96), (2, 3, 2 * 1536)])
def test_silu_and_mul(shape, dtype):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert_close(triton_kernels.silu_and_mul(x), reference.silu_and_mul(x))


def test_every_kernel_has_a_reference_with_the_same_signature():
    import inspect

    for name in triton_kernels.KERNELS:
        kernel, ref = getattr(triton_kernels, name), getattr(reference, name)
        assert list(inspect.signature(kernel).parameters) == list(inspect.signature(ref).parameters), name


@pytest.mark.parametrize("sliding_window", [None, 8], ids=["llama", "mistral-window8"])
def test_engine_greedy_with_triton_kernels_equals_the_torch_reference(tmp_path, monkeypatch, sliding_window):
    """The whole engine on a tiny random Llama, every kernel interpreted: chunked prefill, a shared
    prefix, decode. Greedy output in fp32 equals the reference backend's. With a window shorter than
    the prompts (the same weights as a Mistral), the KV cache frees blocks behind it too."""
    import json

    from pagedserve.benchmarks.gpu import random_model

    from pagedserve import LLM, SamplingParams

    tiny = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=512,
                initializer_range=0.1)  # large enough that the continuation depends on the context
    path = random_model.save_random_model(tmp_path / "tiny", "smollm2-135m", device="cpu", **tiny)
    if sliding_window is not None:
        config = json.loads((path / "config.json").read_text())
        config.update(architectures=["MistralForCausalLM"], model_type="mistral",
                      sliding_window=sliding_window)
        (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(10, 512, (40,), generator=gen).tolist()
    prompts = [[7], [*shared, 11, 12], shared + torch.randint(10, 512, (30,), generator=gen).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outputs = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", backend)
        llm = LLM(model=str(path), dtype="float32", device="cpu", block_size=16, max_num_batched_tokens=32,
                  kv_cache_memory_bytes=1 << 24)
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params)]
        assert llm.engine.core.kv.sliding_window == sliding_window
    assert outputs["triton"] == outputs["torch"], outputs
    assert len({t for seq in outputs["torch"] for t in seq}) > 3  # not one token repeated
