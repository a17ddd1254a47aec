"""LoRA adapters across the fleet: each replica's adapters read from its /v1/models, a request for an
adapter sent only to the replicas that hold it (bounded load among them), prefix hashes rooted at the
adapter, the router's own /v1/models the union, unknown models 404 (router/adapters.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from pagedserve.common.block_hash import chain_hashes, salted_root, seed_hash
from pagedserve.router.adapters import (
    ADAPTER,
    BASE,
    NOT_FOUND,
    NOT_LOADED,
    ServedModels,
    parse_models,
    route_for,
)
from pagedserve.router.hashing import PromptHasher
from pagedserve.router.kv_index import KVIndex
from pagedserve.router.proxy import RouterApp, RouterConfig

from pagedserve.testing.fake_openai import FakeOpenAI, wait_router_polled
from pagedserve.testing.net import wait_until
from pagedserve.testing.prometheus_text import metric_value
from pagedserve.testing.server_thread import ServerThread

BASE_MODEL = "m"
# 6 adapters over 3 replicas, each on 1 or 2 of them.
PLACEMENT = {
    "sql": (0,),
    "legal": (1,),
    "med": (2,),
    "chat-fr": (0, 1),
    "chat-de": (1, 2),
    "code": (0, 2),
}


def chat(model: str, tenant: int, user: int = 0) -> dict:
    system = f"You answer for tenant {tenant} with the house style, briefly and politely. " * 3
    messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {user}"}]
    return {"model": model, "messages": messages, "max_tokens": 2}


class LoraFleet:
    """3 fake engine replicas with PLACEMENT's adapters, and a router in front (this process)."""

    def __init__(self, tokenizer: str, **cfg) -> None:
        self.backends = []
        for i in range(3):
            adapters = {name: f"/adapters/{name}" for name, on in PLACEMENT.items() if i in on}
            app = FakeOpenAI(name=f"r{i}", served_model_name=BASE_MODEL, enable_lora=True, adapters=adapters)
            self.backends.append(ServerThread(app).start())
        config = RouterConfig(
            backends=[b.url for b in self.backends],
            tokenizer=tokenizer,
            model_name=BASE_MODEL,
            health_interval=0.2,
            health_timeout=5.0,  # as the proxy tests' fleet: a slow poll under load is not a dead replica
            **cfg,
        )
        self.app = RouterApp(config)
        self.router = ServerThread(self.app).start()
        self.client = httpx.Client(base_url=self.router.url, timeout=30)
        wait_router_polled(self.app, [b.url for b in self.backends])

    def close(self) -> None:
        self.client.close()
        self.router.stop()
        for b in self.backends:
            b.stop()


@pytest.fixture()
def lora_fleet(tiny_tokenizer):
    fleets: list[LoraFleet] = []

    def make(**cfg) -> LoraFleet:
        fleets.append(LoraFleet(tiny_tokenizer, **cfg))
        return fleets[-1]

    yield make
    for f in fleets:
        f.close()


def test_each_adapter_lands_only_on_its_replicas(lora_fleet):
    f = lora_fleet()
    holders = {name: {f"r{i}" for i in on} for name, on in PLACEMENT.items()}
    seen: dict[str, set[str]] = {name: set() for name in PLACEMENT}
    for name in PLACEMENT:
        for tenant in range(8):  # distinct prefixes: the ring spreads them over the holders
            r = f.client.post("/v1/chat/completions", json=chat(name, tenant))
            assert r.status_code == 200, r.text
            seen[name].add(r.json()["backend"])
    for name, backends in seen.items():
        assert backends <= holders[name], (name, backends)
    # adapters on two replicas use both of them
    assert all(seen[name] == holders[name] for name, on in PLACEMENT.items() if len(on) == 2), seen
    # base-model requests still go anywhere
    base = {
        f.client.post("/v1/chat/completions", json=chat(BASE_MODEL, t)).json()["backend"] for t in range(12)
    }
    assert len(base) >= 2
    # the engines counted each adapter's requests where they ran (pagedserve:lora_requests_total)
    for b in f.backends:
        assert set(b.app.lora_requests) <= set(b.app.adapters)
    metrics = f.client.get("/metrics").text
    assert (
        metric_value(metrics, "pagedserve_router_adapter_requests_total", lora_name="code", outcome="routed")
        == 8
    )
    assert metric_value(metrics, "pagedserve_router_adapter_replicas", lora_name="chat-de") == 2
    assert metric_value(metrics, "pagedserve_router_adapter_replicas", lora_name="sql") == 1


def test_adapter_load_stays_bounded_among_holders(lora_fleet):
    """One hot prefix of an adapter on 2 replicas: the prefix's home takes requests up to the load bound,
    the other holder the overflow; the third replica, without the adapter, none."""
    f = lora_fleet(min_load_cap=2.0)
    for b in f.backends:
        b.app.first_delay = 0.5
    with ThreadPoolExecutor(12) as pool:
        answers = list(
            pool.map(lambda u: f.client.post("/v1/chat/completions", json=chat("code", 1, u)), range(12))
        )
    backends = [r.json()["backend"] for r in answers]
    assert {r.status_code for r in answers} == {200}
    assert set(backends) == {"r0", "r2"}, backends  # both holders, never r1
    # the bound among the 2 holders, max(2, 1.25 * (in flight + 1) / 2), with all 12 in flight at the end
    assert max(backends.count("r0"), backends.count("r2")) <= 1.25 * (12 + 1) / 2, backends


def test_runtime_load_unload_and_unknown_models(lora_fleet):
    f = lora_fleet()
    # not served anywhere: 404 model_not_found in OpenAI's shape, from the router itself
    r = f.client.post("/v1/chat/completions", json=chat("late", 0))
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    assert not any(b.app.received for b in f.backends)

    # the router's /v1/models: the base once and every adapter with its parent
    cards = f.client.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards if c["parent"] is None] == [BASE_MODEL]
    assert {c["id"]: c["parent"] for c in cards if c["parent"]} == dict.fromkeys(PLACEMENT, BASE_MODEL)

    # loaded at runtime on r1 (as the operator does): routable after a poll, to r1 only
    load = httpx.post(
        f.backends[1].url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "/adapters/late"}
    )
    assert load.status_code == 200, load.text
    wait_until(lambda: "late" in {c["id"] for c in f.client.get("/v1/models").json()["data"]}, 10, "a poll")
    backends = {
        f.client.post("/v1/chat/completions", json=chat("late", t)).json()["backend"] for t in range(6)
    }
    assert backends == {"r1"}

    # r1 becomes unhealthy: the adapter exists but no ready replica holds it -> 503 with Retry-After
    f.backends[1].app.health_status = 503
    wait_until(lambda: not f.app.balancer.backends[f.backends[1].url].ready, 10, "r1 out of the ring")
    r = f.client.post("/v1/chat/completions", json=chat("late", 0))
    assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
    f.backends[1].app.health_status = 200

    # unloaded: after a poll, unknown again. Waiting on the router's list, not on a 404: until the poll, r1
    # itself answers 404 for the adapter it dropped, which is not the router's model_not_found.
    assert (
        httpx.post(f.backends[1].url + "/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code
        == 200
    )
    wait_until(lambda: "late" not in {c["id"] for c in f.client.get("/v1/models").json()["data"]}, 10,
               "unload seen")  # fmt: skip
    r = f.client.post("/v1/chat/completions", json=chat("late", 0))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert metric_value(f.client.get("/metrics").text, "pagedserve_router_model_not_found_total") >= 2


def test_adapter_prefix_hashes_never_collide_with_base_or_other_adapters(tiny_tokenizer):
    hasher = PromptHasher(tiny_tokenizer, BASE_MODEL, block_size=4)
    body = chat("x", 0)
    ids = hasher.token_ids_for("/v1/chat/completions", body)
    base = hasher.hashes_of(ids, None)
    sql = hasher.hashes_of(ids, None, "sql")
    assert len(base) == len(sql) > 2
    assert not set(base) & set(sql)
    assert not set(sql) & set(hasher.hashes_of(ids, None, "legal"))
    assert sql == hasher.hashes_of(ids, None, "sql")  # stable: every router replica agrees
    assert not set(sql) & set(hasher.hashes_of(ids, "tenant-salt", "sql"))

    # kv-events: the chain the index matches is the engine's (common/block_hash.py salted_root)
    root = seed_hash("engine-seed")
    engine_root = salted_root(root, "s", "sql")
    engine_hashes = chain_hashes(ids, 4, engine_root)
    index = KVIndex()
    events = [{"type": "BlockStored", "block_hashes": [h.hex() for h in engine_hashes]}]
    index.apply("u", {"snapshot": True, "hash_root": root.hex(), "block_size": 4, "seq": 0, "events": events})
    assert index.matches(ids, "s", ["u"], "sql") == {"u": len(engine_hashes)}
    assert index.matches(ids, "s", ["u"]) == {"u": 0}
    assert index.matches(ids, "s", ["u"], "legal") == {"u": 0}


def test_route_for_rules():
    a = ServedModels(frozenset({"m"}), frozenset({"x"}))
    b = ServedModels(frozenset({"m"}), frozenset())
    assert route_for("x", {"a": (True, a), "b": (True, b)}, "m").kind == ADAPTER
    assert route_for("x", {"a": (True, a), "b": (True, b)}, "m").holders == {"a"}
    assert route_for("x", {"a": (False, a), "b": (True, b)}, "m").kind == NOT_LOADED
    assert route_for("y", {"a": (True, a), "b": (True, b)}, "m").kind == NOT_FOUND
    assert route_for("y", {"b": (True, b)}, "m").kind == BASE  # no adapters anywhere: as before LoRA
    assert (
        route_for("y", {"a": (True, a), "b": (True, None)}, "m").kind == BASE
    )  # a list unknown: the engine decides
    assert route_for("m", {"a": (True, a)}, "").kind == BASE  # a replica's base name
    assert route_for(None, {"a": (True, a)}, "m").kind == BASE
    assert parse_models(
        {"data": [{"id": "m", "parent": None}, {"id": "x", "parent": "m"}, 3]}
    ) == ServedModels(
        frozenset({"m"}), frozenset({"x"}), ({"id": "m", "parent": None}, {"id": "x", "parent": "m"})
    )
    assert parse_models({"object": "list"}) is None


def test_router_without_model_lists_passes_models_through(tiny_tokenizer):
    """Replicas whose /v1/models the router cannot read (404 here) keep the old behaviour: every model
    name goes to a replica, and GET /v1/models is proxied."""

    class NoModels(FakeOpenAI):
        async def __call__(self, scope, receive, send):
            if scope["type"] == "http" and scope["path"] == "/v1/models":
                await self._reply(send, 404, {"error": {"message": "no"}})
                return
            await super().__call__(scope, receive, send)

    backend = ServerThread(NoModels(name="n0")).start()
    app = RouterApp(RouterConfig(backends=[backend.url], tokenizer=tiny_tokenizer, model_name=BASE_MODEL))
    router = ServerThread(app).start()
    try:
        with httpx.Client(base_url=router.url, timeout=10) as client:
            assert client.post("/v1/chat/completions", json=chat("anything", 0)).status_code == 200
            assert client.get("/v1/models").status_code == 404
    finally:
        router.stop()
        backend.stop()
