"""spec.adapters: validation, rendering (LoRA flags, startup set, pvc:// mounts) and, with the real operator
against kmock, changes reaching running engine pods (fake engines on 127.0.0.x) without a restart, the
status per pod, and the rolling fallback when a pod refuses a load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from pagedserve.operator import render
from pagedserve.operator.adapters import plan, ready_pods, served_adapters
from pagedserve.operator.resources import ADAPTERS_HASH_ANNOTATION, STARTUP_ADAPTERS_ANNOTATION
from pagedserve.operator.spec import format_validation_error, parse_spec

from pagedserve.testing.fake_openai import FakeOpenAI
from pagedserve.testing.kube import manifest_errors
from pagedserve.testing.net import free_port
from pagedserve.testing.server_thread import ServerThread

NS = "ml"
MD_PATH = f"/apis/pagedserve.io/v1alpha1/namespaces/{NS}/modeldeployments"
ENGINE_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments/lora-engine"


def modeldeployment(adapters: list[dict[str, str]], annotations: dict[str, str] | None = None, **spec: Any):
    return {
        "apiVersion": "pagedserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {
            "name": "lora",
            "namespace": NS,
            "uid": "uid-lora",
            "resourceVersion": "1",
            "generation": 1,
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "annotations": annotations or {},
        },
        "spec": {"model": "org/base", "resources": {"gpus": 0}, "adapters": adapters, **spec},
    }


def engine_of(md: dict[str, Any]) -> dict[str, Any]:
    return next(m for m in render(md) if m["kind"] == "Deployment" and m["metadata"]["name"] == "lora-engine")


def container_of(engine: dict[str, Any]) -> dict[str, Any]:
    return engine["spec"]["template"]["spec"]["containers"][0]


ADAPTERS = [
    {"name": "sql", "url": "hf://acme/sql-lora"},
    {"name": "legal", "url": "pvc://loras/legal/v2"},
    {"name": "code", "url": "/opt/adapters/code"},
]


def test_render_with_adapters() -> None:
    engine = engine_of(modeldeployment(ADAPTERS, engine={"maxLoras": 4, "maxLoraRank": 64}))
    container = container_of(engine)
    args = container["args"]
    at = args.index("--enable-lora")
    assert args[at : at + 5] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "64"]
    modules = args[args.index("--lora-modules") + 1 :]
    assert modules == ["sql=acme/sql-lora", "legal=/adapters/loras/legal/v2", "code=/opt/adapters/code"]
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in container["env"]
    volumes = engine["spec"]["template"]["spec"]["volumes"]
    assert {
        "name": "adapters-0",
        "persistentVolumeClaim": {"claimName": "loras", "readOnly": True},
    } in volumes
    assert {"name": "adapters-0", "mountPath": "/adapters/loras", "readOnly": True} in container[
        "volumeMounts"
    ]
    assert ADAPTERS_HASH_ANNOTATION in engine["spec"]["template"]["metadata"]["annotations"]

    plain = container_of(engine_of(modeldeployment([])))
    assert "--enable-lora" not in plain["args"]
    assert not any(e["name"] == "VLLM_ALLOW_RUNTIME_LORA_UPDATING" for e in plain["env"])


def test_adapter_changes_leave_the_pod_template_alone() -> None:
    """With a startup set pinned, adding or removing adapters changes no engine manifest: the operator
    loads them at runtime. A new startup set (the fallback) changes the template."""
    pinned = {STARTUP_ADAPTERS_ANNOTATION: json.dumps(ADAPTERS[:1])}
    one = engine_of(modeldeployment(ADAPTERS[:1], pinned))
    assert engine_of(modeldeployment([ADAPTERS[0], ADAPTERS[2]], pinned)) == one
    assert engine_of(modeldeployment([], pinned)) == one  # the last one removed: LoRA stays on
    repinned = {STARTUP_ADAPTERS_ANNOTATION: json.dumps([ADAPTERS[0], ADAPTERS[2]])}
    rolled = engine_of(modeldeployment([ADAPTERS[0], ADAPTERS[2]], repinned))
    assert rolled["spec"]["template"] != one["spec"]["template"]
    assert "code=/opt/adapters/code" in container_of(rolled)["args"]


@pytest.mark.parametrize(
    ("adapters", "spec", "message"),
    [
        ([{"name": "Sql", "url": "/a"}], {}, "spec.adapters.0.name"),
        ([{"name": "sql", "url": "s3://bucket/a"}], {}, "spec.adapters.0.url"),
        ([{"name": "sql", "url": "hf://just-a-name"}], {}, "spec.adapters.0.url"),
        ([{"name": "sql", "url": "/a"}, {"name": "sql", "url": "/b"}], {}, "names must be unique"),
        ([{"name": "base", "url": "/a"}], {"servedModelName": "base"}, "spec.servedModelName"),
    ],
)
def test_bad_adapters_are_refused(adapters: list[dict[str, str]], spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_spec({"model": "org/base", "adapters": adapters, **spec})
    assert message in format_validation_error(refused.value)


@pytest.mark.parametrize(
    ("adapters", "spec", "message"),
    [
        ([{"name": "Sql", "url": "/a"}], {}, "spec.adapters[].name must be lower case"),
        ([{"name": "sql", "url": "s3://bucket/a"}], {}, "spec.adapters[].url must be hf://"),
        (
            [{"name": "sql", "url": "/a"}, {"name": "sql", "url": "/b"}],
            {},
            "spec.adapters[].name must be unique",
        ),
        (
            [{"name": "base", "url": "/a"}],
            {"servedModelName": "base"},
            "must differ from spec.servedModelName",
        ),
    ],
)
def test_the_api_server_refuses_bad_adapters(
    adapters: list[dict[str, str]], spec: dict[str, Any], message: str
):
    """The generated CRD's own rules (CEL), evaluated as the API server would (pagedserve/testing/kube.py)."""
    found = manifest_errors(modeldeployment(adapters, **spec))
    assert found and all(message in error for error in found), found
    assert manifest_errors(modeldeployment([{"name": "sql", "url": "hf://acme/sql"}])) == []


def test_adapter_named_like_the_model_is_refused_at_render() -> None:
    with pytest.raises(ValueError, match="served model name"):
        render(modeldeployment([{"name": "lora", "url": "/a"}]))


def test_plan_and_ready_pods() -> None:
    cards = [{"id": "base", "parent": None}]
    cards += [
        {"id": name, "root": root, "parent": "base"}
        for name, root in (("a", "/a"), ("b", "/b-old"), ("gone", "/g"))
    ]
    served = served_adapters({"data": cards})
    assert plan(served, {"a": "/a", "b": "/b", "new": "/n"}) == (["b", "gone"], ["b", "new"])
    pods = [
        pod("p1", "10.0.0.1"),
        pod("p2", "10.0.0.2", ready=False),
        pod("p3", None),
        {**pod("p4", "10.0.0.4"), "metadata": {"name": "p4", "deletionTimestamp": "2026-01-01T00:00:00Z"}},
    ]
    assert [p.name for p in ready_pods(pods)] == ["p1"]


def pod(name: str, ip: str | None, ready: bool = True) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    labels = {
        "app.kubernetes.io/name": "pagedserve",
        "app.kubernetes.io/instance": "lora",
        "app.kubernetes.io/component": "engine",
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {"containers": [{"name": "engine", "image": "x"}]},
        "status": status,
    }


# -- the real operator against kmock --------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_operator_loads_and_unloads_adapters_on_ready_pods(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("kmock")
    pytest.importorskip("kopf")
    from pagedserve.testing.kmock_cluster import emulated_cluster, eventually, get, running_operator

    port = free_port()
    monkeypatch.setenv("PAGEDSERVE_OPERATOR_ENGINE_PORT", str(port))  # where the operator calls the pods
    first = [{"name": "sql", "url": "hf://acme/sql-lora"}]
    engines = {
        f"lora-engine-{i}": ServerThread(
            FakeOpenAI(name=f"lora-engine-{i}", served_model_name="lora", enable_lora=True,
                       adapters={"sql": "acme/sql-lora"}),  # started with the startup set
            port=port, host=f"127.0.0.{i + 2}",
        ).start()
        for i in range(3)  # lora-engine-2 becomes ready later
    }  # fmt: skip
    fakes = {name: server.app for name, server in engines.items()}
    posted = ["lora-engine-0", "lora-engine-1"]
    try:
        async with emulated_cluster() as (_, client):
            (await client.post(MD_PATH, json=modeldeployment(first))).raise_for_status()
            for i, name in enumerate(posted):
                (
                    await client.post(f"/api/v1/namespaces/{NS}/pods", json=pod(name, f"127.0.0.{i + 2}"))
                ).raise_for_status()
            # not ready: never called (nothing listens on 127.0.0.9; a call would fail and roll the engines)
            unready = pod("lora-engine-x", "127.0.0.9", ready=False)
            (await client.post(f"/api/v1/namespaces/{NS}/pods", json=unready)).raise_for_status()

            async def md() -> dict[str, Any]:
                return await get(client, f"{MD_PATH}/lora") or {}

            async def status_adapters() -> list[dict[str, Any]] | None:
                return (await md()).get("status", {}).get("adapters")

            def on_pods(*names: str) -> list[dict[str, Any]]:
                return [{"pod": pod_name, "adapters": sorted(names)} for pod_name in posted]

            async with running_operator(str(client.base_url).rstrip("/"), tmp_path, "adapters") as log:
                # the first adapters: the startup set is pinned and the engines start with it
                engine = await eventually(lambda: get(client, ENGINE_PATH), what="the engine Deployment")
                assert "sql=acme/sql-lora" in container_of(engine)["args"]
                template = engine["spec"]["template"]
                assert (
                    json.loads((await md())["metadata"]["annotations"][STARTUP_ADAPTERS_ANNOTATION]) == first
                )

                async def listed(*names: str):
                    return await status_adapters() == on_pods(*names)

                await eventually(lambda: listed("sql"), what="status.adapters per pod")
                assert (await md())["status"]["adapterCount"] == 1

                # add two adapters -> loaded on every ready pod; the pod template unchanged
                more = [
                    *first,
                    {"name": "code", "url": "/opt/adapters/code"},
                    {"name": "fr", "url": "hf://acme/fr"},
                ]
                await merge_patch(client, f"{MD_PATH}/lora", {"spec": {"adapters": more}})
                await eventually(lambda: listed("sql", "code", "fr"), what="code and fr loaded")
                for name in posted:
                    assert fakes[name].adapters == {
                        "sql": "acme/sql-lora",
                        "code": "/opt/adapters/code",
                        "fr": "acme/fr",
                    }
                assert (await md())["status"]["adapterCount"] == 3
                assert (await get(client, ENGINE_PATH))["spec"]["template"] == template

                # remove one -> unloaded everywhere, still no template change
                await merge_patch(client, f"{MD_PATH}/lora", {"spec": {"adapters": more[1:]}})
                await eventually(lambda: listed("code", "fr"), what="sql unloaded")
                assert all("sql" not in fakes[name].adapters for name in posted)
                assert (await get(client, ENGINE_PATH))["spec"]["template"] == template

                # a pod ready later (a scale-up: it started with the startup set) gets the spec's adapters
                posted.append("lora-engine-2")
                late = pod("lora-engine-2", "127.0.0.4")
                (await client.post(f"/api/v1/namespaces/{NS}/pods", json=late)).raise_for_status()
                await eventually(lambda: listed("code", "fr"), what="the late pod's adapters")
                assert fakes["lora-engine-2"].adapters == {"code": "/opt/adapters/code", "fr": "acme/fr"}
                assert (await get(client, ENGINE_PATH))["spec"]["template"] == template

                # a pod refuses a load -> the fallback: the startup set becomes the spec's, the engines roll
                fakes["lora-engine-1"].refuse_loads = True
                last = [*more[1:], {"name": "legal", "url": "/opt/adapters/legal"}]
                await merge_patch(client, f"{MD_PATH}/lora", {"spec": {"adapters": last}})

                async def rolled() -> dict[str, Any] | None:
                    engine = await get(client, ENGINE_PATH)
                    return engine if engine["spec"]["template"] != template else None

                engine = await eventually(rolled, what="the rolling fallback")
                args = container_of(engine)["args"]
                assert args[args.index("--lora-modules") + 1 :] == [
                    "code=/opt/adapters/code", "fr=acme/fr", "legal=/opt/adapters/legal",
                ]  # fmt: skip
                assert (
                    json.loads((await md())["metadata"]["annotations"][STARTUP_ADAPTERS_ANNOTATION]) == last
                )
                assert "legal" in fakes["lora-engine-0"].adapters  # the pod that could load it did
                assert "legal" not in fakes["lora-engine-1"].adapters
                assert "Traceback" not in log.read_text()
    finally:
        for server in engines.values():
            server.stop()


async def merge_patch(client: httpx.AsyncClient, path: str, patch: dict[str, Any]) -> None:
    response = await client.patch(path, json=patch, headers={"Content-Type": "application/merge-patch+json"})
    response.raise_for_status()


@pytest.mark.timeout(60)
async def test_pods_that_cannot_be_listed_fail_no_child(tmp_path: Path) -> None:
    """An operator without `list pods` (an old ClusterRole): the status says so, every child is applied."""
    pytest.importorskip("kmock")
    pytest.importorskip("kopf")
    from pagedserve.testing.kmock_cluster import emulated_cluster, eventually, get, running_operator

    async with emulated_cluster() as (emulator, client):
        emulator[f"get /api/v1/namespaces/{NS}/pods"] << 403
        pinned = {STARTUP_ADAPTERS_ANNOTATION: json.dumps(ADAPTERS[:1])}
        (await client.post(MD_PATH, json=modeldeployment(ADAPTERS[:1], pinned))).raise_for_status()
        async with running_operator(str(client.base_url).rstrip("/"), tmp_path, "no-pods"):

            async def failed() -> dict[str, Any] | None:
                status = (await get(client, f"{MD_PATH}/lora") or {}).get("status") or {}
                return status if status.get("phase") == "Failed" else None

            status = await eventually(failed, what="phase Failed")
            reconciled = {c["type"]: c for c in status["conditions"]}["Reconciled"]
            assert "listing the engine pods" in reconciled["message"] and "403" in reconciled["message"]
            assert await get(client, ENGINE_PATH) is not None
