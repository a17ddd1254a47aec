"""`pagedserve router --k8s-service` against kmock's Kubernetes emulator: the real kubernetes client
(kubeconfig), EndpointSlices listed and watched, replicas joining and leaving without a restart.

Every replica is a stand-in backend on its own loopback address (127.0.0.2, 127.0.0.3, ...) and the same
port, as pods behind a Service share the target port.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from pagedserve.testing.fake_openai import FakeOpenAI
from pagedserve.testing.kubeconfig import kubeconfig_env
from pagedserve.testing.net import free_port
from pagedserve.testing.processes import router_process
from pagedserve.testing.server_thread import ServerThread

kmock = pytest.importorskip("kmock")

VERBS = {"get", "list", "watch", "create", "patch", "delete"}
SLICES = "/apis/discovery.k8s.io/v1/namespaces/ml/endpointslices"


def endpoint_slice(name: str, endpoints: list[tuple[str, bool]]) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "ml",
            "uid": f"uid-{name}",
            "resourceVersion": "1",
            "labels": {"kubernetes.io/service-name": "engine"},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}} for ip, ready in endpoints],
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
    }


async def eventually(check, timeout: float = 15.0, what: str = ""):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = await check()
            if last:
                return last
        except httpx.HTTPError as exc:
            last = exc
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


@pytest.fixture()
def backends():
    port = free_port()
    started = [
        ServerThread(FakeOpenAI(name=f"pod{i}"), port=port, host=f"127.0.0.{i}").start() for i in (2, 3)
    ]
    yield port, started
    for s in started:
        s.stop()


async def test_router_follows_endpointslices(tmp_path: Path, backends, tiny_tokenizer):
    port, _ = backends
    async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s) as server:
        k8s.resources["discovery.k8s.io/v1/endpointslices"] = kmock.ResourceInfo(
            kind="EndpointSlice", namespaced=True, verbs=VERBS
        )
        url = str(server.url).rstrip("/")
        async with httpx.AsyncClient(base_url=url, timeout=10) as kube:
            r = await kube.post(SLICES, json=endpoint_slice("engine-a", [("127.0.0.2", True)]))
            assert r.status_code in (200, 201), r.text

            env = kubeconfig_env(url, tmp_path)
            router = router_process(
                tmp_path / "router.log", [], "--k8s-service", "engine", "--namespace", "ml",
                "--target-port", str(port), "--tokenizer", tiny_tokenizer, "--health-interval", "0.2",
                env=env,
            ).start()  # fmt: skip
            try:
                async with httpx.AsyncClient(base_url=router.url, timeout=10) as rc:

                    async def served_by():
                        r = await rc.post("/v1/completions", json={"prompt": "hello " * 30})
                        return r.json().get("backend") if r.status_code == 200 else None

                    async def ready():
                        r = await rc.get("/backends")
                        return sorted(b["url"] for b in r.json() if b["ready"])

                    assert await eventually(served_by, what="first replica") == "pod2"
                    # A second replica joins (ready), the first starts terminating (not ready).
                    r = await kube.patch(
                        f"{SLICES}/engine-a",
                        json={"endpoints": [
                            {"addresses": ["127.0.0.2"], "conditions": {"ready": False}},
                            {"addresses": ["127.0.0.3"], "conditions": {"ready": True}},
                        ]},
                    )  # fmt: skip
                    assert r.status_code == 200, r.text
                    want = [f"http://127.0.0.3:{port}"]
                    await eventually(lambda: _eq(ready(), want), what="pod3 only")
                    for _ in range(5):
                        assert await served_by() == "pod3"
                    # Another slice of the same Service brings pod2 back.
                    r = await kube.post(SLICES, json=endpoint_slice("engine-b", [("127.0.0.2", True)]))
                    assert r.status_code in (200, 201), r.text
                    both = [f"http://127.0.0.2:{port}", f"http://127.0.0.3:{port}"]
                    await eventually(lambda: _eq(ready(), both), what="both replicas")
                    # All slices gone: no replica, an OpenAI error.
                    for name in ("engine-a", "engine-b"):
                        r = await kube.delete(f"{SLICES}/{name}")
                        assert r.status_code == 200, r.text
                    await eventually(lambda: _eq(ready(), []), what="no replica")
                    r = await rc.post("/v1/completions", json={"prompt": "x"})
                    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
            finally:
                await asyncio.to_thread(router.stop)  # off the loop: the emulator answers on it meanwhile
    text = router.log_text()
    assert "Traceback" not in text and "list/watch failed" not in text, text


async def _eq(awaitable, want) -> bool:
    return (await awaitable) == want
