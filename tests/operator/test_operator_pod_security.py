"""Every pod the operator makes, and every pod template of the chart, passes PodSecurity "restricted"
(pagedserve/testing/pod_security.py) and can write where the engine and router write."""

from __future__ import annotations

from typing import Any

import pytest
from pagedserve.operator import render
from pagedserve.operator.resources import ENGINE_WRITABLE_ENV, HF_HOME, RUN_AS_USER, WRITABLE_ENV

from pagedserve.testing.helm import find_tool
from pagedserve.testing.helm import render as helm_render
from pagedserve.testing.operator_examples import LORA_SPEC, design_example
from pagedserve.testing.pod_security import pods_of, restricted_violations

UID = "6c1f3b2e-1d7e-4a53-a1f9-9a8e1e0a1b2c"


def md(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pagedserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "m", "namespace": "ml", "uid": UID},
        "spec": {"model": "meta-llama/Llama-3.1-8B-Instruct", **spec},
    }


SPECS: dict[str, dict[str, Any]] = {
    "gpu-defaults": md(),
    "cpu-embedded": md(model="embedded", resources={"gpus": 0}),
    "gpus-pvc-cache-hf-token": md(
        resources={"gpus": 4}, modelCache={"size": "100Gi"}, hfTokenSecret={"name": "hf"}
    ),
    "cpu-pvc-cache": md(resources={"gpus": 0}, modelCache={"size": "10Gi"}),
    "pvc-model": md(model="pvc://weights/llama", router={"replicas": 1}),
    "design-example": design_example(uid=UID),
    "lora-adapters": md(**LORA_SPEC),
}


def workloads(modeldeployment: dict[str, Any]) -> list[dict[str, Any]]:
    return [child for child in render(modeldeployment) if list(pods_of(child))]


@pytest.mark.parametrize("case", sorted(SPECS))
def test_operator_pods_pass_the_restricted_profile(case: str) -> None:
    found = workloads(SPECS[case])
    assert [w["metadata"]["name"].rsplit("-", 1)[1] for w in found] == ["engine", "router"]
    for workload in found:
        assert restricted_violations(workload) == [], workload["metadata"]["name"]


@pytest.mark.parametrize("case", sorted(SPECS))
def test_every_write_goes_to_a_writable_volume(case: str) -> None:
    """Root filesystem read-only: HOME, the caches and HF_HOME are mounts (emptyDir or the cache PVC)."""
    for workload in workloads(SPECS[case]):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == RUN_AS_USER
        assert pod["securityContext"]["fsGroup"] == RUN_AS_USER  # the cache volume belongs to the user
        (container,) = pod["containers"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        volumes = {v["name"]: v for v in pod["volumes"]}
        writable = {
            m["mountPath"]
            for m in container["volumeMounts"]
            if not m.get("readOnly")
            and ("emptyDir" in volumes[m["name"]] or "persistentVolumeClaim" in volumes[m["name"]])
        }
        env = {e["name"]: e.get("value") for e in container["env"]}
        expected = {"HF_HOME": HF_HOME, **WRITABLE_ENV}
        if container["name"] == "engine":
            expected.update(ENGINE_WRITABLE_ENV)
        for name, path in expected.items():
            assert env[name] == path
            assert any(path == mount or path.startswith(f"{mount}/") for mount in writable), (name, path)


def test_only_the_router_gets_an_api_token() -> None:
    pods = {w["metadata"]["name"]: w["spec"]["template"]["spec"] for w in workloads(SPECS["gpu-defaults"])}
    assert pods["m-engine"]["automountServiceAccountToken"] is False
    assert pods["m-router"].get("automountServiceAccountToken", True) is True  # it reads EndpointSlices


CHART_CASES = {
    "default": None,
    "all-on": {"sample": {"enabled": True}, "operator": {"replicas": 2, "peering": "p"}},
}


@pytest.mark.skipif(find_tool("helm") is None, reason="helm missing: run `make tools`")
@pytest.mark.parametrize("case", sorted(CHART_CASES))
def test_chart_pods_pass_the_restricted_profile(case: str) -> None:
    objects = helm_render(CHART_CASES[case])
    templated = [o for o in objects if list(pods_of(o))]
    assert [o["kind"] for o in templated] == ["Deployment"]  # the operator
    for obj in templated:
        assert restricted_violations(obj) == [], obj["metadata"]["name"]
    # the chart's sample ModelDeployment, as the operator renders it
    for sample in (o for o in objects if o["kind"] == "ModelDeployment"):
        sample["metadata"]["uid"] = UID
        for workload in workloads(sample):
            assert restricted_violations(workload) == [], workload["metadata"]["name"]
