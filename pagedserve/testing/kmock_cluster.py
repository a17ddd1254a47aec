"""kmock's Kubernetes emulator set up as the operator needs it, and the real operator running against it
(tests/operator/test_operator_kmock.py, e2e/test_scale_from_zero.py).

Emulator gaps worked around here: resources (v1/namespaces included, or kopf never starts watching) are
declared up front; there is no garbage collection, PUT, admission, or separate subresource storage (a
PATCH of ``.../scale`` or ``.../status`` patches the object itself, with the same effect on spec.replicas
and status as the API server's), and lists ignore labelSelector. Listing namespaces fails inside kmock
0.8, so the operator runs cluster-wide here (the --namespace mode differs only in kopf's watch URLs).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import kmock

from pagedserve.testing.kubeconfig import kubeconfig_env

VERBS = {"get", "list", "watch", "create", "patch", "delete"}
RESOURCES = {
    "v1/namespaces": dict(kind="Namespace", namespaced=False),
    "v1/events": dict(kind="Event", namespaced=True),
    "v1/pods": dict(kind="Pod", namespaced=True),  # the engine pods the operator loads adapters on
    "v1/services": dict(kind="Service", namespaced=True),
    "v1/serviceaccounts": dict(kind="ServiceAccount", namespaced=True),
    "v1/persistentvolumeclaims": dict(kind="PersistentVolumeClaim", namespaced=True),
    "apps/v1/deployments": dict(kind="Deployment", namespaced=True, subresources={"status", "scale"}),
    "rbac.authorization.k8s.io/v1/roles": dict(kind="Role", namespaced=True),
    "rbac.authorization.k8s.io/v1/rolebindings": dict(kind="RoleBinding", namespaced=True),
    "policy/v1/poddisruptionbudgets": dict(kind="PodDisruptionBudget", namespaced=True),
    "autoscaling/v2/horizontalpodautoscalers": dict(kind="HorizontalPodAutoscaler", namespaced=True),
    "monitoring.coreos.com/v1/podmonitors": dict(kind="PodMonitor", namespaced=True),
    "discovery.k8s.io/v1/endpointslices": dict(kind="EndpointSlice", namespaced=True),
    "apiextensions.k8s.io/v1/customresourcedefinitions": dict(
        kind="CustomResourceDefinition", namespaced=False
    ),
    "pagedserve.io/v1alpha1/modeldeployments": dict(
        kind="ModelDeployment", namespaced=True, subresources={"status", "scale"}
    ),
}


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator with a bounded request history, a log of every request as (method, path),
    and names for objects created with metadata.generateName (kopf's Events), as the API server does.

    kmock matches each request by scanning the whole request history (quadratic: 60 ms per request
    after a few hundred); the emulated objects live elsewhere, so a short history changes nothing.
    """

    HISTORY = 64

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[str, str]] = []

    async def _handle(self, request: Any) -> Any:
        self.log.append((request.method.upper(), request.url.path))
        del self._requests[: -self.HISTORY]
        meta = (
            request.data.get("metadata")
            if request.method == "POST" and isinstance(request.data, dict)
            else None
        )
        if meta is not None and not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{len(self.log):05d}"
        return await super()._handle(request)


@contextlib.asynccontextmanager
async def emulated_cluster() -> AsyncIterator[tuple[Emulator, httpx.AsyncClient]]:
    """The emulator serving every resource of ``RESOURCES``, and a client on its URL."""
    async with Emulator() as emulator, kmock.Server(emulator) as server:
        for key, info in RESOURCES.items():
            emulator.resources[key] = kmock.ResourceInfo(verbs=VERBS, **info)
        async with httpx.AsyncClient(base_url=str(server.url).rstrip("/"), timeout=10) as client:
            yield emulator, client


async def get(client: httpx.AsyncClient, path: str) -> dict[str, Any] | None:
    """The object at ``path``, None when there is none."""
    response = await client.get(path)
    if response.status_code == 404:
        return None
    response.raise_for_status()
    return response.json()


async def eventually(
    check: Callable[[], Awaitable[Any]], timeout: float = 20.0, what: str = "condition"
) -> Any:
    """Poll an async check until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


@contextlib.asynccontextmanager
async def running_operator(url: str, workdir: Path, tag: str) -> AsyncIterator[Path]:
    """`pagedserve operator` (resync every second) against the API at ``url``; yields its log's path."""
    env = kubeconfig_env(url, workdir)
    log = workdir / f"operator-{tag}.log"
    with log.open("w") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pagedserve.cli", "operator", "--resync-seconds", "1", "--verbose",
            cwd=workdir, env=env, stdout=out, stderr=out,
        )  # fmt: skip
        try:
            yield log
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 15)
                except asyncio.TimeoutError:
                    proc.kill()
                    await proc.wait()
