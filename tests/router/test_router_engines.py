"""The router in front of three real engine servers (the embedded model, on CPU), all on 127.0.0.1.

* Hit rate: a bounded multi-tenant workload (long shared system prompts, several users each,
  interleaved). From the engines' own vllm:prefix_cache_hits / vllm:prefix_cache_queries, the fleet's hit
  rate under prefix-hash must reach 0.9x what one replica alone gets on the same workload, and 1.5x
  round-robin's. Each mode gets its own system prompts (a per-mode salt leads them), so the modes never
  share cache entries and one fleet of engines serves all three.
* Faults: one replica is killed mid-run; every request that had not started streaming completes through
  retries; the dead replica leaves the ring and rejoins when it comes back.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import time

import httpx
import pytest

from pagedserve.testing.net import wait_until
from pagedserve.testing.processes import router_process, serve_process

pytestmark = [
    pytest.mark.slow,
    pytest.mark.heavy,  # ~75 s: a fleet of real engines behind the router
    pytest.mark.skipif(
        importlib.util.find_spec("pagedserve.server.api.cli") is None,
        reason="`pagedserve serve` (pagedserve.server.api.cli) does not exist yet",
    ),
]

MODEL = "SmolLM2-135M-Instruct"
TENANTS = 4  # coprime with 3 replicas, so round-robin does not pin tenants by accident
USERS = 4
TOPICS = ["billing", "shipping", "warranty", "accounts", "returns", "privacy", "loyalty", "repairs"]


def system_prompt(salt: str, tenant: int) -> str:
    topic = TOPICS[tenant % len(TOPICS)]
    rules = " ".join(
        f"Rule {k}: for {topic} questions, {['be brief', 'cite the policy', 'stay polite'][k % 3]}."
        for k in range(16)
    )
    return f"[{salt}] You are the {topic} desk of company number {tenant}. {rules}"


def chat(salt: str, tenant: int, user: int, stream: bool = False, max_tokens: int = 2) -> dict:
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "messages": [
            {"role": "system", "content": system_prompt(salt, tenant)},
            {
                "role": "user",
                "content": f"I am customer {user * 31 + tenant}. Question {user}: can you help me?",
            },
        ],
    }


def workload(salt: str) -> list[dict]:
    return [chat(salt, t, u) for u in range(USERS) for t in range(TENANTS)]  # tenants interleaved


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prefix_cache_"):
            name = line.split("{")[0].split(" ")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def fleet_counters(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        m = scrape(url)
        hits += m.get("vllm:prefix_cache_hits_total", 0.0)
        queries += m.get("vllm:prefix_cache_queries_total", 0.0)
    return hits, queries


def engine_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


ENGINE_FLAGS = ("--uvicorn-log-level", "warning", "--disable-access-log", "--shutdown-grace-period", "1")


class Engines:
    """Three `pagedserve serve` replicas on 127.0.0.1, each with its own log."""

    def __init__(self, tmp_path_factory) -> None:
        logdir = tmp_path_factory.mktemp("engines")
        self.servers = [
            serve_process(logdir / f"engine{i}.log", *ENGINE_FLAGS, env=engine_env()).start()
            for i in range(3)
        ]
        self.urls = [server.url for server in self.servers]

    def log_tail(self) -> str:
        return "\n".join(f"--- engine{i}:\n" + s.log_tail(3000) for i, s in enumerate(self.servers))

    def close(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture(scope="module")
def default_tokenizer() -> str:
    import pagedserve

    return pagedserve.default_model()  # the engines' model folder: its tokenizer and chat template


@pytest.fixture(scope="module")
def engines(tmp_path_factory, default_tokenizer):
    e = Engines(tmp_path_factory)
    started = time.time()
    try:
        for server in e.servers:
            server.wait_ready(240)
        print(f"3 engines up in {time.time() - started:.0f} s")
        yield e
    except Exception:
        print(e.log_tail())
        raise
    finally:
        e.close()


@pytest.fixture()
def router_factory(tmp_path, default_tokenizer):
    routers = []

    def make(backends: list[str], strategy: str) -> str:
        flags = ["--tokenizer", default_tokenizer, "--model-name", MODEL, "--strategy", strategy,
                 "--health-interval", "0.5", "--health-timeout", "5", "--log-level", "warning"]  # fmt: skip
        log = tmp_path / f"router-{strategy}.log"
        router = router_process(log, backends, *flags, env=engine_env(), ready_path="/health").start()
        routers.append(router)
        router.wait_ready(60)
        return router.url

    yield make
    for router in routers:
        router.stop()


def run_workload(base_url: str, requests: list[dict]) -> None:
    with httpx.Client(base_url=base_url, timeout=180) as c:
        for body in requests:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text


def measure(urls: list[str], base_url: str, requests: list[dict]) -> float:
    h0, q0 = fleet_counters(urls)
    run_workload(base_url, requests)
    h1, q1 = fleet_counters(urls)
    assert q1 > q0
    return (h1 - h0) / (q1 - q0)


def test_prefix_hash_keeps_the_fleet_hit_rate_of_a_single_replica(engines, router_factory):
    started = time.time()
    # One replica alone (direct): the best a fleet can do on this workload.
    single = measure(engines.urls, engines.urls[0], workload("single"))
    prefix = measure(engines.urls, router_factory(engines.urls, "prefix-hash"), workload("prefix"))
    rr = measure(engines.urls, router_factory(engines.urls, "round-robin"), workload("rr"))
    print(
        f"fleet prefix-cache hit rate: single replica {single:.3f}, prefix-hash {prefix:.3f}, "
        f"round-robin {rr:.3f} ({time.time() - started:.0f} s)"
    )
    assert prefix >= 0.9 * single, (prefix, single)
    assert prefix >= 1.5 * rr, (prefix, rr)


def ring_owner(urls: list[str], tokenizer: str, body: dict) -> str:
    """Which replica the router's ring gives this prompt when nothing is cached (the router's own code)."""
    from pagedserve.router.balancer import Balancer
    from pagedserve.router.hashing import PromptHasher

    hashes, _ = PromptHasher(tokenizer, MODEL, 16).hashes_for("/v1/chat/completions", body)
    b = Balancer()
    b.set_backends(urls)
    return b.choose(hashes).url


async def stream_one(client: httpx.AsyncClient, body: dict) -> dict:
    rec = {"started": False, "done": False, "status": None, "error": None}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            rec["status"] = r.status_code
            async for line in r.aiter_lines():
                if not line:
                    continue
                rec["started"] = True
                if line == "data: [DONE]":
                    rec["done"] = True
                elif '"error"' in line:
                    rec["error"] = line
    except httpx.HTTPError as exc:
        rec["error"] = repr(exc)
    return rec


def router_backends(router: str) -> dict[str, dict]:
    return {b["url"]: b for b in httpx.get(router + "/backends", timeout=10).json()}


def test_killed_replica_is_retried_around_and_rejoins(engines, router_factory, default_tokenizer):
    router = router_factory(engines.urls, "prefix-hash")
    victim = 1
    victim_url = engines.urls[victim]
    bodies = [chat("fault", t, u, stream=True, max_tokens=4) for u in range(3) for t in range(6)]

    async def run() -> list[dict]:
        sem = asyncio.Semaphore(6)
        async with httpx.AsyncClient(base_url=router, timeout=180) as client:

            async def limited(body):
                async with sem:
                    return await stream_one(client, body)

            tasks = [asyncio.create_task(limited(b)) for b in bodies]
            await asyncio.sleep(1.5)  # requests queued and running on every replica
            engines.servers[victim].kill()
            return await asyncio.gather(*tasks)

    started = time.time()
    results = asyncio.run(run())
    retries = sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(router + "/metrics").text.splitlines()
        if line.startswith("pagedserve_router_retries_total")
    )
    print(
        f"fault run: {len(results)} streams in {time.time() - started:.0f} s, "
        f"{sum(not r['done'] for r in results)} cut mid-stream, {retries:.0f} attempts retried"
    )
    failed = [r for r in results if not (r["status"] == 200 and r["done"] and r["error"] is None)]
    # Only streams that had already started on the dead replica may fail; everything else was retried.
    assert all(r["started"] for r in failed), failed
    assert len(failed) <= 6, failed  # at most the concurrency
    assert sum(r["done"] for r in results) >= len(bodies) - len(failed)

    # The dead replica has left the ring...
    wait_until(lambda: not router_backends(router)[victim_url]["ready"], 10, "the dead replica leaves")
    metrics = httpx.get(router + "/metrics").text
    assert "pagedserve_router_ready_backends 2.0" in metrics
    # ...new prompts whose ring owner it is are served by the others meanwhile...
    salt = next(
        s
        for s in (f"owner{i}" for i in range(200))
        if ring_owner(engines.urls, default_tokenizer, chat(s, 0, 0)) == victim_url
    )
    with httpx.Client(base_url=router, timeout=180) as c:
        assert c.post("/v1/chat/completions", json=chat(salt, 0, 0)).status_code == 200
    # ...and it rejoins when it comes back, without restarting the router.
    engines.servers[victim].start()
    started = time.time()
    engines.servers[victim].wait_ready(240)
    print(f"replica restarted in {time.time() - started:.0f} s")
    wait_until(lambda: router_backends(router)[victim_url]["ready"], 10, "the replica rejoins")
    before = router_backends(router)[victim_url]
    fresh = next(
        s
        for s in (f"back{i}" for i in range(200))
        if ring_owner(engines.urls, default_tokenizer, chat(s, 0, 0)) == victim_url
    )
    with httpx.Client(base_url=router, timeout=180) as c:
        r = c.post("/v1/chat/completions", json=chat(fresh, 0, 0))
        assert r.status_code == 200
    metrics = httpx.get(router + "/metrics").text
    served = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("pagedserve_router_requests_total")
        and f'backend="{victim_url}"' in line
        and 'status="200"' in line
    )
    assert served >= 1, json.dumps(before)


# --- a client that goes away aborts the engine's request, whatever the stage (issue 14, item 7) -----------
ABORT_BOUND_S = 15  # far less than the long generation below takes (thousands of tokens on CPU)


def engine_gauge(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def long_generation(stream: bool) -> dict:
    return {
        "model": MODEL,
        "prompt": "Count from one to ten thousand: one, two, three,",
        "max_tokens": 1900,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


@pytest.fixture(scope="module")
def one_seat_engine(tmp_path_factory):
    """One engine that runs one request at a time, so a second one waits in its queue."""
    log = tmp_path_factory.mktemp("one_seat") / "engine.log"
    flags = ("--max-num-seqs", "1", "--max-model-len", "2048", *ENGINE_FLAGS)
    with serve_process(log, *flags, env=engine_env()) as engine:
        engine.wait_ready(240)
        yield engine


def test_client_disconnect_aborts_the_engine_request_at_every_stage(
    one_seat_engine, router_factory, raw_post
):
    engine = one_seat_engine.url
    router = router_factory([engine], "prefix-hash")

    def running() -> float:
        return engine_gauge(engine, "vllm:num_requests_running")

    def waiting() -> float:
        return engine_gauge(engine, "vllm:num_requests_waiting")

    # Mid-stream: A streams, holding the engine's only seat.
    a = raw_post(router, "/v1/completions", long_generation(stream=True))
    received = b""
    while b"data: " not in received:
        chunk = a.recv(65536)
        assert chunk, received
        received += chunk
    assert running() == 1
    # Before the first chunk: B waits in the engine's queue, its response not started (the router
    # commits the answer only with its first chunk).
    b = raw_post(router, "/v1/completions", long_generation(stream=True))
    wait_until(lambda: waiting() == 1, 30, "B waits in the engine")
    b.close()
    wait_until(lambda: waiting() == 0, ABORT_BOUND_S, "B aborted while waiting")
    assert running() == 1  # A is untouched
    a.close()
    wait_until(lambda: running() == 0, ABORT_BOUND_S, "A aborted mid-stream")
    # Before the response's head: a non-streamed generation answers only at its end.
    c = raw_post(router, "/v1/completions", long_generation(stream=False))
    wait_until(lambda: running() == 1, 30, "C runs")
    c.close()
    wait_until(lambda: running() == 0 and waiting() == 0, ABORT_BOUND_S, "C aborted before its answer")
    # The router counted all three, and holds nothing for them.
    text = httpx.get(router + "/metrics", timeout=10).text
    counted = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pagedserve_router_requests_total{") and 'status="client_disconnect"' in line
    ]
    assert sum(counted) == 3, text
    assert router_backends(router)[engine]["in_flight"] == 0
