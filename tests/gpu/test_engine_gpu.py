"""The engine on a GPU: Triton backend vs the torch reference backend vs HF Transformers, greedy, on
seeded random-weight Llama-family models; CUDA-graph decode vs eager. See pagedserve/testing/gpu.py for
how ties between nearly equal logits are allowed for."""

import pytest
import torch

from pagedserve.testing.gpu import GPU, assert_greedy, engine_greedy, free_gpu, hf_greedy, load_hf, prompts

pytestmark = GPU

MAX_TOKENS = 24
# Small KV budget (several engines share the GPU one after another) and small steps, so long prompts
# are prefilled in chunks that attend to earlier chunks through the cache.
ENGINE = {"kv_cache_memory_bytes": 2 << 30, "max_num_batched_tokens": 256, "seed": 0}


def _vocab(model_path: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path).vocab_size


@pytest.fixture
def oracle(random_model_path):
    model = load_hf(random_model_path, torch.float32)
    yield model
    del model
    free_gpu()


def test_fp32_triton_equals_torch_reference_and_hf(random_model_path, oracle, monkeypatch):
    """In fp32 the three agree token for token, but for exact ties (1e-3 std)."""
    ids = prompts(_vocab(random_model_path))
    runs = {"hf": hf_greedy(oracle, ids, MAX_TOKENS)}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", backend)
        runs[backend] = engine_greedy(random_model_path, ids, MAX_TOKENS, dtype="float32", **ENGINE)
    same = assert_greedy(oracle, ids, runs, torch.float32)
    print("share of sequences equal to HF's:", same)


def test_bf16_triton_and_torch_reference_and_hf_follow_the_oracle(random_model_path, oracle, monkeypatch):
    ids = prompts(_vocab(random_model_path), seed=1)
    hf_bf16 = load_hf(random_model_path, torch.bfloat16)
    runs = {"hf-bf16": hf_greedy(hf_bf16, ids, MAX_TOKENS)}
    del hf_bf16
    free_gpu()
    for backend in ("triton", "torch"):
        monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", backend)
        runs[backend] = engine_greedy(random_model_path, ids, MAX_TOKENS, dtype="bfloat16", **ENGINE)
    same = assert_greedy(oracle, ids, runs, torch.bfloat16)
    print("share of sequences equal to HF bf16's:", same)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graph_decode_equals_eager(random_model_path, oracle, monkeypatch, dtype):
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "triton")
    ids = prompts(_vocab(random_model_path), seed=2)
    name = str(dtype).removeprefix("torch.")
    runs = {
        "eager": engine_greedy(random_model_path, ids, MAX_TOKENS, dtype=name, enforce_eager=True, **ENGINE),
        "graphs": engine_greedy(random_model_path, ids, MAX_TOKENS, dtype=name, **ENGINE),
    }
    same = assert_greedy(oracle, ids, runs, dtype)
    print("share of sequences where graphs equal eager:", same)
    if dtype == torch.float32:
        assert same["graphs"] == 1.0


def test_prefix_cache_hits_reproduce_the_first_run(random_model_path, monkeypatch):
    """The same prompts again: every full block comes from the prefix cache; fp32 outputs are unchanged."""
    from pagedserve import LLM, SamplingParams

    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "triton")
    ids = prompts(_vocab(random_model_path), seed=3)
    llm = LLM(model=random_model_path, dtype="float32", **ENGINE)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        first = llm.generate([{"prompt_token_ids": p} for p in ids], params)
        second = llm.generate([{"prompt_token_ids": p} for p in ids], params)
    finally:
        del llm
        free_gpu()
    assert sum(o.num_cached_tokens for o in second) > 0
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_scheduling_leaves_outputs_unchanged(random_model_path, monkeypatch, dtype):
    """The GPU runs async scheduling by default (server/engine/core.py): the same tokens as without it,
    in graphs, with prompts chunked and of unequal lengths (so requests finish on different steps)."""
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "triton")
    ids = prompts(_vocab(random_model_path), seed=4)
    runs = [engine_greedy(random_model_path, ids, MAX_TOKENS, dtype=dtype, async_scheduling=mode, **ENGINE)
            for mode in (False, True)]
    assert runs[1] == runs[0]
