"""Prompt -> tokens -> chained block hashes."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from pagedserve.router.hashing import PromptHasher, block_hashes, seed_hash

SYSTEM = "You are the support assistant of ACME Corp. Answer politely and briefly. " * 4


def chat(user: str, system: str = SYSTEM) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


@pytest.fixture(scope="module")
def hasher(tiny_tokenizer) -> PromptHasher:
    return PromptHasher(tiny_tokenizer, "tiny-model", block_size=16)


def test_block_hashes_chain_over_full_blocks_only():
    seed = seed_hash("m")
    ids = list(range(100))
    hs = block_hashes(ids, 16, seed)
    assert len(hs) == 6  # 100 // 16; the partial block is not hashed
    assert block_hashes(ids[:15], 16, seed) == []
    assert block_hashes(ids[:32], 16, seed) == hs[:2]
    # Chained: changing a token changes its block's hash and every later one, never the earlier ones.
    changed = ids.copy()
    changed[40] = 999
    hc = block_hashes(changed, 16, seed)
    assert hc[:2] == hs[:2]
    assert all(a != b for a, b in zip(hc[2:], hs[2:], strict=True))
    # Same block contents at a different position (different parent) hash differently.
    rep = [7] * 64
    hr = block_hashes(rep, 16, seed)
    assert len(set(hr)) == 4
    # Seeded by the model name.
    assert block_hashes(ids, 16, seed_hash("other")) != hs
    # Large token ids (beyond 32 bits) are fine.
    assert len(block_hashes([2**40] * 32, 16, seed)) == 2
    with pytest.raises(ValueError):
        block_hashes(ids, 0, seed)


def test_hashes_are_stable_across_processes():
    code = (
        "from pagedserve.router.hashing import block_hashes, seed_hash;"
        "print(block_hashes(list(range(64)), 16, seed_hash('m')))"
    )
    outs = set()
    for hashseed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env, text=True))
    assert len(outs) == 1
    assert outs.pop().strip() == str(block_hashes(list(range(64)), 16, seed_hash("m")))


def test_same_prefix_same_hash_chain(hasher):
    a, n_a = hasher.hashes_for("/v1/chat/completions", chat("What are your opening hours?"))
    b, _ = hasher.hashes_for("/v1/chat/completions", chat("Where is my parcel? It is late."))
    again, _ = hasher.hashes_for("/v1/chat/completions", chat("What are your opening hours?"))
    assert a == again
    assert n_a == len(hasher.chat_token_ids(chat("What are your opening hours?")["messages"]))
    # The shared system prompt covers the leading blocks of both chains.
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    system_tokens = len(
        hasher.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}], tokenize=False)
    )
    assert common >= system_tokens // 16 - 1
    assert common < len(a)
    other_tenant, _ = hasher.hashes_for("/v1/chat/completions", chat("hi", system="Another tenant. " * 20))
    assert other_tenant[0] != a[0] or other_tenant[1] != a[1]


def test_chat_template_is_applied(hasher):
    body = chat("Hello!")
    ids = hasher.chat_token_ids(body["messages"], body)
    text = hasher.tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt is added
    assert ids == hasher.tokenizer.encode(text, add_special_tokens=False)
    im_start = hasher.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 3  # system, user, and the generation prompt
    # Content parts are flattened to text the way the engine renders them.
    parts = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo!"}]},
        ]
    }
    assert hasher.chat_token_ids(parts["messages"], parts) == ids
    # add_generation_prompt=False is honoured.
    no_gen = {**body, "add_generation_prompt": False}
    assert len(hasher.chat_token_ids(no_gen["messages"], no_gen)) < len(ids)


def test_fast_paths_match_the_reference_tokenization(hasher):
    assert hasher._templates is not None and hasher._split is not None
    rnd = random.Random(0)
    words = [
        "hello",
        "  world",
        "\n",
        "<|im_start|>",
        "é 😀",
        "foo-bar",
        "1234",
        "  ",
        "<|im_end|>",
        "x",
        "{{ }}",
    ]
    for _ in range(100):
        msgs = [
            {
                "role": rnd.choice(["system", "user", "assistant"]),
                "content": "".join(rnd.choice(words) for _ in range(rnd.randint(0, 30))),
            }
            for _ in range(rnd.randint(1, 4))
        ]
        ref = hasher.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert hasher.chat_token_ids(msgs) == hasher.tokenizer.encode(ref, add_special_tokens=False)


def test_completions_prompts(hasher):
    text = "Once upon a time, in a land far away, there lived a router. " * 3
    hs, n = hasher.hashes_for("/v1/completions", {"prompt": text})
    assert n == len(hasher.tokenizer.encode(text)) and len(hs) == n // 16
    assert hasher.hashes_for("/v1/completions", {"prompt": [text, "other"]})[0] == hs  # batch: the first
    ids = list(range(40))
    assert hasher.hashes_for("/v1/completions", {"prompt": ids}) == (block_hashes(ids, 16, hasher.seed), 40)
    assert hasher.hashes_for("/v1/completions", {"prompt": [ids, [1, 2]]})[1] == 40
    for bad in (None, [], {"prompt": ""}, {"prompt": 3}, {"messages": []}, "text"):
        assert hasher.hashes_for("/v1/completions", bad) == ([], 0)
    assert hasher.hashes_for("/v1/chat/completions", {"messages": "nope"}) == ([], 0)
    assert hasher.hashes_for("/v1/embeddings", {"input": text}) == ([], 0)


def test_without_a_tokenizer_prefixes_still_share_hashes():
    h = PromptHasher(None, "m", 16)
    a, _ = h.hashes_for("/v1/chat/completions", chat("first question"))
    b, _ = h.hashes_for("/v1/chat/completions", chat("second question, longer"))
    assert a and b and a[0] == b[0]
    c, _ = h.hashes_for("/v1/completions", {"prompt": "x" * 200})
    assert len(c) == 200 // 4 // 16


def test_router_tokens_match_the_engine_tokenizer_of_the_default_model():
    """With the embedded model's tokenizer, the router's token ids are the ones the engine computes."""
    try:
        from pagedserve import default_model

        folder = default_model()
    except Exception as exc:  # pragma: no cover - depends on the engine's loader being there
        pytest.skip(f"default model unavailable: {exc}")
    h = PromptHasher(folder, "SmolLM2-135M-Instruct", 16)
    assert h._templates is not None and h._split is not None
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast.from_pretrained(folder)
    msgs = chat("What is the capital of France?")["messages"]
    text = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert h.chat_token_ids(msgs) == ref.encode(text, add_special_tokens=False)
    assert json.loads(Path(folder, "config.json").read_text())["vocab_size"] > max(h.chat_token_ids(msgs))


def test_segment_cache_is_bounded_by_bytes(tiny_tokenizer):
    """Long, distinct system prompts: the segment cache holds at most its byte budget, whatever the count
    of entries (measured with tracemalloc, not with the cache's own accounting)."""
    import gc
    import tracemalloc

    budget = 256 * 1024
    h = PromptHasher(tiny_tokenizer, "tiny-model", block_size=16, segment_cache_bytes=budget)
    assert h._split is not None  # the piecewise path, where the cache lives
    rnd = random.Random(0)

    def prompt(i: int) -> list[dict]:
        text = f"tenant {i}: " + " ".join(f"rule{rnd.randrange(10**6)}" for _ in range(2000))  # ~25 KB
        return [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]

    prompts = [prompt(i) for i in range(40)]  # built before measuring: only the cache's growth counts
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for msgs in prompts:
            h.chat_token_ids(msgs)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert h.segments.nbytes <= budget
    assert held <= budget + 64 * 1024, held  # an entry-bounded cache kept all 40 (megabytes)
    # Still a cache, and still exact: the last prompt's pieces are found again, with the same ids.
    ids = h.chat_token_ids(prompts[-1])
    ref = h.tokenizer.apply_chat_template(prompts[-1], tokenize=False, add_generation_prompt=True)
    assert ids == h.tokenizer.encode(ref, add_special_tokens=False)
    assert any(h.segments.get(piece) is not None for piece in h._split.split(ref) if len(piece) > 1000)
    # A segment bigger than the whole budget is tokenized but not kept.
    tiny = PromptHasher(tiny_tokenizer, "tiny-model", block_size=16, segment_cache_bytes=1024)
    assert tiny.chat_token_ids(prompts[0]) == h.chat_token_ids(prompts[0])
    assert tiny.segments.nbytes <= 1024
