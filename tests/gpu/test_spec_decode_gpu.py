"""Speculative decoding on a GPU (Triton backend, CUDA-graph decode on): greedy output with n-gram and
draft-model speculation against the same engine without it, on seeded random-weight models.

The verification step runs several query tokens per sequence through the prefill attention path, where
plain decoding runs one through the decode path; in fp32 the two agree but for true ties, in bf16 they
may part at near-ties (pagedserve/testing/gpu.py explains the tolerance). So every run is judged token
by token against the fp32 Hugging Face oracle, and the share of sequences identical to the plain engine's
is printed.
Every run must see drafts proposed and accepted, or the verifying and accepting paths would go untested:
the n-gram proposer gets a model with small weights, whose greedy output repeats its own tokens (the
pagedserve/testing/gpu.py's models do not copy their context), and the draft model is the target itself.
"""

import pytest
import torch
from pagedserve.benchmarks.gpu import random_model

from pagedserve.testing.draft_models import truncated_draft
from pagedserve.testing.gpu import GPU, assert_greedy, free_gpu, load_hf, prompts

pytestmark = GPU

MAX_TOKENS = 24
ENGINE = {"kv_cache_memory_bytes": 2 << 30, "max_num_batched_tokens": 256, "seed": 0}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
         "disable_by_batch_size": 512}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def repetitive_prompts(vocab_size: int) -> list[list[int]]:
    """pagedserve/testing/gpu.py prompts() plus prompts that repeat a phrase, and each prompt's tail
    repeated at its end."""
    base = prompts(vocab_size, seed=5)
    phrases = [p[:12] for p in base if len(p) >= 12]
    return [p + p[-8:] for p in base] + [ph * 5 for ph in phrases[:3]]


def spec_greedy(model_path: str, ids: list[list[int]], spec: dict | None, dtype: str):
    """(greedy continuations, drafted tokens, accepted tokens) from a fresh engine, then freed."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(model=model_path, dtype=dtype, speculative_config=spec, **ENGINE)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        requests = [{"prompt_token_ids": p} for p in ids]
        outputs = [list(o.outputs[0].token_ids) for o in llm.generate(requests, params)]
        core = llm.engine.core
        assert not core.scheduler.has_unfinished() and core.kv.usage() == 0.0, "KV blocks left referenced"
        stats = core.stats().spec_decoding
        return outputs, (stats.num_draft_tokens if stats else 0), (stats.num_accepted_tokens if stats else 0)
    finally:
        del llm
        free_gpu()


def check_speculation(model_path: str, spec: dict, dtype: torch.dtype) -> None:
    from transformers import AutoConfig

    ids = repetitive_prompts(AutoConfig.from_pretrained(model_path).vocab_size)
    name = str(dtype).removeprefix("torch.")
    plain, _, _ = spec_greedy(model_path, ids, None, name)
    speculative, drafted, accepted = spec_greedy(model_path, ids, spec, name)
    print(f"{spec.get('method', 'draft')} {name}: drafted {drafted}, accepted {accepted}")
    assert accepted > 0, "no draft accepted: the verifying and accepting paths went untested"
    oracle = load_hf(model_path, torch.float32)
    try:
        same = assert_greedy(oracle, ids, {"plain": plain, "speculative": speculative}, dtype)
    finally:
        del oracle
        free_gpu()
    print("share of sequences where speculative equals plain:", same)
    if dtype == torch.float32:
        assert same["speculative"] >= 0.75


@pytest.fixture(scope="module")
def repeating_model() -> str:
    return str(random_model.cached_random_model("smollm2-135m", num_hidden_layers=8, initializer_range=0.02))


@DTYPES
def test_ngram_speculation_follows_the_oracle(repeating_model, monkeypatch, dtype):
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "triton")
    check_speculation(repeating_model, NGRAM, dtype)


@DTYPES
def test_draft_model_speculation_follows_the_oracle(random_model_path, monkeypatch, tmp_path, dtype):
    from transformers import AutoConfig

    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "triton")
    layers = AutoConfig.from_pretrained(random_model_path).num_hidden_layers
    draft = truncated_draft(random_model_path, tmp_path / "draft", layers)  # the target as its own drafter
    spec = {"model": str(draft), "num_speculative_tokens": 3, "disable_by_batch_size": 512}
    check_speculation(random_model_path, spec, dtype)
