"""Block pool and KV cache manager: ref counts, prefix hits, LRU eviction, no leaks."""

from __future__ import annotations

import random

from pagedserve.server.core.block_pool import BlockPool
from pagedserve.server.core.kv_cache_manager import KVCacheManager
from pagedserve.server.outputs import RequestMetrics
from pagedserve.server.request import Request
from pagedserve.server.sampling_params import SamplingParams

BLOCK = 4


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id=request_id,
                   prompt_token_ids=tokens, params=SamplingParams(), max_tokens=8,
                   eos_token_ids=frozenset(), metrics=RequestMetrics(0.0))


def admit(kv: KVCacheManager, request: Request) -> bool:
    cached = kv.find_cached_prefix(request)
    num_cached = len(cached) * BLOCK
    ok = kv.allocate(request, request.num_tokens - num_cached, cached)
    if ok:
        request.num_computed_tokens = request.num_tokens
    return ok


def test_pool_lru_eviction_order() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"a")
    pool.cache(b, b"b")
    pool.free([b, a])  # b freed first -> evicted first
    pool.free([c])
    (first,) = pool.allocate(1)
    assert first is b and pool.lookup(b"b") is None and pool.lookup(b"a") is a
    assert pool.num_free_blocks == 2


def test_prefix_hit_reuses_blocks_and_keeps_last_token() -> None:
    kv = KVCacheManager(16, BLOCK, enable_caching=True, hash_seed="m")
    first = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert admit(kv, first)
    second = make_request("b", [*list(range(10)), 99])
    hits = kv.find_cached_prefix(second)
    assert [b.block_id for b in hits] == kv.block_ids("a")[:2]
    # A prompt that is exactly the cached blocks still recomputes its last block.
    exact = make_request("c", list(range(8)))
    assert len(kv.find_cached_prefix(exact)) == 1


def test_different_seed_or_tokens_do_not_hit() -> None:
    kv = KVCacheManager(16, BLOCK, enable_caching=True, hash_seed="m")
    assert admit(kv, make_request("a", list(range(9))))
    assert kv.find_cached_prefix(make_request("b", [7, *range(1, 9)])) == []
    other_model = KVCacheManager(16, BLOCK, enable_caching=True, hash_seed="other")
    assert other_model.root_hash != kv.root_hash


def test_allocate_fails_cleanly_and_free_returns_everything() -> None:
    kv = KVCacheManager(4, BLOCK, enable_caching=True, hash_seed="m")
    big = make_request("big", list(range(20)))  # needs 5 blocks
    assert not kv.allocate(big, 20)
    assert kv.pool.num_free_blocks == 4 and kv.blocks_of("big") == []
    a, b = make_request("a", list(range(8))), make_request("b", list(range(8)))
    assert admit(kv, a) and admit(kv, b)
    shared = set(kv.block_ids("a")) & set(kv.block_ids("b"))
    assert len(shared) == 1  # first block shared, the last one recomputed
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_cached_free_blocks_count_against_free_space() -> None:
    kv = KVCacheManager(3, BLOCK, enable_caching=True, hash_seed="m")
    a = make_request("a", list(range(9)))  # 3 blocks
    assert admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(9)))  # hits 2 free cached blocks, needs 1 more
    assert admit(kv, b)
    assert kv.pool.num_free_blocks == 0
    kv.free(b)
    assert kv.pool.num_free_blocks == 3


def test_the_block_id_tables_follow_the_blocks_through_growth_windows_and_frees() -> None:
    """``block_ids`` is a table kept beside the blocks (the runner reads it each step without a copy):
    after every allocation, every block dropped behind a window and every free, it equals the blocks' ids."""
    rng = random.Random(0)
    for window in (None, 6):
        kv = KVCacheManager(24, BLOCK, True, hash_seed="m", sliding_window=window)
        live: list[Request] = []
        for step in range(200):
            if live and rng.random() < 0.15:
                kv.free(live.pop(rng.randrange(len(live))))
            elif rng.random() < 0.3:
                request = make_request(f"r{step}", [rng.randrange(50) for _ in range(rng.randrange(1, 9))])
                if admit(kv, request):
                    live.append(request)
            elif live:
                request = rng.choice(live)
                if kv.allocate(request, 1):
                    request.output_token_ids.append(rng.randrange(50))
                    request.num_computed_tokens += 1
            for request in live:
                blocks = kv.blocks_of(request.request_id)
                assert kv.block_ids(request.request_id) == [b.block_id for b in blocks]
        for request in live:
            kv.free(request)
        assert kv.req_block_ids == {} and kv.pool.num_free_blocks == 24 - (window is not None)
