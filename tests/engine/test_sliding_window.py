"""Sliding-window KV cache: blocks behind every running request's window go back to the pool, the null
block keeps the table's positions, prefix hits take only the blocks they still need; and the engine on a
tiny Mistral with a window shorter than its prompts answers as HF Transformers does."""

from __future__ import annotations

from pagedserve.server.core.kv_cache_manager import KVCacheManager, uniform_sliding_window
from pagedserve.server.core.scheduler import Scheduler
from pagedserve.server.outputs import RequestMetrics
from pagedserve.server.request import Request
from pagedserve.server.sampling_params import SamplingParams

BLOCK = 4
WINDOW = 6  # a token sees itself and the 5 before it: at most 3 blocks of 4 hold those


def make_request(request_id: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(request_id=request_id, prompt_token_ids=tokens, params=SamplingParams(),
                   max_tokens=max_tokens, eos_token_ids=frozenset(), metrics=RequestMetrics(0.0))


def run_to_completion(scheduler: Scheduler, kv: KVCacheManager, request: Request) -> list[int]:
    """Steps until the request finishes (a sampled token 7 each step); the real blocks it held, per step."""
    scheduler.add(request)
    held = []
    while request.num_output_tokens < request.max_tokens:
        for item in scheduler.schedule().scheduled:
            completes = item.completes_sequence
            item.request.num_computed_tokens += item.num_new_tokens
            if completes:
                item.request.output_token_ids.append(7)
        held.append(sum(1 for b in kv.blocks_of(request.request_id) if b is not kv.null_block))
    scheduler.finish(request, request.status)
    return held


def test_blocks_behind_the_window_return_to_the_pool():
    kv = KVCacheManager(32, BLOCK, enable_caching=False, hash_seed="m", sliding_window=WINDOW)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8)
    request = make_request("a", list(range(30)), max_tokens=20)
    held = run_to_completion(scheduler, kv, request)
    # Chunks of 8 prompt tokens, then decodes: never more than the chunk and the window before it.
    assert max(held) <= -(-(WINDOW - 1) // BLOCK) + 8 // BLOCK + 1
    # Decoding 20 tokens past a 30-token prompt holds what the window needs, not all 13 blocks.
    assert held[-1] <= -(-(WINDOW - 1) // BLOCK) + 1
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - 1  # all back but the null block


def test_the_table_keeps_positions_and_never_points_behind_the_window_at_real_blocks():
    kv = KVCacheManager(32, BLOCK, enable_caching=False, hash_seed="m", sliding_window=WINDOW)
    request = make_request("a", list(range(21)))
    assert kv.allocate(request, 21)
    request.num_computed_tokens = 21
    assert kv.allocate(request, 1)  # the token at position 21 sees positions 16..21: blocks 4 and 5
    table = kv.block_ids("a")
    assert len(table) == 6  # position // BLOCK still indexes it
    assert table[:4] == [kv.null_block.block_id] * 4
    assert kv.null_block.block_id not in table[4:]


def test_freeing_a_request_behind_its_window_returns_each_block_once():
    """Preemption or finish after blocks went behind the window: the rest go back, none twice, and the
    null block stays held."""
    kv = KVCacheManager(32, BLOCK, enable_caching=True, hash_seed="m", sliding_window=WINDOW)
    request = make_request("a", list(range(21)))
    assert kv.allocate(request, 21)
    for position in range(21, 30):
        request.num_computed_tokens = position
        request.output_token_ids.append(7)
        assert kv.allocate(request, 1)
    kv.free(request)
    assert kv.pool.num_free_blocks == 31
    others = [b for b in kv.pool.blocks if b is not kv.null_block]
    assert kv.null_block.ref_cnt == 1 and all(b.ref_cnt == 0 for b in others)


def test_no_window_keeps_every_block():
    kv = KVCacheManager(32, BLOCK, enable_caching=False, hash_seed="m")
    request = make_request("a", list(range(21)))
    assert kv.allocate(request, 21)
    request.num_computed_tokens = 21
    assert kv.allocate(request, 1)
    assert kv.null_block is None and kv.pool.num_free_blocks == 32 - 6


def fill_cache(kv: KVCacheManager, tokens: list[int]) -> None:
    """A request over ``tokens`` that computed them all and left (its full blocks stay cached)."""
    request = make_request("filler", tokens)
    assert kv.allocate(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    kv.free(request)


def test_prefix_hit_needs_only_the_blocks_inside_its_window():
    kv = KVCacheManager(16, BLOCK, enable_caching=True, hash_seed="m", sliding_window=WINDOW)
    prompt = list(range(100, 120))  # 5 full blocks
    fill_cache(kv, prompt)
    hashes = kv.full_block_hashes(make_request("x", prompt))
    for block_hash in hashes[:2]:  # the oldest blocks evicted: no longer findable
        kv.pool._evict(kv.pool.lookup(block_hash))

    # 20 cached tokens + 3: computing from position 20, the window needs positions 15..: blocks 3 and 4.
    request = make_request("b", [*prompt, 1, 2, 3])
    hits = kv.find_cached_prefix(request)
    assert len(hits) == 5
    assert hits[:3] == [kv.null_block] * 3 and kv.null_block not in hits[3:]
    unneeded = kv.pool.lookup(hashes[2])  # cached, but before the window of position 20
    assert kv.allocate(request, 3, hits)
    # The hit took references on the blocks it needs only; block 2 stays free (and evictable).
    assert all(b.ref_cnt == 1 for b in hits[3:])
    assert unneeded.ref_cnt == 0 and unneeded.block_id in kv.pool.free_queue


def test_prefix_hit_stops_where_a_needed_block_is_missing():
    kv = KVCacheManager(16, BLOCK, enable_caching=True, hash_seed="m", sliding_window=WINDOW)
    prompt = list(range(100, 120))
    fill_cache(kv, prompt)
    hashes = kv.full_block_hashes(make_request("x", prompt))
    kv.pool._evict(kv.pool.lookup(hashes[3]))  # block 3 gone: hits ending at blocks 4 or 5 lack it
    request = make_request("b", [*prompt, 1])
    hits = kv.find_cached_prefix(request)
    # 3 blocks: computing from position 12 needs positions 7..11, blocks 1 and 2, both cached.
    assert len(hits) == 3 and hits[0] is kv.null_block and kv.null_block not in hits[1:]


def test_the_window_is_the_one_all_layers_share():
    assert uniform_sliding_window([8, 8, 8]) == 8
    # Gemma 2/3: local and global layers alternate, so the global ones need every block.
    assert uniform_sliding_window([8, 8, 8, None]) is None
    assert uniform_sliding_window([None, None]) is None
