"""pagedserve/testing/kube.py would catch what the API server rejects: the checks are not vacuous."""

from __future__ import annotations

import copy

import pytest
from pagedserve.operator import render
from pagedserve.operator.crd import crd
from pagedserve.operator.status import ModelDeploymentStatus, compute_status

from pagedserve.testing.kube import KUBERNETES_MINORS, errors, manifest_errors, structural_errors

MD = {
    "apiVersion": "pagedserve.io/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "m", "namespace": "ml", "uid": "u"},
    "spec": {"model": "m"},
}


def child(kind: str) -> dict:
    return copy.deepcopy(next(c for c in render(MD) if c["kind"] == kind))


def test_two_minors_oldest_first() -> None:
    oldest, newest = (tuple(int(part) for part in minor.split(".")) for minor in KUBERNETES_MINORS)
    assert oldest < newest


@pytest.mark.parametrize("minor", KUBERNETES_MINORS)
def test_built_in_kinds_reject_unknown_fields_and_bad_quantities(minor: str) -> None:
    service = child("Service")
    service["spec"]["bogus"] = True
    assert any("bogus" in e for e in errors(service, minor))
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "c"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "lots"}}},
    }
    assert any("requests.storage" in e for e in errors(pvc, minor))


def test_prometheus_operator_kinds_are_strict() -> None:
    monitor = child("PodMonitor")
    assert manifest_errors(monitor) == []
    monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "30s"
    monitor["spec"]["podMetricsEndpoints"][0]["scheme"] = "ftp"
    problems = errors(monitor, KUBERNETES_MINORS[0])
    assert any("intervall" in e for e in problems), problems
    assert any("podMetricsEndpoints.0.scheme" in e for e in problems), problems


def test_leaderworkersets_are_checked_envelope_and_pod_templates() -> None:
    multi_node = {**MD, "spec": {"model": "m", "nodes": 2, "pipelineParallelSize": 2}}
    lws = copy.deepcopy(next(c for c in render(multi_node) if c["kind"] == "LeaderWorkerSet"))
    assert manifest_errors(lws) == []
    group = lws["spec"]["leaderWorkerTemplate"]
    group["restartPolicy"] = "Always"
    group["workerTemplate"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    lws["spec"]["sizee"] = 2
    problems = errors(lws, KUBERNETES_MINORS[0])
    assert any("leaderWorkerTemplate.restartPolicy" in e for e in problems), problems
    worker = "workerTemplate.spec.containers.0"
    assert any(worker in e and "imagePullPolicyy" in e for e in problems), problems
    assert any(e.startswith("spec: ") and "sizee" in e for e in problems), problems


def test_structural_rules_catch_what_the_api_server_rejects() -> None:
    assert structural_errors({"type": "object", "properties": {"a": {"description": "no type"}}}) == [
        "a: no type"
    ]
    nullable_trick = {
        "type": "object",
        "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
    }
    assert any("anyOf" in e for e in structural_errors(nullable_trick))
    bad_default = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "default": 0}}}
    assert any("default" in e for e in structural_errors(bad_default))
    broken = crd()
    broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "model"
    ].pop("type")
    assert any("spec.model: no type" in e for e in manifest_errors(broken))


def test_modeldeployment_unknown_fields_and_cel_rules() -> None:
    bad = copy.deepcopy(MD)
    bad["spec"]["engine"] = {"maxNumSeqs": 8, "maxNumBatchedTokens": 4, "bogus": 1}
    assert any("bogus" in e for e in manifest_errors(bad))
    del bad["spec"]["engine"]["bogus"]
    assert any("maxNumBatchedTokens must be >=" in e for e in manifest_errors(bad))


def test_the_status_model_reads_what_the_operator_writes() -> None:
    written = compute_status(
        {"metadata": {"name": "m", "namespace": "ml", "generation": 2}},
        engine=None,
        router=None,
        replicas=1,
        router_replicas=1,
    )
    status = ModelDeploymentStatus.model_validate(written)
    assert status.model_dump(by_alias=True, exclude_none=True, mode="json")["phase"] == written["phase"]
