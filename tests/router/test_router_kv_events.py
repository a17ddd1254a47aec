"""--strategy kv-events (issue 20): the KV index (pure), the balancer's use of it, the subscriptions'
resync on a gap or a cut stream, and the router in front of two real engines publishing KV events:
prefix hits on what the engines really hold, an engine restart and a router restart."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os

import httpx
import pytest
from pagedserve.common.block_hash import chain_hashes, salted_root, seed_hash
from pagedserve.router.balancer import HASH_RING, KV_EVENT_HIT, OVERLOAD_FALLBACK, PREFIX_HIT, Balancer
from pagedserve.router.hashing import hash_int
from pagedserve.router.kv_events import KVEventSubscriptions
from pagedserve.router.kv_index import GapError, KVIndex

from pagedserve.testing.net import wait_until
from pagedserve.testing.processes import router_process, serve_process
from pagedserve.testing.server_thread import ServerThread

ROOT = seed_hash("model:float32")
IDS = list(range(1000, 1000 + 16 * 6))  # 6 full blocks


def snapshot(seq: int, hashes: list[bytes], root: bytes = ROOT, block_size: int = 16) -> dict:
    return {"seq": seq, "snapshot": True, "block_size": block_size, "hash_root": root.hex(),
            "events": [{"type": "AllBlocksCleared"},
                       {"type": "BlockStored", "block_hashes": [h.hex() for h in hashes],
                        "parent_block_hash": None, "token_ids": [], "block_size": block_size}]}  # fmt: skip


def batch(seq: int, kind: str, hashes: list[bytes] = ()) -> dict:
    event = {"type": kind, "block_hashes": [h.hex() for h in hashes]}
    return {"seq": seq, "events": [event]}


# --- the index, pure ---------------------------------------------------------------------------------
def test_index_follows_snapshot_and_events_and_matches_the_engine_chain():
    chain = chain_hashes(IDS, 16, ROOT)
    index = KVIndex()
    assert not index.synced("a") and index.matches(IDS, None, ["a"]) == {}
    index.apply("a", snapshot(5, chain[:2]))
    assert index.synced("a") and index.matches(IDS, None, ["a"]) == {"a": 2}
    assert index.apply("a", batch(6, "BlockStored", chain[2:5])) == 1
    assert index.matches(IDS, None, ["a", "b"]) == {"a": 5}  # b: unknown, not "holds nothing"
    index.apply("a", batch(7, "BlockRemoved", [chain[1]]))
    assert index.matches(IDS, None, ["a"]) == {"a": 1}  # a prefix match stops at the first hole
    assert index.matches(IDS, "tenant", ["a"]) == {"a": 0}  # another salt: another chain
    salted = chain_hashes(IDS, 16, salted_root(ROOT, "tenant"))
    index.apply("a", batch(8, "BlockStored", salted[:3]))
    assert index.matches(IDS, "tenant", ["a"]) == {"a": 3}
    index.apply("a", {"seq": 9, "events": [{"type": "AllBlocksCleared"}]})
    assert index.matches(IDS, None, ["a"]) == {"a": 0} and index.size() == 0


def test_index_drops_a_replica_on_a_gap_a_missing_snapshot_or_a_bad_batch():
    chain = chain_hashes(IDS, 16, ROOT)
    index = KVIndex(max_blocks=4)
    with pytest.raises(GapError):
        index.apply("a", batch(1, "BlockStored", chain[:1]))  # no snapshot yet
    index.apply("a", snapshot(1, chain[:2]))
    with pytest.raises(GapError, match="gap"):
        index.apply("a", batch(3, "BlockStored", chain[2:3]))  # batch 2 was lost
    assert not index.synced("a")
    index.apply("a", snapshot(3, chain[:2]))
    with pytest.raises(GapError, match="malformed"):
        index.apply("a", {"seq": 4, "events": [{"type": "BlockStored", "block_hashes": ["zz"]}]})
    index.apply("a", snapshot(4, chain[:2]))
    with pytest.raises(GapError, match="more than 4"):
        index.apply("a", batch(5, "BlockStored", chain[2:6]))  # bounded, whatever an engine sends
    assert index.size() == 0


def test_index_hashes_once_per_root_and_block_size():
    other_root = seed_hash("model:bfloat16")
    index = KVIndex()
    index.apply("a", snapshot(1, chain_hashes(IDS, 16, ROOT)[:4]))
    index.apply("b", snapshot(1, chain_hashes(IDS, 16, other_root)[:2], root=other_root))
    index.apply("c", snapshot(1, chain_hashes(IDS, 32, ROOT)[:1], block_size=32))
    assert index.matches(IDS, None, ["a", "b", "c"]) == {"a": 4, "b": 2, "c": 1}


# --- the balancer --------------------------------------------------------------------------------------
def test_balancer_prefers_the_real_match_and_falls_back_to_prefix_hash():
    guessed = [hash_int(h) for h in chain_hashes(IDS, 16, seed_hash("guess"))]
    b = Balancer(strategy="kv-events", min_load_cap=0.0, rng=__import__("random").Random(0))
    b.set_backends(["a", "b", "c"])
    b.record("c", guessed)  # the router's guess: c holds the whole prompt
    # a's engine reports 5 blocks: the real match wins over no match at all on b.
    d = b.choose(guessed, kv_matches={"a": 5, "b": 0})
    assert (d.url, d.reason, d.matched_blocks) == ("c", PREFIX_HIT, 6)  # c is unsynced: its guess counts
    b.record("c", [])
    d = b.choose(guessed, kv_matches={"a": 5, "b": 0, "c": 0})  # c's engine says: nothing
    assert (d.url, d.reason, d.matched_blocks) == ("a", KV_EVENT_HIT, 5)
    # Too short a match is no prefix hit: the ring decides, as under prefix-hash.
    d = b.choose(guessed, kv_matches={"a": 2, "b": 0, "c": 0})
    assert d.reason in (HASH_RING, OVERLOAD_FALLBACK)
    # The holder over the load bound: the next best under it.
    for _ in range(5):
        b.acquire("a")
    d = b.choose(guessed, kv_matches={"a": 6, "b": 4, "c": 0})
    assert (d.url, d.reason) == ("b", OVERLOAD_FALLBACK)


# --- subscriptions against an event source that loses a batch, then cuts the stream ---------------------
class FlakyEventSource:
    """An engine's /v1/kv_events as it looks when a batch is lost (first subscription) and when the
    stream is cut mid-way (second); the third stays up."""

    def __init__(self) -> None:
        self.subscriptions = 0
        self.chain = chain_hashes(IDS, 16, ROOT)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        self.subscriptions += 1
        n = self.subscriptions
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-ndjson")]})  # fmt: skip
        lines = [snapshot(10, self.chain[:1])]
        if n == 1:
            lines.append(batch(12, "BlockStored", self.chain[1:2]))  # 11 was lost
        elif n == 2:
            lines.append(batch(11, "BlockStored", self.chain[1:3]))
        else:
            lines.append(batch(11, "BlockStored", self.chain[1:4]))
        for line in lines:
            await send({"type": "http.response.body", "body": json.dumps(line).encode() + b"\n",
                        "more_body": True})  # fmt: skip
        if n == 2:
            await send({"type": "http.response.body", "body": b""})  # cut
            return
        while (await receive())["type"] != "http.disconnect":
            pass


async def test_subscription_resyncs_after_a_gap_and_a_cut_stream():
    source = FlakyEventSource()
    resyncs: list[str] = []
    with ServerThread(source) as server:
        index = KVIndex()
        async with httpx.AsyncClient() as client:
            subs = KVEventSubscriptions(index, client, retry_delay=0.05,
                                        on_resync=lambda url, reason: resyncs.append(reason))  # fmt: skip
            subs.sync([server.url])
            for _ in range(400):
                if index.matches(IDS, None, [server.url]).get(server.url) == 4:
                    break
                await asyncio.sleep(0.025)
            await subs.stop()
    assert source.subscriptions == 3
    assert resyncs == ["gap", "stream_end"]
    assert not index.synced(server.url)  # a stopped subscription leaves nothing behind


# --- replicas without KV events: prefix-hash, never an error ---------------------------------------------
def test_replicas_without_event_streams_are_routed_by_prefix_hash(tiny_tokenizer):
    from pagedserve.router.proxy import RouterApp, RouterConfig

    from pagedserve.testing.fake_openai import FakeOpenAI

    backends = [ServerThread(FakeOpenAI(name=f"b{i}")).start() for i in range(3)]
    config = RouterConfig(backends=[b.url for b in backends], tokenizer=tiny_tokenizer, model_name="m",
                          strategy="kv-events", health_interval=0.2)  # fmt: skip
    app = RouterApp(config)
    try:
        with ServerThread(app) as router, httpx.Client(base_url=router.url, timeout=30) as client:
            homes: dict[int, set[str]] = {}
            for user in range(3):
                for tenant in range(4):
                    messages = [
                        {"role": "system", "content": f"tenant {tenant} " + "policy text " * 40},
                        {"role": "user", "content": f"q{user}"},
                    ]
                    r = client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
                    assert r.status_code == 200, r.text
                    homes.setdefault(tenant, set()).add(r.json()["backend"])
            assert all(len(v) == 1 for v in homes.values()), homes  # prefix affinity as under prefix-hash
            assert not any(b["kv_events_synced"] for b in client.get("/backends").json())
            assert app.kv_index is not None and app.kv_index.size() == 0
            text = client.get("/metrics").text
            assert 'pagedserve_router_routing_decisions_total{reason="prefix_hit"} 8.0' in text
            assert 'pagedserve_router_routing_decisions_total{reason="kv_event_hit"} 0.0' in text
            assert "pagedserve_router_kv_synced_backends 0.0" in text
    finally:
        for b in backends:
            b.stop()


# --- real engines behind a real router ------------------------------------------------------------------
needs_engine = pytest.mark.skipif(
    importlib.util.find_spec("pagedserve.server.api.cli") is None, reason="`pagedserve serve` is missing"
)
MODEL = "SmolLM2-135M-Instruct"
ENGINE_FLAGS = ("--enable-kv-events", "--uvicorn-log-level", "warning", "--disable-access-log",
                "--shutdown-grace-period", "1", "--max-num-seqs", "4", "--api-key", "engine-key")  # fmt: skip
AUTH = {"Authorization": "Bearer engine-key"}


def quiet_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PAGEDSERVE_API_KEY": "engine-key"}  # fmt: skip


def chat(tenant: str, user: int) -> dict:
    rules = " ".join(f"Rule {k} of the {tenant} desk: answer briefly." for k in range(12))
    return {"model": MODEL, "max_tokens": 2, "temperature": 0, "messages": [
        {"role": "system", "content": f"You are the {tenant} desk. {rules}"},
        {"role": "user", "content": f"Question {user}: can you help me?"}]}  # fmt: skip


@pytest.fixture(scope="module")
def default_tokenizer() -> str:
    import pagedserve

    return str(pagedserve.default_model())


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("kv_engines")
    servers = [
        serve_process(logdir / f"engine{i}.log", *ENGINE_FLAGS, env=quiet_env()).start() for i in range(2)
    ]
    try:
        for server in servers:
            server.wait_ready(240)
        yield servers
    except Exception:
        print("\n".join(s.log_tail(3000) for s in servers))
        raise
    finally:
        for server in servers:
            server.stop()


def start_router(tmp_path, urls: list[str], tokenizer: str, name: str):
    flags = ["--tokenizer", tokenizer, "--model-name", MODEL, "--strategy", "kv-events",
             "--health-interval", "0.5", "--log-level", "warning"]  # fmt: skip
    router = router_process(tmp_path / f"{name}.log", urls, *flags, env=quiet_env()).start()
    router.wait_ready(60)
    return router


def router_state(router) -> tuple[dict[str, dict], dict[str, float]]:
    backends = {b["url"]: b for b in httpx.get(router.url + "/backends", timeout=10).json()}
    metrics: dict[str, float] = {}
    for line in httpx.get(router.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pagedserve_router_"):
            name, value = line.rsplit(" ", 1)
            metrics[name] = metrics.get(name, 0.0) + float(value)
    return backends, metrics


def decisions(router, reason: str) -> float:
    return router_state(router)[1].get(f'pagedserve_router_routing_decisions_total{{reason="{reason}"}}', 0.0)


def served_by(router, url: str) -> float:
    _, metrics = router_state(router)
    return metrics.get(f'pagedserve_router_requests_total{{backend="{url}",status="200"}}', 0.0)


def ring_owner(urls: list[str], tokenizer: str, body: dict) -> str:
    from pagedserve.router.hashing import PromptHasher

    b = Balancer()
    b.set_backends(urls)
    return b.choose(PromptHasher(tokenizer, MODEL, 16).hashes_for("/v1/chat/completions", body)[0]).url


def warm_off_ring(router, engines, tokenizer: str, prefix: str) -> tuple[str, str]:
    """(holder, tenant): a tenant whose ring owner is engine 0, warmed directly on engine 1 (the holder),
    and known to the router's index: only KV events can tell the router to send it there."""
    urls = [e.url for e in engines]
    tenant = next(
        t for t in (f"{prefix}{i}" for i in range(100)) if ring_owner(urls, tokenizer, chat(t, 0)) == urls[0]
    )
    before = indexed(router, urls[1])
    r = httpx.post(urls[1] + "/v1/chat/completions", json=chat(tenant, 0), headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    wait_until(lambda: indexed(router, urls[1]) > before, 30, "the holder's events reach the router")
    return urls[1], tenant


def indexed(router, url: str) -> int:
    return router_state(router)[0][url]["kv_indexed_blocks"]


def resyncs(router) -> float:
    _, metrics = router_state(router)
    return sum(v for k, v in metrics.items() if k.startswith("pagedserve_router_kv_event_resyncs_total"))


def post(router, body: dict) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text


def all_synced(router, urls: list[str]) -> bool:
    backends, _ = router_state(router)
    return all(backends[u]["kv_events_synced"] for u in urls)


@needs_engine
@pytest.mark.slow
@pytest.mark.heavy  # ~34 s of real engine and router restarts
def test_kv_events_routing_through_engine_and_router_restarts(engines, tmp_path, default_tokenizer):
    urls = [e.url for e in engines]
    router = start_router(tmp_path, urls, default_tokenizer, "router1")
    try:
        wait_until(lambda: all_synced(router, urls), 30, "both event streams synchronised")
        # A request sharing a prefix lands on the replica that really holds it, against the ring.
        holder, tenant = warm_off_ring(router, engines, default_tokenizer, "tenant")
        post(router, chat(tenant, 1))
        assert served_by(router, holder) == 1 and decisions(router, KV_EVENT_HIT) == 1

        # Engine restart: its stream ends, its entries go, requests still succeed on the other one...
        engines[1].kill()
        wait_until(lambda: not router_state(router)[0][holder]["kv_events_synced"], 30, "entries dropped")
        assert resyncs(router) >= 1
        post(router, chat(tenant, 2))
        assert served_by(router, urls[0]) >= 1
        # ...and it resynchronises, from its new (empty) cache, once it is back.
        engines[1].start()
        engines[1].wait_ready(240)
        wait_until(lambda: all_synced(router, urls), 60, "the restarted engine resynchronised")
        assert indexed(router, holder) == 0
        holder, tenant = warm_off_ring(router, engines, default_tokenizer, "again")
        post(router, chat(tenant, 1))
        assert decisions(router, KV_EVENT_HIT) == 2
    finally:
        router.stop()

    # Router restart: the new router's index comes from the engines' snapshots.
    router = start_router(tmp_path, urls, default_tokenizer, "router2")
    try:
        wait_until(lambda: all_synced(router, urls), 30, "snapshots received")
        assert indexed(router, holder) > 0
        post(router, chat(tenant, 2))
        assert served_by(router, holder) == 1 and decisions(router, KV_EVENT_HIT) == 1
    finally:
        router.stop()
