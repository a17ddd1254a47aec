"""The router's prefix hash follows the engine's cache_salt: different salts share no prefix hash."""

from __future__ import annotations

from pagedserve.router.hashing import PromptHasher, block_hashes

PROMPT = "The same long prompt, tokenised to the same bytes every time it is seen by the router. " * 3


def test_cache_salt_seeds_the_hash_chain() -> None:
    hasher = PromptHasher(None, "model", 16)  # without a tokenizer: bytes stand in for tokens
    plain, n = hasher.hashes_for("/v1/completions", {"prompt": PROMPT})
    assert plain and n
    salted_a, _ = hasher.hashes_for("/v1/completions", {"prompt": PROMPT, "cache_salt": "a"})
    again_a, _ = hasher.hashes_for("/v1/completions", {"prompt": PROMPT, "cache_salt": "a"})
    salted_b, _ = hasher.hashes_for("/v1/completions", {"prompt": PROMPT, "cache_salt": "b"})
    assert salted_a == again_a and len(salted_a) == len(plain)
    assert not set(salted_a) & set(plain) and not set(salted_a) & set(salted_b)
    chat = {"messages": [{"role": "user", "content": PROMPT}]}
    assert not set(hasher.hashes_for("/v1/chat/completions", {**chat, "cache_salt": "a"})[0]) & set(
        hasher.hashes_for("/v1/chat/completions", chat)[0]
    )
    # An empty or non-string salt is refused by the engine; the router hashes as if there were none.
    assert hasher.hashes_for("/v1/completions", {"prompt": PROMPT, "cache_salt": ""})[0] == plain
    assert plain == block_hashes(hasher.text_token_ids(PROMPT), 16, hasher.seed)
