"""The proxy end to end against stand-in backends on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from pagedserve.router.proxy import RouterApp, RouterConfig

from pagedserve.testing.fake_openai import FakeOpenAI, wait_router_polled
from pagedserve.testing.net import free_port
from pagedserve.testing.processes import ServerProcess, fake_openai_process
from pagedserve.testing.prometheus_text import metric_value
from pagedserve.testing.server_thread import ServerThread

SYSTEM = "You are the assistant of tenant {t}. Follow the house rules: be brief, be kind, cite sources. " * 3


def body(t: int, u: int, stream: bool = False) -> dict:
    return {
        "model": "m",
        "stream": stream,
        "messages": [
            {"role": "system", "content": SYSTEM.format(t=t)},
            {"role": "user", "content": f"user {u} asks question {u * 7}"},
        ],
    }


class Fleet:
    def __init__(self, tokenizer: str, n: int = 3, extra_urls=(), **cfg) -> None:
        self.backends = [ServerThread(FakeOpenAI(name=f"b{i}")).start() for i in range(n)]
        config = RouterConfig(
            backends=[b.url for b in self.backends] + list(extra_urls),
            tokenizer=tokenizer,
            model_name="m",
            health_interval=cfg.pop("health_interval", 0.2),
            # Generous: under CI's load a slow poll of an in-process replica must not take it out of the
            # ring (three timeouts in a row do), or routing tests see one replica where there are three.
            health_timeout=cfg.pop("health_timeout", 5.0),
            **cfg,
        )
        self.app = RouterApp(config)
        self.router = ServerThread(self.app).start()
        self.client = httpx.Client(base_url=self.router.url, timeout=30)
        wait_router_polled(self.app, [b.url for b in self.backends])

    def by_name(self, name: str) -> ServerThread:
        return next(b for b in self.backends if b.app.name == name)

    def metrics(self) -> str:
        return self.client.get("/metrics").text

    def close(self) -> None:
        self.client.close()
        self.router.stop()
        for b in self.backends:
            b.stop()


@pytest.fixture()
def fleet(tiny_tokenizer):
    fleets = []

    def make(**kw):
        f = Fleet(tiny_tokenizer, **kw)
        fleets.append(f)
        return f

    yield make
    for f in fleets:
        f.close()


def test_same_prefix_same_replica_and_tenants_spread(fleet):
    f = fleet(n=3)
    homes = {}
    for u in range(4):
        for t in range(6):
            r = f.client.post("/v1/chat/completions", json=body(t, u))
            assert r.status_code == 200, r.text
            homes.setdefault(t, set()).add(r.json()["backend"])
    assert all(len(v) == 1 for v in homes.values()), homes  # every tenant sticks to one replica
    assert len({next(iter(v)) for v in homes.values()}) >= 2  # and tenants are spread over replicas
    m = f.metrics()
    assert metric_value(m, "pagedserve_router_routing_decisions_total", reason="hash_ring") == 6
    assert metric_value(m, "pagedserve_router_routing_decisions_total", reason="prefix_hit") == 18
    assert metric_value(m, "pagedserve_router_matched_prefix_ratio_count") == 24
    assert metric_value(m, "pagedserve_router_requests_total", status="200") == 24
    assert metric_value(m, "pagedserve_router_ready_backends") == 3
    assert metric_value(m, "pagedserve_router_in_flight_requests") == 0


def test_streams_pass_through_chunk_by_chunk(fleet):
    f = fleet(n=1)
    b = f.backends[0].app
    b.tokens, b.token_delay = 4, 0.3
    arrivals = []
    with f.client.stream("POST", "/v1/chat/completions", json=body(0, 0, stream=True)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-backend"] == "b0"
        for line in r.iter_lines():
            if line:
                arrivals.append((time.monotonic(), line))
    assert [line for _, line in arrivals][-1] == "data: [DONE]"
    assert len(arrivals) == 5
    # Not buffered: the first chunk arrived long before the last was produced.
    assert arrivals[-1][0] - arrivals[0][0] > 0.6


def test_headers_query_and_methods_pass_through(fleet):
    f = fleet(n=1)
    r = f.client.post(
        "/v1/completions?foo=bar",
        json={"prompt": "hello " * 20},
        headers={"Authorization": "Bearer secret-key", "X-Custom": "1"},
    )
    assert r.status_code == 200
    seen = f.backends[0].app.received[-1]
    assert seen["authorization"] == "Bearer secret-key"
    assert seen["query"] == "foo=bar"
    assert seen["forwarded_for"] == "127.0.0.1"
    assert json.loads(seen["body"]) == {"prompt": "hello " * 20}
    r = f.client.get("/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "b0"
    r = f.client.get("/v1/nope")
    assert r.status_code == 404  # the backend's own answer, passed through


def test_long_prompts_are_hashed_off_the_event_loop(fleet):
    f = fleet(n=2)
    long_doc = "A long shared document. " * 4000  # ~100 KB: tokenized in a worker thread
    first = f.client.post(
        "/v1/chat/completions",
        json=body(0, 0)
        | {"messages": [{"role": "system", "content": long_doc}, {"role": "user", "content": "summarize"}]},
    )
    second = f.client.post(
        "/v1/chat/completions",
        json=body(0, 0)
        | {"messages": [{"role": "system", "content": long_doc}, {"role": "user", "content": "translate"}]},
    )
    assert first.status_code == second.status_code == 200
    assert first.json()["backend"] == second.json()["backend"]
    m = f.metrics()
    assert metric_value(m, "pagedserve_router_routing_decisions_total", reason="prefix_hit") == 1
    assert metric_value(m, "pagedserve_router_matched_prefix_ratio_sum") > 0.99


def test_a_tokenizer_that_cannot_load_falls_back_to_bytes(tmp_path):
    app = RouterApp(RouterConfig(backends=["http://127.0.0.1:1"], tokenizer=str(tmp_path / "missing")))
    assert app.hasher is not None and app.hasher.tokenizer is None
    assert app.hasher.hashes_for("/v1/completions", {"prompt": "x" * 200})[0]


def test_router_api_key(fleet):
    f = fleet(n=1, api_key="k1")
    r = f.client.post("/v1/chat/completions", json=body(0, 0))
    assert r.status_code == 401
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    r = f.client.post("/v1/chat/completions", json=body(0, 0), headers={"Authorization": "Bearer k1"})
    assert r.status_code == 200
    assert f.backends[0].app.received[-1]["authorization"] == "Bearer k1"
    assert f.client.get("/health").status_code == 200  # probes need no key


def test_503_is_retried_on_the_next_choice(fleet):
    f = fleet(n=3)
    first = f.client.post("/v1/chat/completions", json=body(1, 0)).json()["backend"]
    f.by_name(first).app.fail_503 = 1
    r = f.client.post("/v1/chat/completions", json=body(1, 1))
    assert r.status_code == 200 and r.json()["backend"] != first
    m = f.metrics()
    assert metric_value(m, "pagedserve_router_retries_total", reason="status_503") == 1
    # Every replica answering 503: the last answer is passed through.
    for b in f.backends:
        b.app.fail_503 = 5
    r = f.client.post("/v1/chat/completions", json=body(1, 2))
    assert r.status_code == 503


def test_refused_connection_is_retried_and_the_replica_leaves_the_ring(fleet):
    dead = f"http://127.0.0.1:{free_port()}"
    f = fleet(n=2, extra_urls=[dead], health_interval=30)
    # The start-up health round already noticed; force it back in to exercise the request path.
    f.app.balancer.set_healthy(dead, True)
    # Which tenants hash to the dead replica depends on the ports drawn: send tenants until one has
    # (each has a 1 in 3 chance), every answer a 200 through the retry.
    for t in range(64):
        r = f.client.post("/v1/chat/completions", json=body(t, 0))
        assert r.status_code == 200
        if dead not in f.app.balancer.ready_urls():
            break
    assert dead not in f.app.balancer.ready_urls()
    assert metric_value(f.metrics(), "pagedserve_router_retries_total") >= 1
    backends = {b["url"]: b for b in f.client.get("/backends").json()}
    assert backends[dead]["ready"] is False
    assert f.client.get("/health").json()["ready_backends"] == 2


def test_failed_requests_teach_no_affinity(fleet):
    """A replica that refused (4xx) or failed (5xx) a request cached nothing of it: the router must not
    remember its blocks there, or the next requests of that prefix would chase a cache that is not."""
    f = fleet(n=1)
    b = f.backends[0].app

    def indexed() -> int:
        return f.client.get("/backends").json()[0]["indexed_blocks"]

    b.api_key = "secret"
    assert f.client.post("/v1/chat/completions", json=body(0, 0)).status_code == 401
    b.api_key, b.fail_503 = None, 1  # one replica: the 503 cannot be retried elsewhere
    assert f.client.post("/v1/chat/completions", json=body(0, 0)).status_code == 503
    assert indexed() == 0
    assert f.client.post("/v1/chat/completions", json=body(0, 0)).status_code == 200
    assert indexed() > 0


def test_json_nested_past_the_parser_stack_is_forwarded_not_a_500(fleet):
    """json.loads raises RecursionError (not ValueError) on deep nesting; the router hashed nothing and
    crashed with a bare 500 before. It must forward the body and let the engine answer."""
    f = fleet()
    headers = {"content-type": "application/json"}
    r = f.client.post("/v1/chat/completions", content=b"[" * 20000, headers=headers)
    assert r.status_code == 400, r.text  # the backend's answer


def test_no_ready_backend_gives_an_openai_error(fleet):
    dead = f"http://127.0.0.1:{free_port()}"
    f = fleet(n=0, extra_urls=[dead])
    r = f.client.post("/v1/chat/completions", json=body(0, 0))
    assert r.status_code == 503
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "server_error" and "no backend" in err["message"]
    assert f.client.get("/ready").status_code == 503
    assert f.client.get("/health").status_code == 200
    r = f.client.get("/elsewhere")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_router_metrics_names(fleet):
    f = fleet(n=2)
    f.client.post("/v1/chat/completions", json=body(0, 0))
    m = f.metrics()
    for name in (
        "pagedserve_router_requests_total",
        "pagedserve_router_routing_decisions_total",
        "pagedserve_router_matched_prefix_ratio_bucket",
        "pagedserve_router_in_flight_requests",
        "pagedserve_router_ready_backends",
        "pagedserve_router_backend_ready",
        "pagedserve_router_request_duration_seconds_bucket",
    ):
        assert name in m, name
    for reason in ("prefix_hit", "hash_ring", "overload_fallback"):
        assert f'pagedserve_router_routing_decisions_total{{reason="{reason}"}}' in m


def test_client_disconnect_mid_stream_closes_the_upstream_request(fleet):
    f = fleet(n=1)
    b = f.backends[0].app
    b.tokens, b.token_delay = 50, 0.05
    with f.client.stream("POST", "/v1/chat/completions", json=body(0, 0, stream=True)) as r:
        next(r.iter_raw())
    deadline = time.time() + 5
    while time.time() < deadline:
        m = f.metrics()
        if metric_value(m, "pagedserve_router_requests_total", status="client_disconnect") == 1:
            break
        time.sleep(0.05)
    assert metric_value(m, "pagedserve_router_requests_total", status="client_disconnect") == 1
    assert metric_value(m, "pagedserve_router_in_flight_requests") == 0


def wait_for_metric(f: Fleet, name: str, value: float, timeout: float = 10, **labels) -> str:
    deadline = time.monotonic() + timeout
    while metric_value(m := f.metrics(), name, **labels) != value and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric_value(m, name, **labels) == value, m
    return m


def test_client_leaving_while_the_router_connects_stops_the_attempt(fleet, raw_post):
    """A replica whose accept queue is full never completes the connection: the router's attempt waits
    out its connect timeout (60 s here) unless the client's departure stops it."""
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(0)
    filler = socket.create_connection(blackhole.getsockname())  # fills the queue: later SYNs are dropped
    url = f"http://127.0.0.1:{blackhole.getsockname()[1]}"
    try:
        f = fleet(n=0, extra_urls=[url], connect_timeout=60, unhealthy_after=1000)
        client = raw_post(f.router.url, "/v1/chat/completions", body(0, 0))
        wait_for_metric(f, "pagedserve_router_in_flight_requests", 1)
        client.close()
        m = wait_for_metric(f, "pagedserve_router_requests_total", 1, status="client_disconnect")
        assert metric_value(m, "pagedserve_router_in_flight_requests") == 0
    finally:
        filler.close()
        blackhole.close()


def test_client_leaving_mid_request_body_forwards_nothing(fleet, raw_post):
    f = fleet(n=1)
    b = f.backends[0].app
    client = raw_post(f.router.url, "/v1/chat/completions", body(0, 0), body_bytes=20)
    client.close()  # 20 bytes of a longer body, then gone
    wait_for_metric(f, "pagedserve_router_requests_total", 1, status="client_disconnect")
    assert b.received == [] and b.stats.requests == 0  # a truncated body never reaches a replica


def test_many_concurrent_streams(fleet):
    import asyncio

    f = fleet(n=3)
    for b in f.backends:
        b.app.tokens, b.app.token_delay = 5, 0.01

    async def one(client, i):
        async with client.stream("POST", "/v1/chat/completions", json=body(i % 5, i, stream=True)) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]" and len(lines) == 6

    async def go():
        async with httpx.AsyncClient(base_url=f.router.url, timeout=30) as client:
            await asyncio.gather(*(one(client, i) for i in range(60)))

    asyncio.run(go())
    assert metric_value(f.metrics(), "pagedserve_router_requests_total", status="200") == 60


# --- replicas that die ------------------------------------------------------------------------------------
@pytest.fixture()
def spawn_backend(tmp_path):
    """Fake replicas in their own processes, so that a test can SIGKILL one."""
    started: list[ServerProcess] = []

    def spawn(name: str, port: int) -> ServerProcess:
        backend = fake_openai_process(tmp_path / f"{name}.log", "--name", name, port=port).start()
        started.append(backend)
        backend.wait_ready(20)
        return backend

    yield spawn
    for backend in started:
        backend.stop()


def test_replica_dying_before_the_first_byte_is_retried(tiny_tokenizer, spawn_backend):
    ports = [free_port(), free_port()]
    procs = [spawn_backend(f"p{i}", port) for i, port in enumerate(ports)]
    app = RouterApp(
        RouterConfig(
            backends=[f"http://127.0.0.1:{p}" for p in ports],
            tokenizer=tiny_tokenizer,
            model_name="m",
            health_interval=0.2,
            health_timeout=1.0,
        )
    )
    router = ServerThread(app).start()
    try:
        with httpx.Client(base_url=router.url, timeout=30) as c:
            owner = c.post("/v1/chat/completions", json=body(3, 0)).json()["backend"]
            victim = procs[int(owner[1])]
            victim_port = ports[int(owner[1])]
            httpx.post(f"http://127.0.0.1:{victim_port}/_control", json={"first_delay": 5.0})
            result = {}

            def call():
                result["r"] = c.post("/v1/chat/completions", json=body(3, 1, stream=True))

            t = threading.Thread(target=call)
            t.start()
            time.sleep(0.5)  # the request is waiting at the victim
            victim.kill()
            t.join(20)
            r = result["r"]
            assert r.status_code == 200
            assert "data: [DONE]" in r.text and f'"backend": "p{1 - int(owner[1])}"' in r.text
            # The dead replica leaves the ring...
            deadline = time.time() + 5
            while time.time() < deadline and f"http://127.0.0.1:{victim_port}" in app.balancer.ready_urls():
                time.sleep(0.05)
            assert f"http://127.0.0.1:{victim_port}" not in app.balancer.ready_urls()
            # ...and rejoins when it comes back, taking its prefixes back from the ring.
            spawn_backend(owner, victim_port)
            deadline = time.time() + 5
            while (
                time.time() < deadline and f"http://127.0.0.1:{victim_port}" not in app.balancer.ready_urls()
            ):
                time.sleep(0.05)
            assert f"http://127.0.0.1:{victim_port}" in app.balancer.ready_urls()
            assert c.post("/v1/chat/completions", json=body(9, 0)).status_code == 200
    finally:
        router.stop()


def test_replica_dying_mid_stream_ends_the_stream_with_an_error_event(tiny_tokenizer, spawn_backend):
    port = free_port()
    solo = spawn_backend("solo", port)
    httpx.post(f"http://127.0.0.1:{port}/_control", json={"tokens": 100, "token_delay": 0.05})
    app = RouterApp(
        RouterConfig(
            backends=[f"http://127.0.0.1:{port}"],
            tokenizer=tiny_tokenizer,
            model_name="m",
            health_interval=0.2,
        )
    )
    router = ServerThread(app).start()
    try:
        with (
            httpx.Client(base_url=router.url, timeout=30) as c,
            c.stream("POST", "/v1/chat/completions", json=body(0, 0, stream=True)) as r,
        ):
            lines = []
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3:
                    solo.kill()
        assert r.status_code == 200
        last = json.loads(lines[-1][len("data: ") :])
        assert last["error"]["type"] == "server_error" and "mid-stream" in last["error"]["message"]
    finally:
        router.stop()
