"""The real operator (`pagedserve operator`, kopf) against kmock's Kubernetes emulator.

The operator runs as a subprocess with a kubeconfig pointing at the emulator, exactly as it would run
against a cluster; the test plays kubectl and the Deployment controller over HTTP.

The emulator and the operator process come from pagedserve/testing/kmock_cluster.py (its docstring lists
the emulator's gaps); objects get metadata.uid/resourceVersion/generation from the test.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

kmock = pytest.importorskip("kmock")
pytest.importorskip("kopf")

from pagedserve.common.resource import LAST_REQUEST_ANNOTATION  # noqa: E402
from pagedserve.operator import render  # noqa: E402
from pagedserve.operator.resources import CHILD_KINDS, HASH_ANNOTATION  # noqa: E402
from pagedserve.router.scaler import format_time  # noqa: E402

from pagedserve.testing.kmock_cluster import (  # noqa: E402
    Emulator,
    emulated_cluster,
    eventually,
    get,
    running_operator,
)

pytestmark = pytest.mark.timeout(90)

NS = "ml"
MD_PATH = f"/apis/pagedserve.io/v1alpha1/namespaces/{NS}/modeldeployments"


def modeldeployment(name: str = "m1", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pagedserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "resourceVersion": "1",
            "generation": 1,
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {
            "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "replicas": 1,
            "resources": {"gpus": 1},
            "modelCache": {"size": "10Gi"},
            "hfTokenSecret": {"name": "hf-token"},
            "apiKeySecret": {"name": "api-key"},
            "autoscaling": {"minReplicas": 1, "maxReplicas": 4},
            **spec,
        },
    }


def child_path(manifest: dict[str, Any]) -> str:
    api = manifest["apiVersion"]
    prefix = "/api/v1" if api == "v1" else f"/apis/{api}"
    plural = CHILD_KINDS[(api, manifest["kind"])]
    return f"{prefix}/namespaces/{NS}/{plural}/{manifest['metadata']['name']}"


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[Emulator, httpx.AsyncClient]]:
    async with emulated_cluster() as found:
        yield found


async def merge_patch(client: httpx.AsyncClient, path: str, patch: dict[str, Any]) -> dict[str, Any]:
    response = await client.patch(path, json=patch, headers={"Content-Type": "application/merge-patch+json"})
    response.raise_for_status()
    return response.json()


def writes_to(emulator: Emulator, paths: set[str]) -> list[str]:
    """The writes the emulator saw on these objects, their subresources and (creates) their collections."""
    collections = {path.rsplit("/", 1)[0] for path in paths}
    return [
        f"{method} {path}"
        for method, path in emulator.log
        if method != "GET"
        and (path in paths or path.rsplit("/", 1)[0] in paths or (method == "POST" and path in collections))
    ]


async def test_operator_lifecycle(cluster: tuple[Emulator, httpx.AsyncClient], tmp_path: Path) -> None:
    emulator, client = cluster
    url = str(client.base_url).rstrip("/")
    md = modeldeployment()
    expected = render(md)
    assert {m["kind"] for m in expected} >= {"HorizontalPodAutoscaler", "PersistentVolumeClaim", "PodMonitor"}

    (await client.post(MD_PATH, json=md)).raise_for_status()

    async with running_operator(url, tmp_path, "first") as log:
        # apply -> every child appears, owned and labelled; the status says where the endpoint is.
        async def children() -> list[dict[str, Any]] | None:
            found = [await get(client, child_path(m)) for m in expected]
            return found if all(found) else None

        live = await eventually(children, what="every child")
        for manifest, obj in zip(expected, live, strict=True):
            refs = obj["metadata"]["ownerReferences"]
            assert refs == [
                {
                    "apiVersion": "pagedserve.io/v1alpha1",
                    "kind": "ModelDeployment",
                    "name": "m1",
                    "uid": "uid-m1",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ], manifest["kind"]
            assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "pagedserve-operator"
            assert (
                obj["metadata"]["annotations"][HASH_ANNOTATION]
                == manifest["metadata"]["annotations"][HASH_ANNOTATION]
            )

        async def md_status() -> dict[str, Any]:
            return (await get(client, f"{MD_PATH}/m1") or {}).get("status") or {}

        status = await eventually(md_status, what="a status")
        assert status["phase"] == "Pending"
        assert status["endpoint"] == "http://m1.ml.svc/v1"
        # no finalizer: deleting never waits for the operator (the children's ownerReferences suffice)
        assert not (await get(client, f"{MD_PATH}/m1"))["metadata"].get("finalizers")

        # change replicas (as the HPA would, through the spec) -> the engine Deployment follows.
        engine_path = f"/apis/apps/v1/namespaces/{NS}/deployments/m1-engine"
        router_path = f"/apis/apps/v1/namespaces/{NS}/deployments/m1-router"
        await merge_patch(
            client,
            f"{MD_PATH}/m1",
            {"metadata": {"generation": 2, "resourceVersion": "2"}, "spec": {"replicas": 3}},
        )

        async def engine_replicas() -> bool:
            return (await get(client, engine_path))["spec"]["replicas"] == 3

        await eventually(engine_replicas, what="engine Deployment at 3 replicas")

        # the Deployment controller's part: every pod ready -> phase Ready, with the endpoint.
        for path, replicas in ((engine_path, 3), (router_path, 2)):
            ready = {"replicas": replicas, "readyReplicas": replicas, "updatedReplicas": replicas}
            await merge_patch(client, f"{path}/status", {"status": {**ready, "observedGeneration": 1}})

        async def is_ready() -> dict[str, Any] | None:
            status = await md_status()
            return status if status.get("phase") == "Ready" else None

        status = await eventually(is_ready, what="phase Ready")
        assert status["readyReplicas"] == 3 and status["routerReadyReplicas"] == 2
        assert status["endpoint"] == "http://m1.ml.svc/v1"
        assert status["observedGeneration"] == 2
        assert {c["type"]: c["status"] for c in status["conditions"]} == {
            "Reconciled": "True",
            "EngineReady": "True",
            "RouterReady": "True",
            "Ready": "True",
        }

        # drift repair: a deleted child comes back, an edited one is restored.
        service_path = f"/api/v1/namespaces/{NS}/services/m1"
        (await client.delete(service_path)).raise_for_status()
        (
            await client.delete(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/m1-router")
        ).raise_for_status()
        edited = copy.deepcopy((await get(client, engine_path))["spec"]["template"]["spec"]["containers"])
        edited[0]["image"] = "someone/else:latest"
        await merge_patch(client, engine_path, {"spec": {"template": {"spec": {"containers": edited}}}})

        async def repaired() -> bool:
            service = await get(client, service_path)
            role = await get(client, f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/m1-router")
            engine = await get(client, engine_path)
            image = engine["spec"]["template"]["spec"]["containers"][0]["image"]
            return bool(service and role and image == "pagedserve/pagedserve:0.1.0")

        await eventually(repaired, what="deleted Service/Role recreated and edited image restored")
        await asyncio.sleep(1.5)  # let the last reconcile round settle

    # restart over existing objects -> nothing created, patched or deleted; children unchanged.
    paths = {child_path(m) for m in render(await get(client, f"{MD_PATH}/m1"))}
    before = {path: await get(client, path) for path in paths}
    writes_before = len(writes_to(emulator, paths))
    async with running_operator(url, tmp_path, "restart") as log:
        await eventually(
            lambda: _log_has(log, "Handler 'apply' succeeded"), what="the resume handler after the restart"
        )
        await asyncio.sleep(2.5)  # a couple of resync rounds too
        assert writes_to(emulator, paths)[writes_before:] == []
        assert {path: await get(client, path) for path in paths} == before

        # delete the ModelDeployment -> gone at once; the garbage collector (which kmock lacks) removes
        # the children through their ownerReferences, and the operator no longer reconciles it.
        (await client.delete(f"{MD_PATH}/m1")).raise_for_status()
        assert await get(client, f"{MD_PATH}/m1") is None
        writes_before = len(writes_to(emulator, paths))
        await asyncio.sleep(2)
        assert writes_to(emulator, paths)[writes_before:] == []
        text = log.read_text()
        assert "Traceback" not in text and "[ERROR" not in text, text
    first = (tmp_path / "operator-first.log").read_text()
    assert "Traceback" not in first, first


async def _log_has(log: Path, needle: str) -> bool:
    return needle in log.read_text()


async def test_failures_are_reported(cluster: tuple[Emulator, httpx.AsyncClient], tmp_path: Path) -> None:
    """A bad spec (no admission in the emulator) and a child the API refuses: status, one Event each."""
    emulator, client = cluster
    # The API server refuses one child of "partial" (e.g. RBAC): every other child is still applied.
    pdb = f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/partial-engine"
    emulator[f"get {pdb}"] << 403
    for md in (modeldeployment("bad", engine={"blockSize": 12}), modeldeployment("partial")):
        (await client.post(MD_PATH, json=md)).raise_for_status()

    async def failed(name: str) -> dict[str, Any] | None:
        status = (await get(client, f"{MD_PATH}/{name}") or {}).get("status") or {}
        return status if status.get("phase") == "Failed" else None

    async def warnings(reason: str, name: str) -> list[dict[str, Any]]:
        events = (await get(client, f"/api/v1/namespaces/{NS}/events") or {}).get("items", [])
        return [
            e
            for e in events
            if e.get("reason") == reason
            and e.get("type") == "Warning"
            and e["involvedObject"]["name"] == name
        ]

    async with running_operator(str(client.base_url).rstrip("/"), tmp_path, "failures"):
        status = await eventually(lambda: failed("bad"), what="phase Failed for the bad spec")
        reconciled = {c["type"]: c for c in status["conditions"]}["Reconciled"]
        assert reconciled["status"] == "False" and "spec.engine.blockSize" in reconciled["message"]
        (event,) = await eventually(lambda: warnings("InvalidSpec", "bad"), what="an InvalidSpec Event")
        assert "spec.engine.blockSize" in event["message"]
        assert await get(client, f"/apis/apps/v1/namespaces/{NS}/deployments/bad-engine") is None

        status = await eventually(lambda: failed("partial"), what="phase Failed for the refused child")
        reconciled = {c["type"]: c for c in status["conditions"]}["Reconciled"]
        assert (
            "PodDisruptionBudget/partial-engine" in reconciled["message"] and "403" in reconciled["message"]
        )
        (event,) = await eventually(
            lambda: warnings("ReconcileFailed", "partial"), what="a ReconcileFailed Event"
        )
        assert "PodDisruptionBudget/partial-engine" in event["message"]
        assert await get(client, f"/apis/apps/v1/namespaces/{NS}/deployments/partial-engine") is not None

        await asyncio.sleep(2.5)  # resync rounds meet the same failures: no new Events, no storm
        assert len(await warnings("InvalidSpec", "bad")) == 1
        assert len(await warnings("ReconcileFailed", "partial")) == 1


async def test_deletion_never_waits_for_the_operator(
    cluster: tuple[Emulator, httpx.AsyncClient], tmp_path: Path
) -> None:
    """No finalizer on ModelDeployments, and the one earlier versions added is removed: deleting one
    while the operator is down completes at once (kmock keeps objects with finalizers, as the API does).

    kmock never bumps resourceVersion, so kopf's second, duplicate removal patch passes its
    resourceVersion test and fails on the missing field (logged as retried errors); the API server
    would answer it with a conflict."""
    _, client = cluster
    legacy = modeldeployment("legacy")
    legacy["metadata"]["finalizers"] = ["pagedserve.io/finalizer"]  # left by an earlier operator version
    for md in (modeldeployment("fresh"), legacy):
        (await client.post(MD_PATH, json=md)).raise_for_status()

    async def reconciled(name: str) -> bool:
        md = await get(client, f"{MD_PATH}/{name}") or {}
        engine = await get(client, f"/apis/apps/v1/namespaces/{NS}/deployments/{name}-engine")
        return bool(engine and (md.get("status") or {}).get("phase") and not md["metadata"].get("finalizers"))

    async with running_operator(str(client.base_url).rstrip("/"), tmp_path, "finalizers") as log:
        for name in ("fresh", "legacy"):
            await eventually(lambda name=name: reconciled(name), what=f"{name} reconciled, no finalizer")
        await eventually(lambda: _log_has(log, "Handler 'apply' succeeded"), what="the apply handler")
        await asyncio.sleep(1.5)  # resync rounds too: nothing puts a finalizer back

    for name in ("fresh", "legacy"):
        assert not (await get(client, f"{MD_PATH}/{name}"))["metadata"].get("finalizers"), name
        (await client.delete(f"{MD_PATH}/{name}")).raise_for_status()
        assert await get(client, f"{MD_PATH}/{name}") is None, f"{name} waits for a finalizer"


async def test_normalised_quantities_cause_no_writes(
    cluster: tuple[Emulator, httpx.AsyncClient], tmp_path: Path
) -> None:
    """The API server stores quantities canonically (1024Mi -> 1Gi): the drift check must not see a change."""
    emulator, client = cluster
    md = modeldeployment(
        "q", resources={"gpus": 1, "cpu": "1500m", "memory": "1024Mi", "shmSize": "0.5Gi"},
        router={"resources": {"cpu": "1000m", "memory": "2048Mi"}},
    )  # fmt: skip
    (await client.post(MD_PATH, json=md)).raise_for_status()
    canonical = {"1024Mi": "1Gi", "0.5Gi": "512Mi", "1000m": "1", "2048Mi": "2Gi", "10Gi": "10Gi"}

    def normalise(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: normalise(item) for key, item in value.items()}
        if isinstance(value, list):
            return [normalise(item) for item in value]
        return canonical.get(value, value) if isinstance(value, str) else value

    paths = {child_path(m) for m in render(md)}
    async with running_operator(str(client.base_url).rstrip("/"), tmp_path, "quantities"):

        async def children() -> bool:
            return all([await get(client, path) for path in paths])

        await eventually(children, what="every child")
        await asyncio.sleep(1.5)  # let the first rounds settle
        # play the API server: store every quantity in its canonical form
        for kind in ("engine", "router"):
            path = f"/apis/apps/v1/namespaces/{NS}/deployments/q-{kind}"
            template = (await get(client, path))["spec"]["template"]["spec"]
            patch = {
                "containers": normalise(template["containers"]),
                "volumes": normalise(template["volumes"]),
            }
            await merge_patch(client, path, {"spec": {"template": {"spec": patch}}})
        engine = await get(client, f"/apis/apps/v1/namespaces/{NS}/deployments/q-engine")
        assert engine["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] == "1Gi"
        writes_before = len(writes_to(emulator, paths))
        await asyncio.sleep(3)  # three resync rounds
        assert writes_to(emulator, paths)[writes_before:] == []


async def test_secret_env_is_refused_with_no_objects(
    cluster: tuple[Emulator, httpx.AsyncClient], tmp_path: Path
) -> None:
    """spec.env with a secretKeyRef (the chart does not allow it by default): a status and one Event say
    why, and not one child is made."""
    emulator, client = cluster
    secret_env = [{"name": "DB", "valueFrom": {"secretKeyRef": {"name": "db", "key": "password"}}}]
    md = modeldeployment("sneaky", env=secret_env)
    (await client.post(MD_PATH, json=md)).raise_for_status()

    async def failed() -> dict[str, Any] | None:
        status = (await get(client, f"{MD_PATH}/sneaky") or {}).get("status") or {}
        return status if status.get("phase") == "Failed" else None

    async def refused_events() -> list[dict[str, Any]]:
        events = (await get(client, f"/api/v1/namespaces/{NS}/events") or {}).get("items", [])
        return [e for e in events if e.get("reason") == "Refused" and e["involvedObject"]["name"] == "sneaky"]

    async with running_operator(str(client.base_url).rstrip("/"), tmp_path, "refused"):
        status = await eventually(failed, what="phase Failed for the refused spec")
        reconciled = {c["type"]: c for c in status["conditions"]}["Reconciled"]
        assert reconciled["status"] == "False" and "spec.env[0] (DB)" in reconciled["message"]
        (event,) = await eventually(refused_events, what="a Refused Event")
        assert event["type"] == "Warning" and "secretKeyRef" in event["message"]
        await asyncio.sleep(2.5)  # resync rounds: still nothing made, no new Events
        assert len(await refused_events()) == 1
    for manifest in render(md):
        assert await get(client, child_path(manifest)) is None, manifest["kind"]
    made = [path for method, path in emulator.log if method == "POST" and path != MD_PATH]
    assert all(path.endswith("/events") for path in made), made


async def test_idle_scale_down_through_the_scale_subresource(
    cluster: tuple[Emulator, httpx.AsyncClient], tmp_path: Path
) -> None:
    """spec.scaleFromZero: while a router keeps recording requests the engines stay; once it stops, the
    operator's resync sets the scale subresource to 0 after the delay, the HPA keeps its floor of 1, and a
    router's wake (the scale subresource back to 1) brings the engines back."""
    emulator, client = cluster
    md = modeldeployment(
        "idle", scaleFromZero={"scaleDownDelaySeconds": 3}, autoscaling={"minReplicas": 0, "maxReplicas": 4}
    )
    md["metadata"]["annotations"] = {LAST_REQUEST_ANNOTATION: format_time(time.time())}
    (await client.post(MD_PATH, json=md)).raise_for_status()
    engine_path = f"/apis/apps/v1/namespaces/{NS}/deployments/idle-engine"
    hpa_path = f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers/idle"
    merge = {"Content-Type": "application/merge-patch+json"}

    async def engine_replicas(want: int) -> bool:
        engine = await get(client, engine_path)
        return bool(engine) and engine["spec"]["replicas"] == want

    async with running_operator(str(client.base_url).rstrip("/"), tmp_path, "idle") as log:
        await eventually(lambda: engine_replicas(1), what="the engine Deployment at 1")
        hpa = await eventually(lambda: get(client, hpa_path), what="the HPA")
        assert hpa["spec"]["minReplicas"] == 1
        # a router with requests in flight refreshes the annotation: longer than the delay, still up
        for _ in range(10):
            await merge_patch(
                client, f"{MD_PATH}/idle",
                {"metadata": {"annotations": {LAST_REQUEST_ANNOTATION: format_time(time.time())}}},
            )  # fmt: skip
            await asyncio.sleep(0.5)
        assert (await get(client, f"{MD_PATH}/idle"))["spec"]["replicas"] == 1
        assert not any(path.endswith("/idle/scale") for _, path in emulator.log)
        # no more traffic: down to 0 through the scale subresource
        await eventually(lambda: engine_replicas(0), timeout=15, what="the engine Deployment at 0")
        assert (await get(client, f"{MD_PATH}/idle"))["spec"]["replicas"] == 0
        assert ("PATCH", f"{MD_PATH}/idle/scale") in emulator.log
        assert (await get(client, hpa_path))["spec"]["minReplicas"] == 1
        # a router wakes it (router/scaler.py's two writes): the engines come back, and stay
        stamp = {"metadata": {"annotations": {LAST_REQUEST_ANNOTATION: format_time(time.time())}}}
        await merge_patch(client, f"{MD_PATH}/idle", stamp)
        response = await client.patch(f"{MD_PATH}/idle/scale", json={"spec": {"replicas": 1}}, headers=merge)
        response.raise_for_status()
        await eventually(lambda: engine_replicas(1), what="the engine Deployment back at 1")
        await asyncio.sleep(1)
        assert await engine_replicas(1)
        assert "no request for 3s: engines scaled to 0" in log.read_text()


async def test_disaggregation_through_the_operator(
    cluster: tuple[Emulator, httpx.AsyncClient], tmp_path: Path
) -> None:
    """spec.disaggregation: the operator applies the prefill role beside the decode one, reads both into
    the status (Ready needs both), and removes the prefill role's children when the option goes."""
    _, client = cluster
    url = str(client.base_url).rstrip("/")
    md = modeldeployment("pd", resources={"gpus": 0}, disaggregation={"prefill": {"replicas": 2}})
    (await client.post(MD_PATH, json=md)).raise_for_status()
    deployments = f"/apis/apps/v1/namespaces/{NS}/deployments"
    prefill_paths = [
        f"{deployments}/pd-prefill",
        f"/api/v1/namespaces/{NS}/services/pd-prefill",
        f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/pd-prefill",
    ]

    async def md_status() -> dict[str, Any]:
        return (await get(client, f"{MD_PATH}/pd") or {}).get("status") or {}

    async with running_operator(url, tmp_path, "pd") as log:
        expected = render(md)
        assert {child_path(m) for m in expected} >= set(prefill_paths)

        async def children() -> bool:
            return all([await get(client, child_path(m)) for m in expected])

        await eventually(children, what="every child, the prefill role's too")
        prefill = await get(client, f"{deployments}/pd-prefill")
        assert prefill["spec"]["replicas"] == 2
        router = (await get(client, f"{deployments}/pd-router"))["spec"]["template"]["spec"]["containers"][0]
        assert router["args"][router["args"].index("--prefill-k8s-service") + 1] == "pd-prefill"

        # decode and router ready, prefill not yet: not Ready, and the status says which role waits
        for name, replicas in (("pd-engine", 1), ("pd-router", 2)):
            ready = {"replicas": replicas, "readyReplicas": replicas, "updatedReplicas": replicas}
            await merge_patch(
                client, f"{deployments}/{name}/status", {"status": {**ready, "observedGeneration": 1}}
            )

        async def prefill_waits() -> dict[str, Any] | None:
            status = await md_status()
            conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
            return status if conditions.get("EngineReady") == "True" else None

        status = await eventually(prefill_waits, what="the decode engines ready")
        assert status["phase"] != "Ready" and status["prefillReadyReplicas"] == 0
        assert {c["type"]: c["status"] for c in status["conditions"]}["PrefillEngineReady"] == "False"

        ready = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "observedGeneration": 1}
        await merge_patch(client, f"{deployments}/pd-prefill/status", {"status": ready})

        async def is_ready() -> dict[str, Any] | None:
            status = await md_status()
            return status if status.get("phase") == "Ready" else None

        status = await eventually(is_ready, what="phase Ready with both roles")
        assert (status["prefillReplicas"], status["prefillReadyReplicas"]) == (2, 2)

        # the option removed: the prefill role's children go, the router returns to its strategy
        await merge_patch(
            client,
            f"{MD_PATH}/pd",
            {"metadata": {"generation": 2, "resourceVersion": "2"}, "spec": {"disaggregation": None}},
        )

        async def colocated() -> bool:
            gone = [await get(client, path) is None for path in prefill_paths]
            status = await md_status()
            return all(gone) and "prefillReplicas" not in status

        await eventually(colocated, what="the prefill role's children deleted and its status fields gone")
        router = (await get(client, f"{deployments}/pd-router"))["spec"]["template"]["spec"]["containers"][0]
        assert "--prefill-k8s-service" not in router["args"]
        text = log.read_text()
        assert "Traceback" not in text and "[ERROR" not in text, text
