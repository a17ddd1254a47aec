"""Scale from zero at the router (router/activator.py, router/scaler.py): requests held while no replica is
ready, released when one is; 503 with Retry-After when the queue is full or a request waits too long; a
held request whose client leaves frees its place; the wake-up through the ModelDeployment's scale
subresource, against kmock's Kubernetes emulator."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from pathlib import Path

import httpx
import pytest
from pagedserve.router.proxy import RouterApp, RouterConfig

from pagedserve.testing.fake_openai import FakeOpenAI
from pagedserve.testing.kubeconfig import kubeconfig_env
from pagedserve.testing.net import free_port
from pagedserve.testing.processes import router_process
from pagedserve.testing.server_thread import ServerThread

pytestmark = pytest.mark.timeout(120)

PROMPT = {"model": "m", "prompt": "hello " * 20, "max_tokens": 2}


def held_router(tokenizer: str, port: int, **cfg) -> ServerThread:
    """A router whose one backend (127.0.0.1:port) does not listen yet: nothing is ready."""
    config = RouterConfig(
        backends=[f"http://127.0.0.1:{port}"],
        tokenizer=tokenizer,
        model_name="m",
        health_interval=0.2,
        health_timeout=1.0,
        **cfg,
    )
    return ServerThread(RouterApp(config)).start()


def wait_until(check, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def metric(router: ServerThread, name: str) -> float:
    for line in httpx.get(router.url + "/metrics").text.splitlines():
        head, _, value = line.rpartition(" ")
        if head == name:
            return float(value)
    return 0.0


@pytest.fixture()
def servers():
    started: list[ServerThread] = []
    yield started
    for server in started:
        server.stop()


def test_held_requests_are_answered_when_a_replica_appears(tiny_tokenizer, servers):
    port = free_port()
    router = held_router(tiny_tokenizer, port, max_held_requests=8, held_request_timeout=60)
    servers.append(router)
    assert httpx.get(router.url + "/ready").status_code == 200  # reachable, so it can wake the engines
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        post = router.url + "/v1/completions"
        answers = [pool.submit(httpx.post, post, json=PROMPT, timeout=60) for _ in range(4)]
        wait_until(lambda: metric(router, "pagedserve_router_held_requests") == 4, what="4 held requests")
        assert not any(a.done() for a in answers)
        servers.append(ServerThread(FakeOpenAI(name="late"), port=port).start())
        for answer in answers:
            response = answer.result(timeout=30)
            assert response.status_code == 200, response.text
            assert response.json()["backend"] == "late"
    assert metric(router, "pagedserve_router_held_requests") == 0
    assert metric(router, "pagedserve_router_requests_held_total") == 4
    assert metric(router, "pagedserve_router_wake_up_seconds_count") == 1
    # With a ready replica, nothing is held.
    assert httpx.post(router.url + "/v1/completions", json=PROMPT, timeout=30).status_code == 200
    assert metric(router, "pagedserve_router_requests_held_total") == 4


def test_full_queue_gets_503_with_retry_after(tiny_tokenizer, servers, raw_post):
    router = held_router(tiny_tokenizer, free_port(), max_held_requests=1, held_request_timeout=60)
    servers.append(router)
    raw_post(router.url, "/v1/completions", PROMPT)  # takes the one place
    wait_until(lambda: metric(router, "pagedserve_router_held_requests") == 1, what="a held request")
    response = httpx.post(router.url + "/v1/completions", json=PROMPT, timeout=10)
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    error = response.json()["error"]
    assert error["type"] == "server_error" and "already waiting" in error["message"]
    assert metric(router, "pagedserve_router_held_requests_refused_total") == 1
    assert httpx.get(router.url + "/ready").status_code == 503  # full: new requests go elsewhere


def test_held_request_times_out_with_503(tiny_tokenizer, servers):
    router = held_router(tiny_tokenizer, free_port(), max_held_requests=4, held_request_timeout=0.5)
    servers.append(router)
    response = httpx.post(router.url + "/v1/completions", json=PROMPT, timeout=10)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert "within 0.5s" in response.json()["error"]["message"]
    assert metric(router, "pagedserve_router_held_request_timeouts_total") == 1
    assert metric(router, "pagedserve_router_held_requests") == 0


def test_held_request_whose_client_leaves_leaves_the_queue(tiny_tokenizer, servers, raw_post):
    router = held_router(tiny_tokenizer, free_port(), max_held_requests=1, held_request_timeout=60)
    servers.append(router)
    sock = raw_post(router.url, "/v1/completions", PROMPT)
    wait_until(lambda: metric(router, "pagedserve_router_held_requests") == 1, what="a held request")
    sock.close()
    wait_until(lambda: metric(router, "pagedserve_router_held_requests") == 0, what="the queue emptied")
    assert router.app.activator.held == 0
    raw_post(router.url, "/v1/completions", PROMPT)  # its place is free again: held, not refused
    wait_until(lambda: metric(router, "pagedserve_router_held_requests") == 1, what="held again")
    assert metric(router, "pagedserve_router_held_requests_refused_total") == 0


kmock = pytest.importorskip("kmock")

from pagedserve.testing.kmock_cluster import emulated_cluster, get  # noqa: E402

NS = "ml"
MD_PATH = f"/apis/pagedserve.io/v1alpha1/namespaces/{NS}/modeldeployments"
STAMP = "pagedserve.io/last-request-time"


def scale_from_zero_router(tmp_path: Path, url: str, port: int, tokenizer: str):
    """`pagedserve router --scale-from-zero m1` in front of 127.0.0.1:port, against the emulator at url."""
    return router_process(
        tmp_path / "router.log", [f"http://127.0.0.1:{port}"], "--tokenizer", tokenizer,
        "--health-interval", "0.2", "--namespace", NS, "--scale-from-zero", "m1",
        "--max-held-requests", "4", "--held-request-timeout", "60", "--activity-interval", "0.5",
        env=kubeconfig_env(url, tmp_path),
    )  # fmt: skip


def modeldeployment(replicas: int) -> dict:
    return {
        "apiVersion": "pagedserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "m1", "namespace": NS, "resourceVersion": "7"},
        "spec": {"model": "embedded", "replicas": replicas, "scaleFromZero": {}},
    }


async def test_a_held_request_wakes_the_modeldeployment(tmp_path: Path, tiny_tokenizer):
    """`pagedserve router --scale-from-zero`: the first held request records activity, then sets the
    scale subresource from 0 to 1; the request is answered once the replica is there."""
    port = free_port()
    async with emulated_cluster() as (emulator, kube):
        (await kube.post(MD_PATH, json=modeldeployment(0))).raise_for_status()
        router = scale_from_zero_router(tmp_path, str(kube.base_url).rstrip("/"), port, tiny_tokenizer)
        await asyncio.to_thread(lambda: router.start().wait_ready(30))
        replica: ServerThread | None = None
        try:
            async with httpx.AsyncClient(base_url=router.url, timeout=60) as client:
                answer = asyncio.create_task(client.post("/v1/completions", json=PROMPT))

                async def replicas() -> int:
                    return (await get(kube, f"{MD_PATH}/m1"))["spec"]["replicas"]

                deadline = time.monotonic() + 20
                while await replicas() != 1:
                    assert time.monotonic() < deadline, "the router did not wake the ModelDeployment"
                    await asyncio.sleep(0.1)
                assert ("PATCH", f"{MD_PATH}/m1/scale") in emulator.log
                stamped = (await get(kube, f"{MD_PATH}/m1"))["metadata"]["annotations"]
                assert stamped[STAMP].endswith("Z")
                assert not answer.done()
                replica = await asyncio.to_thread(ServerThread(FakeOpenAI(name="woken"), port=port).start)
                response = await answer
                assert response.status_code == 200, response.text
                assert response.json()["backend"] == "woken"
                # A scale that is not 0 is never touched (no scale-down from 3 to 1).
                await kube.patch(
                    f"{MD_PATH}/m1", json={"spec": {"replicas": 3}},
                    headers={"Content-Type": "application/merge-patch+json"},
                )  # fmt: skip
                await asyncio.to_thread(replica.stop)
                replica = None
                held = asyncio.create_task(client.post("/v1/completions", json=PROMPT))
                await asyncio.sleep(1.5)
                assert await replicas() == 3
                held.cancel()
        finally:
            if replica is not None:
                await asyncio.to_thread(replica.stop)
            await asyncio.to_thread(router.stop)
    text = router.log_text()
    assert "Traceback" not in text and "could not" not in text, text


async def test_a_request_in_flight_keeps_the_activity_fresh(tmp_path: Path, tiny_tokenizer):
    """The last-request annotation is refreshed on every interval while a request runs, however long,
    so the operator's scale-down never sees a busy fleet as idle; once idle, it stops changing."""
    backend = FakeOpenAI(name="slow")
    backend.token_delay = 0.25  # 12 tokens: a 3 s stream
    with ServerThread(backend) as replica:
        async with emulated_cluster() as (_, kube):
            (await kube.post(MD_PATH, json=modeldeployment(1))).raise_for_status()
            url = str(kube.base_url).rstrip("/")
            router = scale_from_zero_router(tmp_path, url, replica.port, tiny_tokenizer)
            await asyncio.to_thread(lambda: router.start().wait_ready(30))
            try:
                async with httpx.AsyncClient(base_url=router.url, timeout=60) as client:
                    body = {**PROMPT, "max_tokens": 12, "ignore_eos": True, "stream": True}
                    answer = asyncio.create_task(client.post("/v1/completions", json=body))
                    seen = set()
                    while not answer.done():
                        md = await get(kube, f"{MD_PATH}/m1")
                        if STAMP in (md["metadata"].get("annotations") or {}):
                            seen.add(md["metadata"]["annotations"][STAMP])
                        await asyncio.sleep(0.1)
                    assert (await answer).status_code == 200
                    assert len(seen) >= 3, seen  # refreshed during the request, not only at its arrival
                    await asyncio.sleep(1.0)  # the last refresh after the end lands
                    last = (await get(kube, f"{MD_PATH}/m1"))["metadata"]["annotations"][STAMP]
                    await asyncio.sleep(1.5)  # three intervals without requests: no more writes
                    assert (await get(kube, f"{MD_PATH}/m1"))["metadata"]["annotations"][STAMP] == last
            finally:
                await asyncio.to_thread(router.stop)
    text = router.log_text()
    assert "Traceback" not in text and "could not" not in text, text
