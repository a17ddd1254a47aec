"""The ModelDeployment CustomResourceDefinition, generated from the typed models, as controller-gen
generates CRDs from Go types.

operator/spec.py (``ModelDeploymentSpec``) and operator/status.py (``ModelDeploymentStatus``) hold the
fields, types, defaults, limits, enums, descriptions and CEL rules; pydantic writes their JSON schema and
``structural`` turns it into the structural OpenAPI v3.0 schema a v1 CRD needs: ``$ref`` inlined,
optional fields without pydantic's ``anyOf: [X, null]`` (which the API server rejects), no ``title``,
``exclusiveMinimum`` as OpenAPI v3.0's boolean, free-form objects as x-kubernetes-preserve-unknown-fields.
``make manifests`` (operator/manifests.py) writes the result to crds/ and charts/pagedserve/crds/.
"""

from __future__ import annotations

from typing import Any

from pagedserve.common.resource import GROUP, KIND, PLURAL, VERSION
from pagedserve.operator.spec import ModelDeploymentSpec
from pagedserve.operator.status import ModelDeploymentStatus
from pydantic import BaseModel

DESCRIPTION = "A model served by pagedserve engine replicas behind a KV-cache-aware router."

PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
    {"name": "Adapters", "type": "integer", "jsonPath": ".status.adapterCount"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

# The scale subresource lets `kubectl scale` and the HPA (resources.py's hpa()) write spec.replicas.
SUBRESOURCES = {
    "status": {},
    "scale": {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    },
}

# The order keys are written in, for a readable YAML file; others follow in pydantic's order.
KEY_ORDER = (
    "type", "format", "x-kubernetes-int-or-string", "pattern", "enum", "minimum", "exclusiveMinimum",
    "maximum", "exclusiveMaximum", "minLength", "maxLength", "default", "description", "required",
)  # fmt: skip
DROPPED = ("title", "$defs")


def _inline(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """$ref -> the definition, the field's own keys (description, default) winning."""
    if "$ref" not in node:
        return node
    target = defs[node["$ref"].rsplit("/", 1)[-1]]
    return {**_inline(target, defs), **{k: v for k, v in node.items() if k != "$ref"}}


def _not_nullable(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """``anyOf: [X, {type: null}]`` (an optional field) -> X: an absent field is how Kubernetes says None."""
    choices = node.get("anyOf")
    if choices is None:
        return node
    others = [choice for choice in choices if choice != {"type": "null"}]
    if len(others) != 1:
        raise ValueError(f"a union is not a structural schema: {choices}")
    rest = {k: v for k, v in node.items() if k != "anyOf"}
    return {**_inline(others[0], defs), **rest}


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One pydantic JSON-schema node -> a structural OpenAPI v3.0 node (recursively)."""
    node = _not_nullable(_inline(node, defs), defs)
    out = {k: v for k, v in node.items() if k not in DROPPED}
    if out.get("default", "") is None:
        del out["default"]  # optional: absent unless set
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)  # int-or-string has no type of its own
    for bound in ("exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(out.get(bound), (int, float)) and not isinstance(out[bound], bool):
            out[bound.replace("exclusiveM", "m")] = out[bound]
            out[bound] = True
    extra = out.pop("additionalProperties", None)
    if extra is True:  # dict[str, Any]: kept as written
        out["x-kubernetes-preserve-unknown-fields"] = True
    elif isinstance(extra, dict):
        out["additionalProperties"] = structural(extra, defs)
    # extra is False for our models (extra="forbid"): a structural schema prunes unknown fields already,
    # and rejects them under strict field validation; it may not say additionalProperties with properties.
    if "items" in out:
        out["items"] = structural(out["items"], defs)
    if "properties" in out:
        out["properties"] = {name: structural(sub, defs) for name, sub in out["properties"].items()}
    ordered = {key: out[key] for key in KEY_ORDER if key in out}
    return {**ordered, **out}


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    document = model.model_json_schema(by_alias=True, mode="validation")
    return structural(document, document.get("$defs", {}))


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object (crds/modeldeployment.yaml)."""
    schema = {
        "type": "object",
        "description": DESCRIPTION,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": openapi_schema(ModelDeploymentSpec),
            "status": openapi_schema(ModelDeploymentStatus),
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "pagedserve", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["md"],
                "categories": ["pagedserve"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": SUBRESOURCES,
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }
