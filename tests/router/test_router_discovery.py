"""Discovery (static, EndpointSlices), health checks and load scraping."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import httpx
import pytest
from pagedserve.router.balancer import Balancer
from pagedserve.router.discovery import (
    EndpointSliceDiscovery,
    HealthMonitor,
    StaticDiscovery,
    endpoints_from_slice,
    normalize_url,
    parse_engine_metrics,
)
from pagedserve.router.proxy import RouterApp, RouterConfig

from pagedserve.testing.fake_openai import FakeOpenAI
from pagedserve.testing.net import free_port
from pagedserve.testing.server_thread import ServerThread


def test_parse_engine_metrics():
    text = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_running{model_name="m"} 7.0
vllm:kv_cache_usage_perc{model_name="m"} 0.42
vllm:prefix_cache_hits_total{model_name="m"} 1200.0
vllm:weird{label="a b } c"} 9
vllm:broken
vllm:nan{} NaN
"""
    assert parse_engine_metrics(text) == (5.0, 0.42)
    assert parse_engine_metrics("") == (0.0, 0.0)
    assert parse_engine_metrics("vllm:gpu_cache_usage_perc 0.5\nvllm:num_requests_waiting 1") == (1.0, 0.5)


def test_normalize_url():
    assert normalize_url("10.0.0.1:8000") == "http://10.0.0.1:8000"
    assert normalize_url(" http://h:1/ ") == "http://h:1"


def slice_obj(name, endpoints, address_type="IPv4"):
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "engine"}},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": 8000}],
    }


def ep(ip, ready=True, terminating=None):
    cond = {}
    if ready is not None:
        cond["ready"] = ready
    if terminating is not None:
        cond["terminating"] = terminating
    return {"addresses": [ip], "conditions": cond}


def test_endpoints_from_slice():
    s = slice_obj(
        "engine-abc",
        [
            ep("10.0.0.1"),
            ep("10.0.0.2", ready=False),
            ep("10.0.0.3", ready=None),
            ep("10.0.0.4", ready=True, terminating=True),
            {"addresses": []},
        ],
    )
    assert urls(endpoints_from_slice(s, 8000)) == {
        "http://10.0.0.1:8000": True,
        "http://10.0.0.2:8000": False,
        "http://10.0.0.3:8000": True,  # unset means ready
        "http://10.0.0.4:8000": False,
    }
    v6 = slice_obj("engine-v6", [ep("fd00::1")], address_type="IPv6")
    assert urls(endpoints_from_slice(v6, 9000)) == {"http://[fd00::1]:9000": True}
    assert endpoints_from_slice({"metadata": {"name": "x"}, "endpoints": None}, 8000) == []


def urls(endpoints) -> dict[str, bool]:
    return {e.url: e.ready for e in endpoints}


class FakeWatch:
    """Replays events pushed into a queue; None ends the stream (like a watch timeout)."""

    def __init__(self, events: queue.Queue) -> None:
        self.events = events
        self.calls = []
        self.stopped = False

    def stream(self, func, *args, **kwargs):
        self.calls.append((args, kwargs))
        while not self.stopped:
            try:
                ev = self.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if ev is None:
                return
            if isinstance(ev, Exception):
                raise ev
            yield ev

    def stop(self):
        self.stopped = True


class FakeApi:
    def __init__(self, items):
        self.items = items
        self.list_calls = []

    def list_namespaced_endpoint_slice(self, namespace, label_selector=None, **kw):
        self.list_calls.append((namespace, label_selector))
        return {"metadata": {"resourceVersion": str(len(self.list_calls))}, "items": list(self.items)}


async def wait_for(cond, timeout=5.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not met")
        await asyncio.sleep(0.01)


async def test_endpointslice_discovery_follows_the_watch():
    balancer = Balancer()
    changes = []
    events: queue.Queue = queue.Queue()
    watches: list[FakeWatch] = []

    def factory():
        w = FakeWatch(events)
        watches.append(w)
        return w

    api = FakeApi([slice_obj("engine-a", [ep("10.0.0.1"), ep("10.0.0.2", ready=False)])])
    d = EndpointSliceDiscovery(
        balancer,
        "engine",
        "ml",
        8000,
        lambda: changes.append(1),
        api=api,
        watch_factory=factory,
        retry_delay=0.05,
    )
    await d.start(wait_s=5)
    try:
        assert api.list_calls == [("ml", "kubernetes.io/service-name=engine")]
        assert set(balancer.backends) == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}
        assert balancer.ready_urls() == ["http://10.0.0.1:8000"]
        await wait_for(lambda: watches and watches[0].calls)
        assert watches[0].calls[0][1]["resource_version"] == "1"
        assert watches[0].calls[0][1]["label_selector"] == "kubernetes.io/service-name=engine"

        # The second endpoint becomes ready; a new slice appears.
        events.put({"type": "MODIFIED", "object": slice_obj("engine-a", [ep("10.0.0.1"), ep("10.0.0.2")])})
        events.put({"type": "ADDED", "object": slice_obj("engine-b", [ep("10.0.0.3")])})
        await wait_for(lambda: len(balancer.ready_urls()) == 3)
        # A replica goes away (rolled), the other slice is deleted.
        events.put({"type": "MODIFIED", "object": slice_obj("engine-a", [ep("10.0.0.2")])})
        events.put({"type": "DELETED", "object": slice_obj("engine-b", [])})
        await wait_for(lambda: set(balancer.backends) == {"http://10.0.0.2:8000"})
        # An expired resource version: re-list, then watch again.
        api.items = [slice_obj("engine-a", [ep("10.0.0.2"), ep("10.0.0.5")])]
        events.put({"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}})
        await wait_for(lambda: "http://10.0.0.5:8000" in balancer.backends)
        assert len(api.list_calls) == 2
        # A broken connection: re-list after the delay.
        api.items = [slice_obj("engine-a", [ep("10.0.0.6")])]
        events.put(RuntimeError("connection reset"))
        await wait_for(lambda: set(balancer.backends) == {"http://10.0.0.6:8000"})
        assert changes
    finally:
        await d.stop()


async def test_endpointslice_discovery_accepts_kubernetes_models():
    """The kubernetes client hands back model objects; they are serialised with its api_client."""
    from kubernetes import client

    api_client = client.ApiClient()
    model = (
        api_client._ApiClient__deserialize(
            {"items": [slice_obj("engine-a", [ep("10.0.0.9")])], "metadata": {"resourceVersion": "5"}},
            "V1EndpointSliceList",
        )
        if hasattr(api_client, "_ApiClient__deserialize")
        else None
    )
    if model is None:
        pytest.skip("this kubernetes client cannot build models offline")

    class ModelApi(FakeApi):
        def list_namespaced_endpoint_slice(self, namespace, label_selector=None, **kw):
            self.list_calls.append((namespace, label_selector))
            return model

    api = ModelApi([])
    api.api_client = api_client
    balancer = Balancer()
    events: queue.Queue = queue.Queue()
    d = EndpointSliceDiscovery(
        balancer, "engine", "ml", 8000, lambda: None, api=api, watch_factory=lambda: FakeWatch(events)
    )
    await d.start(wait_s=5)
    try:
        assert balancer.ready_urls() == ["http://10.0.0.9:8000"]
    finally:
        await d.stop()


@pytest.fixture()
def fake_servers():
    servers = []

    def start(name):
        s = ServerThread(FakeOpenAI(name=name)).start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


async def test_health_monitor_scrapes_load_and_tracks_health(fake_servers):
    a, b = fake_servers("a"), fake_servers("b")
    a.app.waiting, a.app.kv_usage = 4, 0.25
    balancer = Balancer()
    changes = []
    await StaticDiscovery(balancer, [a.url, b.url], lambda: None).start()
    async with httpx.AsyncClient() as client:
        mon = HealthMonitor(
            balancer,
            client,
            interval=0.05,
            timeout=1.0,
            unhealthy_after=2,
            on_change=lambda: changes.append(1),
        )
        await mon.check_all()
        assert balancer.backends[a.url].waiting == 4 and balancer.backends[a.url].kv_usage == 0.25
        assert balancer.backends[a.url].load == 4.25
        assert sorted(balancer.ready_urls()) == sorted([a.url, b.url])

        # /health answering 503: out after `unhealthy_after` failed checks, back on the first good one.
        b.app.health_status = 503
        await mon.check(b.url)
        assert b.url in balancer.ready_urls()
        await mon.check(b.url)
        assert b.url not in balancer.ready_urls()
        b.app.health_status = 200
        await mon.check(b.url)
        assert b.url in balancer.ready_urls()

        # A replica that refuses connections leaves at once; the periodic loop brings it back.
        port = a.port
        a.stop()
        await mon.check(a.url)
        assert a.url not in balancer.ready_urls()
        mon.sync()
        revived = ServerThread(FakeOpenAI(name="a2"), port=port).start()
        try:
            await wait_for(lambda: a.url in balancer.ready_urls(), timeout=5)
        finally:
            await mon.stop()
            revived.stop()
        assert changes


def test_static_discovery_normalizes():
    balancer = Balancer()
    asyncio.run(StaticDiscovery(balancer, ["127.0.0.1:1", "http://127.0.0.1:2/"], lambda: None).start())
    assert list(balancer.backends) == ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def test_watch_thread_is_a_daemon():
    # The watch never blocks interpreter exit.
    d = EndpointSliceDiscovery(
        Balancer(),
        "s",
        "ns",
        8000,
        lambda: None,
        api=FakeApi([]),
        watch_factory=lambda: FakeWatch(queue.Queue()),
    )

    async def go():
        await d.start(wait_s=2)
        t = d._thread
        await d.stop()
        return t

    t = asyncio.run(go())
    assert isinstance(t, threading.Thread) and t.daemon


# --- dual stack and departures (issue 14, item 8) -----------------------------------------------------
def pod_ep(ip: str, pod: str, ready: bool = True) -> dict:
    return {
        "addresses": [ip],
        "conditions": {"ready": ready},
        "targetRef": {"kind": "Pod", "namespace": "ml", "name": pod, "uid": f"uid-{pod}"},
    }


async def test_dual_stack_slices_give_one_endpoint_per_pod():
    """A dual-stack Service has an IPv4 and an IPv6 slice listing the same pods: one replica per pod,
    named by its IPv4 address whatever order the slices come in (every router replica builds the same
    ring)."""
    v6 = slice_obj(
        "engine-v6", [pod_ep("fd00::1", "p1"), pod_ep("fd00::2", "p2"), pod_ep("fd00::3", "p3")], "IPv6"
    )
    v4 = slice_obj("engine-v4", [pod_ep("10.0.0.1", "p1"), pod_ep("10.0.0.2", "p2", ready=False)])
    for items in ([v6, v4], [v4, v6]):
        balancer = Balancer()
        d = EndpointSliceDiscovery(
            balancer, "engine", "ml", 8000, lambda: None, api=FakeApi(items),
            watch_factory=lambda: FakeWatch(queue.Queue()),
        )  # fmt: skip
        await d.start(wait_s=5)
        try:
            # p3 has no IPv4 address (yet): its IPv6 one. p2's readiness is its IPv4 endpoint's.
            assert set(balancer.backends) == {
                "http://10.0.0.1:8000",
                "http://10.0.0.2:8000",
                "http://[fd00::3]:8000",
            }
            assert sorted(balancer.ready_urls()) == ["http://10.0.0.1:8000", "http://[fd00::3]:8000"]
        finally:
            await d.stop()


def test_a_departed_backend_leaves_no_state():
    """A replica that leaves the EndpointSlices takes its metric series, health-check state and pooled
    connections with it (pods come back under new addresses: kept, they would grow without bound)."""
    port = free_port()
    pods = {
        ip: ServerThread(FakeOpenAI(name=ip), port=port, host=ip).start() for ip in ("127.0.0.2", "127.0.0.3")
    }
    events: queue.Queue = queue.Queue()
    both = slice_obj("engine-a", [pod_ep("127.0.0.2", "p2"), pod_ep("127.0.0.3", "p3")])
    app = RouterApp(
        RouterConfig(
            k8s_service="engine", namespace="ml", target_port=port, strategy="round-robin",
            health_interval=0.1, health_timeout=1.0,
        ),
        discovery=lambda balancer, on_change: EndpointSliceDiscovery(
            balancer, "engine", "ml", port, on_change, api=FakeApi([both]),
            watch_factory=lambda: FakeWatch(events),
        ),
    )  # fmt: skip
    router = ServerThread(app).start()
    gone = f"http://127.0.0.3:{port}"
    try:
        with httpx.Client(base_url=router.url, timeout=10) as client:
            pods["127.0.0.3"].app.fail_503 = 1  # a retry series for it too
            for _ in range(4):
                r = client.post("/v1/completions", json={"model": "m", "prompt": "hello"})
                assert r.status_code == 200, r.text
            metrics = client.get("/metrics").text
            assert (
                f'backend="{gone}",status="200"' in metrics
                and f'backend="{gone}",reason="status_503"' in metrics
            )
            assert app.upstream.idle_connections(gone) >= 1 and gone in app.monitor.last_check

            events.put({"type": "MODIFIED", "object": slice_obj("engine-a", [pod_ep("127.0.0.2", "p2")])})
            deadline = time.monotonic() + 10
            while gone in app.balancer.backends and time.monotonic() < deadline:
                time.sleep(0.02)
            assert gone not in app.balancer.backends
            assert gone not in client.get("/metrics").text
            assert gone not in app.monitor.last_check
            assert app.upstream.idle_connections(gone) == 0
            assert client.post("/v1/completions", json={"model": "m", "prompt": "hi"}).status_code == 200
    finally:
        router.stop()
        for pod in pods.values():
            pod.stop()
