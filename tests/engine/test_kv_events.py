"""KV events (issue 20): recorded by the block pool and KV manager, published by the async engine on
GET /v1/kv_events, and equal to the hashes the router computes for the same prompt."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from pagedserve.common.block_hash import chain_hashes, salted_root
from pagedserve.router.hashing import PromptHasher, hash_int
from pagedserve.router.kv_index import KVIndex
from pagedserve.server.core.kv_cache_manager import KVCacheManager
from pagedserve.server.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
)
from pagedserve.server.lora_request import LoRARequest
from pagedserve.server.outputs import RequestMetrics
from pagedserve.server.request import Request
from pagedserve.server.sampling_params import SamplingParams

BLOCK = 4


def make_request(
    request_id: str, tokens: list[int], cache_salt: str | None = None, lora: LoRARequest | None = None
) -> Request:
    return Request(request_id=request_id, prompt_token_ids=tokens, params=SamplingParams(), max_tokens=8,
                   eos_token_ids=frozenset(), metrics=RequestMetrics(0.0), cache_salt=cache_salt,
                   lora_request=lora)  # fmt: skip


def admit(kv: KVCacheManager, request: Request) -> bool:
    cached = kv.find_cached_prefix(request)
    ok = kv.allocate(request, request.num_tokens - len(cached) * BLOCK, cached)
    if ok:
        request.num_computed_tokens = request.num_tokens
    return ok


def manager(num_blocks: int, events: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK, True, hash_seed="model:float32", enable_kv_events=events)


def test_stored_on_prefill_with_the_chain_the_router_computes() -> None:
    kv = manager(8)
    prompt = list(range(100, 110))  # 2 full blocks and 2 tokens
    assert admit(kv, make_request("a", prompt, cache_salt="tenant"))
    (stored,) = kv.pool.take_events()
    root = salted_root(kv.root_hash, "tenant")
    assert stored == BlockStored(chain_hashes(prompt, BLOCK, root), None, prompt[:8], BLOCK)
    assert set(stored.block_hashes) == set(kv.pool.cached)
    assert kv.pool.take_events() == []  # taken once
    # A request sharing the first block stores only its new second block, chained to the first.
    other = [*prompt[:4], 7, 7, 7, 7, 7]
    assert admit(kv, make_request("b", other, cache_salt="tenant"))
    (more,) = kv.pool.take_events()
    first = stored.block_hashes[0]
    assert more == BlockStored(chain_hashes(other, BLOCK, root)[1:], first, [7, 7, 7, 7], BLOCK)


def test_adapter_blocks_match_the_router_index_for_that_adapter_only() -> None:
    """An adapter request's stored blocks are found by the router's index (router/kv_index.py) for the same
    adapter and salt, and by no other: router and engine root the chain alike (issue 17)."""
    kv = manager(8)
    prompt = list(range(100, 110))
    sql = LoRARequest("sql", 1, "/adapters/sql")
    assert admit(kv, make_request("a", prompt, cache_salt="tenant", lora=sql))
    (stored,) = kv.pool.take_events()
    index = KVIndex()
    events = [{"type": "BlockStored", "block_hashes": [h.hex() for h in stored.block_hashes]}]
    index.apply("u", {"snapshot": True, "hash_root": kv.root_hash.hex(), "block_size": BLOCK, "seq": 0,
                      "events": events})  # fmt: skip
    assert index.matches(prompt, "tenant", ["u"], "sql") == {"u": 2}
    assert index.matches(prompt, "tenant", ["u"]) == {"u": 0}
    assert index.matches(prompt, None, ["u"], "sql") == {"u": 0}
    assert index.matches(prompt, "tenant", ["u"], "legal") == {"u": 0}


def test_removed_on_eviction_under_a_tiny_pool_and_cleared_on_reset() -> None:
    kv = manager(3)
    a = make_request("a", list(range(8)))  # 2 blocks, both cached
    assert admit(kv, a)
    stored = kv.pool.take_events()[0].block_hashes
    kv.free(a)
    assert kv.pool.take_events() == []  # freed blocks stay cached: nothing removed yet
    b = make_request("b", list(range(50, 62)))  # 3 blocks: both of a's are evicted, tail first
    assert admit(kv, b)
    events = kv.pool.take_events()
    assert events[:2] == [BlockRemoved([stored[1]]), BlockRemoved([stored[0]])]
    assert isinstance(events[2], BlockStored) and set(events[2].block_hashes) == set(kv.pool.cached)
    kv.pool.reset_prefix_cache()
    assert kv.pool.take_events() == [AllBlocksCleared()]  # one event, not one per block
    assert not kv.pool.cached


def test_no_events_are_kept_when_off() -> None:
    kv = manager(4, events=False)
    assert admit(kv, make_request("a", list(range(8))))
    kv.pool.reset_prefix_cache()
    assert kv.pool.events is None and kv.pool.take_events() == []


def test_flag_and_config() -> None:
    import argparse

    from pagedserve.server.api import cli
    from pagedserve.server.config import EngineConfig

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.engine_config(parser.parse_args(["--enable-kv-events"])).enable_kv_events
    assert not cli.engine_config(parser.parse_args([])).enable_kv_events
    with pytest.raises(ValueError, match="enable_kv_events needs enable_prefix_caching"):
        EngineConfig(enable_kv_events=True, enable_prefix_caching=False)


def test_offline_engine_keeps_no_events(model_path: str) -> None:
    from pagedserve import LLM, SamplingParams

    llm = LLM(model_path, enable_kv_events=True, num_gpu_blocks_override=16)
    llm.generate(["word " * 40], SamplingParams(max_tokens=2))
    assert llm.engine.core.kv.pool.cached and llm.engine.core.kv.pool.events == []


def lines_of(sub) -> list[dict]:
    out = []
    while not sub.queue.empty():
        line = sub.queue.get_nowait()
        out.append(None if line is None else json.loads(line))
    return out


async def test_publisher_snapshot_sequence_and_slow_subscriber_dropped() -> None:
    pub = KVEventPublisher(block_size=4, hash_root=b"\x01" * 16, max_queued_batches=2)
    pub.publish([BlockStored([b"a" * 16, b"b" * 16], None, list(range(8)), 4)])
    pub.publish([BlockRemoved([b"a" * 16])])
    pub.publish([])  # nothing happened: no batch, no number
    sub = pub.subscribe()
    (snap,) = lines_of(sub)
    assert snap["snapshot"] and snap["seq"] == 2 and snap["block_size"] == 4
    assert snap["hash_root"] == "01" * 16
    assert snap["events"][0] == {"type": "AllBlocksCleared"}
    assert snap["events"][1]["block_hashes"] == [(b"b" * 16).hex()]
    pub.publish([AllBlocksCleared()])
    assert [b["seq"] for b in lines_of(sub)] == [3]
    # Three batches behind with room for two: dropped, never waited for; its stream ends.
    for _ in range(3):
        pub.publish([AllBlocksCleared()])
    assert sub.dropped and sub not in pub.subscribers and pub.dropped_subscribers == 1
    assert [line async for line in pub.lines(sub)] == []
    # Closing (the engine stops) ends every stream.
    other = pub.subscribe()
    pub.close()
    lines = [line async for line in pub.lines(other)]
    assert len(lines) == 1 and json.loads(lines[0])["seq"] == 6 and not pub.subscribers


# --- the real engine and model, served on a thread -----------------------------------------------------
@pytest.fixture(scope="module")
def kv_server(model_path: str):
    from pagedserve.server.api.app import ServerSettings, build_app
    from pagedserve.server.config import EngineConfig
    from pagedserve.server.engine.async_engine import AsyncEngine

    from pagedserve.testing.server_thread import ServerThread

    # A tiny pool (24 blocks of 16): a few prompts evict each other.
    config = EngineConfig(
        model=model_path, enable_kv_events=True, num_gpu_blocks_override=24, max_model_len=256
    )
    engine = AsyncEngine.from_config(config)
    with ServerThread(build_app(engine, ServerSettings(access_log=False, api_key="k"))) as server:
        yield server, engine


def chat(topic: str, words: int) -> dict:
    system = f"You answer questions about {topic}. " + " ".join(f"{topic}{i}" for i in range(words))
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi?"}],
            "max_tokens": 2, "temperature": 0}  # fmt: skip


class Follower:
    """Reads a KV event stream in the background into a router KVIndex, as router/kv_events.py does."""

    def __init__(self, response: httpx.Response) -> None:
        self.index = KVIndex()
        self.batches: list[dict] = []
        self.task = asyncio.ensure_future(self._read(response))

    async def _read(self, response: httpx.Response) -> None:
        async for line in response.aiter_lines():
            if line.strip():
                self.batches.append(json.loads(line))
                self.index.apply("e", self.batches[-1])

    async def wait(self, cond, what: str, timeout: float = 60) -> None:
        assert not self.task.done() or cond(), self.task
        await self.wait_for(lambda: cond() or self.task.done(), what, timeout)
        assert cond(), self.task

    @staticmethod
    async def wait_for(cond, what: str, timeout: float = 60) -> None:
        for _ in range(int(timeout / 0.05)):
            if cond():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def held(self) -> set[int]:
        replica = self.index.replicas.get("e")
        return replica.hashes if replica else set()


async def test_stream_matches_the_cache_and_the_router_hashes(kv_server, model_path: str) -> None:
    server, engine = kv_server
    auth = {"Authorization": "Bearer k"}
    hasher = PromptHasher(model_path, "unused", 16)
    body = chat("billing", 60)
    ids = hasher.token_ids_for("/v1/chat/completions", body)  # the router's own tokenization
    full = len(ids) // 16
    assert full >= 4

    def engine_cache() -> set[int]:
        return {hash_int(h) for h in list(engine.core.kv.pool.cached)}

    async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
        assert (await c.get("/v1/kv_events")).status_code == 401  # the API key, like every /v1 route
        async with c.stream("GET", "/v1/kv_events", headers=auth) as r:
            assert r.headers["content-type"].startswith("application/x-ndjson")
            follower = Follower(r)
            await follower.wait(lambda: follower.batches, "the snapshot")
            snap = follower.batches[0]
            assert snap["snapshot"] and snap["block_size"] == 16
            assert snap["hash_root"] == engine.core.kv.root_hash.hex()

            ok = await c.post("/v1/chat/completions", json=body, headers=auth)
            assert ok.status_code == 200, ok.text
            # The router's hashes of its own tokenization are the engine's: the whole prompt matches.
            await follower.wait(lambda: follower.index.matches(ids, None, ["e"])["e"] == full, "stored")
            await follower.wait(lambda: follower.held() == engine_cache(), "the index equals the cache")

            # Other topics fill the tiny pool: the first prompt's blocks are evicted, and reported so.
            for topic in ("shipping", "returns", "privacy"):
                reply = await c.post("/v1/chat/completions", json=chat(topic, 60), headers=auth)
                assert reply.status_code == 200
            await follower.wait(lambda: follower.index.matches(ids, None, ["e"])["e"] < full, "removed")
            assert any(e["type"] == "BlockRemoved" for b in follower.batches for e in b["events"])
            await follower.wait(lambda: follower.held() == engine_cache(), "the index equals the cache")
            seqs = [b["seq"] for b in follower.batches]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))

            # A late subscriber's snapshot rebuilds the same index (a restarted router).
            async with c.stream("GET", "/v1/kv_events", headers=auth) as late:
                late_follower = Follower(late)
                await late_follower.wait(lambda: late_follower.batches, "the late snapshot")
                late_follower.task.cancel()
            assert late_follower.held() == follower.held()
            assert late_follower.batches[0]["seq"] == follower.batches[-1]["seq"]
            follower.task.cancel()
    # Gone subscribers leave nothing behind in the engine (the stream's generator ends on disconnect).
    await Follower.wait_for(lambda: not engine.kv_events.subscribers, "subscriptions released")
