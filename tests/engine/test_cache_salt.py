"""cache_salt (vLLM's request field) on the embedded model: it enters the first block's hash, so only
requests with the same salt share cached KV blocks (counted in num_cached_tokens, the usage's
cached_tokens)."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams

TEXT = "A shared system prompt that spans several KV blocks of sixteen tokens each. " * 6



def cached_tokens(llm: LLM, salt: str | None) -> int:
    prompt: dict[str, object] = {"prompt": TEXT}
    if salt is not None:
        prompt["cache_salt"] = salt
    (output,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1))
    return output.num_cached_tokens


def test_only_the_same_salt_shares_blocks(llm: LLM) -> None:
    llm.engine.core.kv.pool.reset_prefix_cache()
    assert cached_tokens(llm, "tenant-a") == 0
    full_blocks = cached_tokens(llm, "tenant-a")
    assert full_blocks >= 64  # the prompt's full blocks, all but the last token's
    assert cached_tokens(llm, "tenant-b") == 0
    assert cached_tokens(llm, None) == 0
    assert cached_tokens(llm, None) == full_blocks
    assert cached_tokens(llm, "tenant-b") == full_blocks


@pytest.mark.parametrize("salt", ["", 7])
def test_cache_salt_must_be_a_non_empty_string(llm: LLM, salt: object) -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt": "hi", "cache_salt": salt}, SamplingParams(max_tokens=1))
