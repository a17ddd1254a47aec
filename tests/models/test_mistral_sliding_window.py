"""Mistral with a sliding window shorter than its prompts, through the whole engine: greedy tokens equal
HF Transformers' (batched, chunked prefill, prefix caching on, blocks as long as the window and longer),
and the KV blocks a long request holds stay bounded by the window, not its length.

The KV cache side is server/core/kv_cache_manager.py; its unit tests are tests/engine/test_sliding_window.py.
"""

from __future__ import annotations

import pytest
from parity import TINY, assert_greedy_parity, hf_greedy, shared_prefix_prompts, tiny_checkpoint
from transformers import MistralConfig

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 8  # every prompt (27 to 48 tokens, and 120 below) is longer


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    config = MistralConfig(**TINY, num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW)
    config.architectures = ["MistralForCausalLM"]
    path = tmp_path_factory.mktemp("mistral-window")
    return tiny_checkpoint(config, path, seed=3), path


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("block_size", [8, 16])  # the engine's smallest: a block as long as the window
def test_greedy_matches_hf_past_the_window(mistral, backend, block_size):
    hf, path = mistral
    rounds = shared_prefix_prompts(prefix_len=20)
    assert_greedy_parity(hf, path, backend, rounds=rounds, max_tokens=12, block_size=block_size)


def test_a_long_request_holds_blocks_for_its_window_only(mistral):
    hf, path = mistral
    block_size, chunk = 8, 16
    llm = LLM(str(path), dtype="float32", device="cpu", attention_backend="cpu", block_size=block_size,
              max_num_batched_tokens=chunk, enable_prefix_caching=True, kv_cache_memory_bytes=4 << 20)
    kv = llm.engine.core.kv
    in_use: list[int] = []  # blocks taken from the pool after each step's allocation
    allocate = kv.allocate

    def recording_allocate(request, num_new_tokens, cached=None, cache=True):
        ok = allocate(request, num_new_tokens, cached, cache)
        in_use.append(kv.pool.num_blocks - kv.pool.num_free_blocks)
        return ok

    kv.allocate = recording_allocate
    prompt = shared_prefix_prompts(num_rounds=1, per_round=1, prefix_len=120, lengths=(0,))[0][0]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 30).tokens
    # The blocks positions p - WINDOW + 1 .. p can span, and the null block standing in for the others.
    window_blocks = -(-(WINDOW - 1) // block_size) + 1 + 1
    assert len(in_use) == -(-120 // chunk) + 29  # prompt chunks, then one allocation per decode
    assert max(in_use) <= window_blocks + chunk // block_size  # a prompt chunk and the window before it
    assert max(in_use[-29:]) <= window_blocks  # decoding: the window alone, 150 tokens in (19 blocks)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - 1  # all back but the null block
