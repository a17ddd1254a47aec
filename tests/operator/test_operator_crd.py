"""crds/modeldeployment.yaml: its shape, its schema (structure, defaults, CEL rules), and that it agrees
with the operator's typed spec (operator/spec.py), from which operator/crd.py generates it."""

from __future__ import annotations

import copy
import typing
from typing import Any

import jsonschema
import pytest
from pagedserve.operator.spec import ModelDeploymentSpec, parse_spec
from pydantic import ValidationError

from pagedserve.testing.kube import CRDSchema, crd_jsonschema, load_crd, manifest_errors, walk
from pagedserve.testing.operator_examples import design_example

CRD = load_crd()
(VERSION,) = CRD["spec"]["versions"]
SCHEMA = CRDSchema(CRD)

EXAMPLE = design_example()


def with_spec(**changes: Any) -> dict[str, Any]:
    obj = copy.deepcopy(EXAMPLE)
    for path, value in changes.items():
        node = obj["spec"]
        *parents, leaf = path.split("__")
        for part in parents:
            node = node[part]
        if value is DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    return obj


DELETE = object()


def test_the_crd_is_a_valid_kubernetes_object() -> None:
    assert manifest_errors(CRD) == []  # strict, structural, for the oldest and newest minor
    assert CRD["metadata"]["name"] == "modeldeployments.pagedserve.io"
    spec = CRD["spec"]
    assert spec["group"] == "pagedserve.io" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "ModelDeployment" and spec["names"]["plural"] == "modeldeployments"
    assert spec["names"]["shortNames"] == ["md"]
    assert VERSION["name"] == "v1alpha1" and VERSION["served"] and VERSION["storage"]


def test_status_schema_matches_what_the_operator_writes() -> None:
    from pagedserve.operator.status import PHASES, compute_status

    status_schema = SCHEMA.schema["properties"]["status"]
    assert tuple(status_schema["properties"]["phase"]["enum"]) == PHASES
    written = compute_status(
        {"metadata": {"name": "m", "namespace": "ml", "generation": 1}},
        engine=None,
        router=None,
        replicas=1,
        router_replicas=1,
        error="boom",
    )
    assert SCHEMA.errors({**EXAMPLE, "status": written}) == []


def test_status_and_scale_subresources() -> None:
    assert VERSION["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }


def test_printer_columns() -> None:
    columns = {c["name"]: c for c in VERSION["additionalPrinterColumns"]}
    assert columns["Model"]["jsonPath"] == ".spec.model"
    assert columns["Replicas"]["jsonPath"] == ".spec.replicas"
    assert columns["Ready"]["jsonPath"] == ".status.readyReplicas"
    assert columns["Endpoint"]["jsonPath"] == ".status.endpoint"
    assert columns["Age"] == {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    names = [c["name"] for c in VERSION["additionalPrinterColumns"]]
    assert names[0] == "Model" and names[-1] == "Age"


def test_the_schema_is_structural_and_its_defaults_valid() -> None:
    """What the API server demands of a v1 CRD: a type everywhere, defaults that validate."""
    for path, node in walk(SCHEMA.schema):
        assert (
            "type" in node
            or node.get("x-kubernetes-int-or-string")
            or node.get("x-kubernetes-preserve-unknown-fields")
        ), f"{path} has no type"
        if "default" in node:
            validator = jsonschema.Draft4Validator(crd_jsonschema(node))
            assert list(validator.iter_errors(node["default"])) == [], path
        if node.get("x-kubernetes-validations"):  # CEL cost needs bounded strings under rules
            assert node.get("type") != "string" or "maxLength" in node or "enum" in node, path


def test_design_example_is_accepted() -> None:
    assert SCHEMA.errors(EXAMPLE) == []
    assert (
        SCHEMA.errors(
            {
                "apiVersion": "pagedserve.io/v1alpha1",
                "kind": "ModelDeployment",
                "metadata": {"name": "tiny"},
                "spec": {"model": "embedded"},
            }
        )
        == []
    )


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"replicas": -1}, "spec.replicas"),
        ({"router__strategy": "random"}, "spec.router.strategy"),
        ({"engine__blockSize": 12}, "spec.engine.blockSize"),
        ({"engine__blockSize": 64}, "spec.engine.blockSize"),
        ({"model": DELETE}, "spec.model"),
        ({"model": ""}, "spec.model"),
        ({"resources__gpus": -1}, "spec.resources.gpus"),
        ({"resources__memory": "lots"}, "spec.resources.memory"),
        ({"engine__gpuMemoryUtilization": 0}, "spec.engine.gpuMemoryUtilization"),
        ({"engine__gpuMemoryUtilization": 1.5}, "spec.engine.gpuMemoryUtilization"),
        ({"engine__dtype": "int8"}, "spec.engine.dtype"),
        ({"router__meanLoadFactor": 0.5}, "spec.router.meanLoadFactor"),
        ({"autoscaling__maxReplicas": DELETE}, "spec.autoscaling.maxReplicas"),
        ({"autoscaling__targetWaitingRequests": 0}, "spec.autoscaling.targetWaitingRequests"),
        ({"hfTokenSecret": {"key": "token"}}, "spec.hfTokenSecret.name"),
        ({"bogus": 1}, "spec"),
        # CEL rules (x-kubernetes-validations), spanning fields
        (
            {"autoscaling__minReplicas": 9},
            "spec.autoscaling.maxReplicas must be >= spec.autoscaling.minReplicas",
        ),
        (
            {"engine__maxNumBatchedTokens": 128},
            "spec.engine.maxNumBatchedTokens must be >= spec.engine.maxNumSeqs",
        ),
        ({"model": "pvc://Not_A_Claim/x"}, "spec.model"),
        ({"autoscaling__minReplicas": 0}, "spec.autoscaling.minReplicas 0 needs spec.scaleFromZero"),
        ({"tensorParallelSize": 2}, "spec.resources.gpus must be >= spec.tensorParallelSize"),
        ({"pipelineParallelSize": 2}, "spec.resources.gpus must be >= spec.tensorParallelSize"),
        ({"pipelineParallelSize": 0}, "spec.pipelineParallelSize"),
        ({"nodes": 3, "tensorParallelSize": 2}, "spec.nodes must divide"),
        ({"tensorParallelSize": 0}, "spec.tensorParallelSize"),
        ({"scaleFromZero": {"scaleDownDelaySeconds": 0}}, "spec.scaleFromZero.scaleDownDelaySeconds"),
        ({"scaleFromZero": {"maxHeldRequests": 0}}, "spec.scaleFromZero.maxHeldRequests"),
        # spec.disaggregation: one node per engine, on CPUs (the example's engines have a GPU)
        (
            {"disaggregation": {}, "resources__gpus": 0, "tensorParallelSize": 2, "nodes": 2},
            "spec.disaggregation needs nodes 1",
        ),
        ({"disaggregation": {}}, "spec.disaggregation needs CPU engines for now"),
        ({"disaggregation": {"prefill": {"replicas": 0}}}, "spec.disaggregation.prefill.replicas"),
    ],
)
def test_bad_specs_are_rejected_naming_the_field(changes: dict[str, Any], field: str) -> None:
    errors = SCHEMA.errors(with_spec(**changes))
    assert errors, changes
    assert any(field in error for error in errors), errors
    # the operator's typed spec rejects the same spec, naming the same field
    spec = SCHEMA.default(with_spec(**changes))["spec"]
    with pytest.raises(ValidationError) as error:
        parse_spec(spec)
    from pagedserve.operator.spec import format_validation_error

    named = format_validation_error(error.value)
    leaf = field.split(" ")[0].rsplit(".", 1)[-1]
    assert leaf in named or field.split(" ")[0] in named, named


def test_immutable_cache_fields_on_update() -> None:
    old = EXAMPLE
    new = with_spec(modelCache__storageClassName="fast")
    assert SCHEMA.errors(new) == []  # a new object may pick any class
    assert any("storageClassName is immutable" in e for e in SCHEMA.errors(new, old=old))
    assert SCHEMA.errors(with_spec(modelCache__size="80Gi"), old=old) == []  # growing is fine


@pytest.mark.parametrize(
    "spec",
    [
        {"model": "m"},
        EXAMPLE["spec"],
        {"model": "embedded", "resources": {"gpus": 0}},
        {"model": "m", "autoscaling": {"maxReplicas": 3}, "modelCache": {}, "apiKeySecret": {"name": "k"}},
        {"model": "m", "resources": {"cpu": 8, "memory": "1Gi"}, "router": {"resources": {"cpu": "500m"}}},
        {"model": "m", "autoscaling": {"minReplicas": 0, "maxReplicas": 2}, "scaleFromZero": {}},
        {"model": "m", "tensorParallelSize": 2, "resources": {"gpus": 2}},
        {"model": "embedded", "tensorParallelSize": 3, "resources": {"gpus": 0}},  # CPU ranks: no GPUs
        {"model": "m", "tensorParallelSize": 2, "pipelineParallelSize": 2, "resources": {"gpus": 4}},
        {"model": "m", "tensorParallelSize": 8, "pipelineParallelSize": 2, "nodes": 2,
         "resources": {"gpus": 8}},
        {"model": "embedded", "resources": {"gpus": 0}, "disaggregation": {}},
        {"model": "embedded", "replicas": 3, "resources": {"gpus": 0},
         "disaggregation": {"prefill": {"replicas": 2, "resources": {"gpus": 0, "cpu": 8}}}},
    ],
)
def test_crd_defaults_agree_with_the_typed_spec(spec: dict[str, Any]) -> None:
    """The API server's defaulting, then the operator's parsing, equals the operator's defaults alone."""
    defaulted = SCHEMA.default({"spec": copy.deepcopy(spec)})["spec"]
    assert parse_spec(defaulted) == parse_spec(spec)
    dumped = parse_spec(defaulted).model_dump(by_alias=True, exclude_none=True)
    # every field the typed spec has is in the CRD's schema, and the other way round
    assert _fields(ModelDeploymentSpec) == _schema_fields(SCHEMA.schema["properties"]["spec"])
    assert SCHEMA.errors({"spec": dumped}) == []


def _fields(model: Any, prefix: str = "") -> set[str]:
    out = set()
    for name, info in model.model_fields.items():
        alias = info.alias or name
        out.add(prefix + alias)
        annotation = info.annotation
        if typing.get_origin(annotation) is list:
            continue
        for candidate in typing.get_args(annotation) or (annotation,):
            if hasattr(candidate, "model_fields"):
                out |= _fields(candidate, f"{prefix}{alias}.")
    return out


def _schema_fields(schema: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for name, sub in schema.get("properties", {}).items():
        out.add(prefix + name)
        if sub.get("type") == "object" and "properties" in sub:
            out |= _schema_fields(sub, f"{prefix}{name}.")
    return out


def test_disaggregation_is_checked_by_the_crd_as_by_the_typed_spec() -> None:
    """The CEL rule alone (no other rule fires): a disaggregated spec of CPU engines is accepted, with
    tensor or pipeline ranks too, and the same across 2 nodes refused with the rule's message, by the API
    server's schema and by the operator's typed spec."""
    ok = {"model": "embedded", "resources": {"gpus": 0}, "disaggregation": {"prefill": {"replicas": 2}}}
    md = {"apiVersion": "pagedserve.io/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "pd"}}
    assert SCHEMA.errors({**md, "spec": ok}) == []
    assert parse_spec(ok).disaggregation is not None
    for split in ({"tensorParallelSize": 3}, {"pipelineParallelSize": 2, "tensorParallelSize": 3}):
        assert SCHEMA.errors({**md, "spec": {**ok, **split}}) == []
        assert parse_spec({**ok, **split}).disaggregation is not None
    message = ("spec.disaggregation needs nodes 1 (an engine's ranks register their KV caches at its pod's"
               " address)")
    for split in ({"nodes": 2, "tensorParallelSize": 2}, {"nodes": 2, "pipelineParallelSize": 2}):
        errors = SCHEMA.errors({**md, "spec": {**ok, **split}})
        assert len(errors) == 1 and message in errors[0], errors
        with pytest.raises(ValidationError, match="disaggregation needs nodes 1"):
            parse_spec({**ok, **split})
        # the same split without disaggregation is fine
        colocated = {key: value for key, value in {**ok, **split}.items() if key != "disaggregation"}
        assert SCHEMA.errors({**md, "spec": colocated}) == []


def test_status_schema_holds_a_disaggregated_status() -> None:
    from pagedserve.operator.status import compute_status

    written = compute_status(
        {"metadata": {"name": "m", "namespace": "ml", "generation": 1}},
        engine=None,
        router=None,
        replicas=1,
        router_replicas=1,
        prefill={"status": {"replicas": 2, "readyReplicas": 1}},
        prefill_replicas=2,
    )
    assert (written["prefillReplicas"], written["prefillReadyReplicas"]) == (2, 1)
    assert SCHEMA.errors({**EXAMPLE, "status": written}) == []
