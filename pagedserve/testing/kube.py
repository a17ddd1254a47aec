"""Strict Kubernetes manifest validation for the chart, operator and monitoring tests, with no cluster.

- Built-in kinds: the official OpenAPI schemas that PyPI ``kubernetes-validate`` ships per Kubernetes
  version, in their strict form (unknown fields are errors, as with ``kubectl apply --validate=strict``).
  Every manifest is checked against each of ``KUBERNETES_MINORS``: the oldest and the newest minor
  pagedserve supports.
- ModelDeployment: the CRD in crds/modeldeployment.yaml (generated from operator/spec.py by
  ``make manifests``), applied as the API server does: defaulting, the structural schema (unknown fields
  rejected, x-kubernetes-int-or-string, x-kubernetes-preserve-unknown-fields) and the CEL
  ``x-kubernetes-validations`` rules, evaluated with cel-python.
- LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, rendered for ``spec.nodes > 1``): the same way, against
  LWS's own CRD, vendored in vendor/lws/ from kubernetes-sigs/lws; its pod templates also against
  Kubernetes' PodTemplate schema of each minor.
- Prometheus Operator kinds (PodMonitor, ServiceMonitor, PrometheusRule): the JSON schemas of the
  pydantic models that PyPI ``cloudcoil-models-prometheus-operator`` generates from the official CRDs,
  made strict here (those models ignore unknown fields; the API server with strict field validation
  rejects them).
- CustomResourceDefinitions: the strict built-in schema plus the structural-schema rules the API
  server enforces on a v1 CRD (``structural_errors``).

Messages read ``path: message`` with the path as the API server writes it (``spec.engine.blockSize``).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import referencing
import yaml
from kubernetes_validate import utils as kv

from pagedserve.operator.spec import QUANTITY_RE

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "modeldeployment.yaml"

# The oldest and the newest Kubernetes minor pagedserve supports: every manifest is checked against both.
# 1.28 serves everything the CRD and the operator's output use (autoscaling/v2, policy/v1, CEL validation
# rules and the ReadWriteOncePod access mode on by default); 1.37 is the newest kubernetes-validate ships.
OLDEST_KUBERNETES = "1.28"
NEWEST_KUBERNETES = "1.37"
KUBERNETES_MINORS = (OLDEST_KUBERNETES, NEWEST_KUBERNETES)

QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
PMO_API_VERSION = "monitoring.coreos.com/v1"
PMO_KINDS = ("PodMonitor", "ServiceMonitor", "PrometheusRule")
KEDA_API_VERSION = "keda.sh/v1alpha1"
KEDA_KINDS = ("ScaledObject",)


def _path(error: jsonschema.ValidationError) -> str:
    return ".".join(str(part) for part in error.absolute_path) or "<root>"


def describe(error: jsonschema.ValidationError) -> str:
    """'path: message'; a missing required field is named itself, as the API server does."""
    if error.validator == "required":
        missing = error.message.split("'")[1]
        parts = [str(part) for part in error.absolute_path] + [missing]
        return f"{'.'.join(parts)}: Required value"
    return f"{_path(error)}: {error.message}"


# -- built-in kinds: kubernetes-validate's schemas --------------------------------------------------


@functools.cache
def _definitions(minor: str) -> referencing.Resource:
    """The strict `_definitions.json` of one minor, with the API server's quantity grammar added:
    kubernetes-validate types a Quantity as any string, the API server parses it."""
    path = f"kubernetes-json-schema/v{minor}.0-local-strict/_definitions.json"
    document = copy.deepcopy(kv.schema_contents(path, minor))
    document["$defs"][QUANTITY] = {
        "oneOf": [{"type": "string", "pattern": QUANTITY_RE.pattern}, {"type": "number"}]
    }
    return referencing.Resource.from_contents(document)


@functools.cache
def builtin_validator(api_version: str, kind: str, minor: str) -> jsonschema.Draft202012Validator:
    """The strict validator of a built-in kind, found the way kubernetes_validate.utils.validate does."""
    if minor not in {kv.major_minor(version) for version in kv.all_versions()}:
        raise kv.VersionNotSupportedError(minor)
    # rbac.authorization.k8s.io/v1 -> rbac-v1, v1 -> v1
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    filename = f"kubernetes-json-schema/v{minor}.0-local-strict/{kind.lower()}-{group_version}.json"
    try:
        schema = kv.schema_contents(filename, minor)
    except FileNotFoundError:
        raise kv.SchemaNotFoundError(kind=kind, version=minor, api_version=api_version) from None
    registry = referencing.Resource.from_contents(schema) @ (_definitions(minor) @ referencing.Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def builtin_errors(manifest: dict[str, Any], minor: str) -> list[str]:
    validator = builtin_validator(manifest.get("apiVersion", ""), manifest.get("kind", ""), minor)
    return sorted(describe(error) for error in validator.iter_errors(manifest))


# -- Prometheus Operator kinds ------------------------------------------------------------------------


def _forbid_unknown(node: Any) -> Any:
    """Every object schema with properties rejects other fields (recursively, $defs included).

    pydantic writes each optional field as ``anyOf: [X, {type: null}]``; that becomes X, so that an error
    names the field deep inside instead of "not valid under any of the given schemas"."""
    if isinstance(node, list):
        return [_forbid_unknown(item) for item in node]
    if not isinstance(node, dict):
        return node
    choices = node.get("anyOf", [])
    if len(choices) == 2 and {"type": "null"} in choices:
        (inner,) = [choice for choice in choices if choice != {"type": "null"}]
        node = {**{k: v for k, v in node.items() if k != "anyOf"}, **inner}
    out = {key: _forbid_unknown(value) if key != "properties" else value for key, value in node.items()}
    if "properties" in node:  # property names are data, their schemas are not
        out["properties"] = {name: _forbid_unknown(sub) for name, sub in node["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


def _cloudcoil_validator(model: Any) -> jsonschema.Draft202012Validator:
    schema = _forbid_unknown(model.model_json_schema(by_alias=True))
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
    return jsonschema.Draft202012Validator(schema)


@functools.cache
def pmo_validator(kind: str) -> jsonschema.Draft202012Validator:
    from cloudcoil.models.prometheus_operator import v1

    return _cloudcoil_validator(getattr(v1, kind))


@functools.cache
def keda_validator(kind: str) -> jsonschema.Draft202012Validator:
    """KEDA's kinds (the chart's ScaledObjects), from the pydantic models generated from KEDA's CRDs."""
    from cloudcoil.models.keda import v1alpha1

    return _cloudcoil_validator(getattr(v1alpha1, kind))


# -- CRDs: structural schema rules -----------------------------------------------------------------


def walk(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every node of an openAPIV3Schema with its path (``a.b``, ``a[]``, ``a{}``)."""
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}" if path else name)
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def structural_errors(schema: dict[str, Any]) -> list[str]:
    """What the API server demands of a v1 CRD's openAPIV3Schema beyond its shape: a structural schema
    (https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/
    #specifying-a-structural-schema), defaults that validate, list-map keys that are required."""
    problems = []
    for path, node in walk(schema):
        where = path or "<root>"
        int_or_string = node.get("x-kubernetes-int-or-string")
        free_form = node.get("x-kubernetes-preserve-unknown-fields")
        if not node.get("type") and not int_or_string and not free_form:
            problems.append(f"{where}: no type")
        if int_or_string and "type" in node:
            problems.append(f"{where}: x-kubernetes-int-or-string with a type")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{where}: properties and additionalProperties together")
        for junctor in ("allOf", "anyOf", "oneOf", "not"):
            if junctor in node:  # the nullable-via-anyOf trick included: types may not hide in junctors
                problems.append(f"{where}: {junctor} (the generator emits none)")
        if "$ref" in node:
            problems.append(f"{where}: $ref is not allowed")
        if "default" in node:
            errors = list(jsonschema.Draft4Validator(crd_jsonschema(node)).iter_errors(node["default"]))
            problems += [f"{where}: default: {error.message}" for error in errors]
        if node.get("x-kubernetes-list-type") == "map":
            required = set(node.get("items", {}).get("required", []))
            if not set(node.get("x-kubernetes-list-map-keys", [])) <= required:
                problems.append(f"{where}: list-map keys must be required in the items")
    metadata = schema.get("properties", {}).get("metadata", {})
    if set(metadata) - {"type"}:
        problems.append("metadata: only `type: object` is allowed at the root")
    return problems


def crd_errors(crd: dict[str, Any], minor: str) -> list[str]:
    """A CustomResourceDefinition as the API server checks it: its shape, then each version's schema."""
    problems = builtin_errors(crd, minor)
    for version in crd.get("spec", {}).get("versions", []):
        schema = version.get("schema", {}).get("openAPIV3Schema", {})
        problems += [f"{version.get('name')}: {p}" for p in structural_errors(schema)]
    return problems


# -- custom resources: a CRD's schema as the API server applies it -----------------------------------


def crd_jsonschema(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD structural schema (OpenAPI v3.0) -> a strict draft-4 JSON schema (unknown fields rejected)."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: crd_jsonschema(sub) for name, sub in value.items()}
        elif key == "items" or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = crd_jsonschema(value)
        elif key.startswith("x-kubernetes-") or key in ("default", "description", "nullable", "format"):
            continue
        else:
            out[key] = value
    if schema.get("x-kubernetes-int-or-string"):
        string = {"type": "string"}
        if "pattern" in out:
            string["pattern"] = out.pop("pattern")
        out["anyOf"] = [{"type": "integer"}, string]
    if schema.get("nullable"):
        out = {"anyOf": [out, {"type": "null"}]}
    if (
        schema.get("type") == "object"
        and "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """The API server's defaulting: absent fields with a default get it, then recurse."""
    if isinstance(value, dict) and schema.get("type") == "object":
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = _apply_defaults(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in list(value):
                if name not in schema.get("properties", {}):
                    value[name] = _apply_defaults(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_apply_defaults(schema["items"], item) for item in value]
    return value


@functools.cache
def _cel_program(rule: str) -> Any:
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_errors(schema: dict[str, Any], value: Any, old: Any = None, path: str = "") -> list[str]:
    """Evaluate each x-kubernetes-validations rule on the value it sits on (transition rules need old)."""
    import celpy

    problems: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        uses_old = "oldSelf" in rule["rule"]
        if uses_old and old is None:
            continue
        activation = {"self": celpy.json_to_cel(value)}
        if uses_old:
            activation["oldSelf"] = celpy.json_to_cel(old)
        result = _cel_program(rule["rule"]).evaluate(activation)
        if result is not True and not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            problems.append(f"{path or '<root>'}: {rule.get('message') or 'failed rule: ' + rule['rule']}")
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                old_sub = old.get(name) if isinstance(old, dict) else None
                problems += cel_errors(sub, value[name], old_sub, f"{path}.{name}" if path else name)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            problems += cel_errors(schema["items"], item, None, f"{path}.{index}")
    return problems


def load_crd(path: Path = CRD_PATH) -> dict[str, Any]:
    # LibYAML where PyYAML has it: LWS's CRD is 1.3 MB, seconds for the pure-Python loader
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


class CRDSchema:
    """One version of a CRD's schema: default, validate (structure + CEL), name the field."""

    def __init__(self, crd: dict[str, Any] | None = None, version: str = "v1alpha1") -> None:
        crd = crd or load_crd()
        self.api_version = f"{crd['spec']['group']}/{version}"
        self.kind = crd["spec"]["names"]["kind"]
        (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
        self.schema: dict[str, Any] = entry["schema"]["openAPIV3Schema"]
        self.validator = jsonschema.Draft4Validator(crd_jsonschema(self.schema))

    def default(self, obj: dict[str, Any]) -> dict[str, Any]:
        return _apply_defaults(self.schema, copy.deepcopy(obj))

    def errors(self, obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
        """Problems the API server would report on create (or on update from ``old``), 'path: message'."""
        obj = self.default(obj)
        problems = [describe(error) for error in self.validator.iter_errors(obj)]
        if not problems:  # the API server runs CEL only on a structurally valid object
            old = self.default(old) if old is not None else None
            problems += cel_errors(self.schema, obj, old)
        return sorted(problems)


def custom_errors(schema: CRDSchema, manifest: dict[str, Any]) -> list[str]:
    """A custom resource as the API server checks it on create. A CRD's root metadata is only
    `type: object` (the API server checks ObjectMeta itself): only metadata.name is checked here."""
    named = isinstance(manifest.get("metadata"), dict) and manifest["metadata"].get("name")
    return ([] if named else ["metadata.name: Required value"]) + schema.errors(manifest)


@functools.cache
def modeldeployment_schema() -> CRDSchema:
    return CRDSchema(load_crd())


@functools.cache
def chart_crd_schemas() -> dict[tuple[str, str], CRDSchema]:
    """(apiVersion, kind) -> schema of every custom resource whose CRD ships in the chart's crds/
    (the ModelDeployment, kopf's peering kinds), so the chart's own objects of those kinds are
    validated as the API server would validate them after `helm install` put the CRDs there."""
    found = {}
    for path in sorted((REPO / "charts" / "pagedserve" / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            for version in crd["spec"]["versions"]:
                schema = CRDSchema(crd, version["name"])
                found[(schema.api_version, schema.kind)] = schema
    return found


# -- LeaderWorkerSet: LWS's own CRD -----------------------------------------------------------------

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
# LWS's CRD, vendored from kubernetes-sigs/lws (provenance and license in vendor/lws/README.md): no registry
# reachable here ships it.
LWS_CRD_PATH = Path(__file__).resolve().parent / "vendor/lws/leaderworkerset.x-k8s.io_leaderworkersets.yaml"


@functools.cache
def lws_schema() -> CRDSchema:
    return CRDSchema(load_crd(LWS_CRD_PATH), "v1")


def lws_errors(manifest: dict[str, Any], minor: str) -> list[str]:
    """A LeaderWorkerSet as an API server with LWS's CRD installed checks it (``custom_errors``: defaults,
    the structural schema with unknown fields rejected, CEL rules), and each pod template again as a v1
    PodTemplate of ``minor``: the CRD embeds the PodTemplateSpec of the Kubernetes release LWS was built
    against, which may serve fields an older minor does not. LWS's validating webhook (size >= 1, the
    subgroup rules) is not modelled."""
    problems = custom_errors(lws_schema(), manifest)
    templates = (manifest.get("spec") or {}).get("leaderWorkerTemplate") or {}
    for role in ("leaderTemplate", "workerTemplate"):
        if isinstance(templates, dict) and role in templates:
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                       "template": templates[role]}
            problems += [f"spec.leaderWorkerTemplate.{role}.{p.removeprefix('template.')}"
                         for p in builtin_errors(wrapped, minor)]
    return sorted(set(problems))


# -- one entry point -------------------------------------------------------------------------------


def errors(manifest: dict[str, Any], minor: str) -> list[str]:
    """Every problem the API server of ``minor`` would report for one manifest, as 'path: message'."""
    api_version, kind = manifest.get("apiVersion", ""), manifest.get("kind", "")
    custom = chart_crd_schemas().get((api_version, kind))
    if custom is not None:
        return custom_errors(custom, manifest)
    if api_version == PMO_API_VERSION and kind in PMO_KINDS:
        return sorted(describe(error) for error in pmo_validator(kind).iter_errors(manifest))
    if api_version == KEDA_API_VERSION and kind in KEDA_KINDS:
        return sorted(describe(error) for error in keda_validator(kind).iter_errors(manifest))
    if (api_version, kind) == ("apiextensions.k8s.io/v1", "CustomResourceDefinition"):
        return crd_errors(manifest, minor)
    if (api_version, kind) == (LWS_API_VERSION, "LeaderWorkerSet"):
        return lws_errors(manifest, minor)
    return builtin_errors(manifest, minor)


def manifest_errors(manifest: dict[str, Any], minors: tuple[str, ...] = KUBERNETES_MINORS) -> list[str]:
    """``errors`` for every supported minor, each line naming the object and the minor."""
    where = f"{manifest.get('kind')}/{(manifest.get('metadata') or {}).get('name')}"
    return [f"{where} (Kubernetes {minor}): {p}" for minor in minors for p in errors(manifest, minor)]
