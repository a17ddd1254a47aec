"""pagedserve/testing/kube.py would catch what the API server rejects: the checks are not vacuous."""

from __future__ import annotations

import copy

import pytest
from pagedserve.operator import render
from pagedserve.operator.crd import crd
from pagedserve.operator.status import ModelDeploymentStatus, compute_status

from pagedserve.testing.kube import (
    KUBERNETES_MINORS,
    LWS_API_VERSION,
    LWS_CRD_PATH,
    errors,
    lws_schema,
    manifest_errors,
    structural_errors,
)

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


def multi_node_lws() -> dict:
    multi_node = {**MD, "spec": {"model": "m", "nodes": 2, "pipelineParallelSize": 2}}
    return copy.deepcopy(next(c for c in render(multi_node) if c["kind"] == "LeaderWorkerSet"))


def test_the_vendored_lws_crd_is_the_validator() -> None:
    """LeaderWorkerSets go through LWS's own CRD (vendored), the way the ModelDeployment goes through ours."""
    schema = lws_schema()
    assert LWS_CRD_PATH.is_file()
    assert (schema.api_version, schema.kind) == (LWS_API_VERSION, "LeaderWorkerSet")
    group = schema.schema["properties"]["spec"]["properties"]["leaderWorkerTemplate"]
    # the pod templates are full PodTemplateSpecs in the CRD, not free-form objects
    assert "containers" in group["properties"]["workerTemplate"]["properties"]["spec"]["properties"]
    # its defaults apply: a bare group gets LWS's restart and startup policies
    defaulted = schema.default({"spec": {"leaderWorkerTemplate": {"workerTemplate": {}}}})
    assert defaulted["spec"]["startupPolicy"] == "LeaderCreated"
    assert defaulted["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"


def test_leaderworkersets_are_checked_against_lws_crd_and_pod_templates() -> None:
    lws = multi_node_lws()
    assert manifest_errors(lws) == []
    group = lws["spec"]["leaderWorkerTemplate"]
    group["workerTemplate"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    lws["spec"]["sizee"] = 2
    problems = errors(lws, KUBERNETES_MINORS[0])
    worker = "workerTemplate.spec.containers.0"
    assert any(worker in e and "imagePullPolicyy" in e for e in problems), problems
    assert any(e.startswith("spec: ") and "sizee" in e for e in problems), problems


GROUP = "spec.leaderWorkerTemplate"


@pytest.mark.parametrize(
    ("where", "field", "value", "expected"),
    [
        ("group", "sizee", 2, f"{GROUP}: Additional properties are not allowed ('sizee' was unexpected)"),
        ("group", "size", "2", f"{GROUP}.size: '2' is not of type 'integer'"),
        ("group", "restartPolicy", "Always", f"{GROUP}.restartPolicy: 'Always' is not one of"),
        ("spec", "startupPolicy", "LeaderStarted", "spec.startupPolicy: 'LeaderStarted' is not one of"),
        ("spec", "replicas", -1, "spec.replicas: -1 is less than the minimum of 0"),
        ("spec", "networkConfig", {"subdomainPolicy": "Own"}, "spec.networkConfig.subdomainPolicy: 'Own'"),
        ("spec", "networkConfig", {}, "spec.networkConfig.subdomainPolicy: Required value"),
        ("leader", "metadata", {"labelz": {}}, f"{GROUP}.leaderTemplate.metadata: Additional properties"),
    ],
)
def test_lws_crd_rejects_a_broken_lws(where: str, field: str, value: object, expected: str) -> None:
    """Each is reported by LWS's CRD schema itself (lws_schema().errors), then by errors() as a whole."""
    lws = multi_node_lws()
    spec = lws["spec"]
    target = {"spec": spec, "group": spec["leaderWorkerTemplate"],
              "leader": spec["leaderWorkerTemplate"]["leaderTemplate"]}[where]
    target[field] = value
    from_crd = lws_schema().errors(lws)
    assert any(e.startswith(expected) for e in from_crd), from_crd
    assert any(e.startswith(expected) for e in errors(lws, KUBERNETES_MINORS[-1]))
    assert manifest_errors(lws) != []


def test_lws_without_its_group_or_name_is_rejected() -> None:
    lws = multi_node_lws()
    del lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    del lws["metadata"]["name"]
    problems = errors(lws, KUBERNETES_MINORS[0])
    assert "spec.leaderWorkerTemplate.workerTemplate: Required value" in problems, problems
    assert "metadata.name: Required value" in problems, problems


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
