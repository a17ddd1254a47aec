"""Helpers for the chart and monitoring tests: find the tools, render the chart, validate manifests.

The strict validator builds JSON schemas from the Kubernetes 1.36 OpenAPI (swagger) definitions with
unknown fields rejected, as `kubectl apply --validate=strict` does. Custom resources are checked against
their CRD's openAPIV3Schema (ModelDeployment) or, for the Prometheus Operator kinds, against the small
strict shapes below that cover the fields the chart uses.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pagedserve"
SWAGGER = REPO.parent / "shared" / "kubernetes-openapi" / "swagger-1.36.json"
TOOLS_BIN = REPO / ".tools" / "bin"
NAMESPACE = "pagedserve-system"
RELEASE = "ps"


def find_tool(name: str) -> str | None:
    """A tool from .tools/bin (where `make tools` puts it), else from PATH."""
    local = TOOLS_BIN / name
    if local.exists() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    binary = find_tool("helm")
    if binary is None:
        raise FileNotFoundError("helm is not installed: run `make tools` (scripts/install-tools.sh)")
    with tempfile.TemporaryDirectory(prefix="helm-home-") as home:
        # Keep Helm's cache/config/data out of the user's home and independent between runs.
        env = {
            **os.environ,
            "HELM_CACHE_HOME": f"{home}/cache",
            "HELM_CONFIG_HOME": f"{home}/config",
            "HELM_DATA_HOME": f"{home}/data",
        }
        result = subprocess.run([binary, *args], capture_output=True, text=True, env=env, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result


def _values_args(values: dict[str, Any] | None, tmp: str) -> list[str]:
    if not values:
        return []
    path = Path(tmp) / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return ["--values", str(path)]


def render(values: dict[str, Any] | None = None, *, include_crds: bool = True) -> list[dict[str, Any]]:
    """`helm template` the chart; returns the rendered objects (CRDs from crds/ included)."""
    with tempfile.TemporaryDirectory(prefix="chart-values-") as tmp:
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *_values_args(values, tmp)]
        if include_crds:
            args.append("--include-crds")
        out = helm(*args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def lint(values: dict[str, Any] | None = None) -> str:
    with tempfile.TemporaryDirectory(prefix="chart-values-") as tmp:
        result = helm(
            "lint", "--strict", str(CHART), "--namespace", NAMESPACE, *_values_args(values, tmp), check=False
        )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def by_kind(objects: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o.get("kind") == kind]


def one(objects: Iterable[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


# --------------------------------------------------------------------------------------------------
# Strict validation against the Kubernetes OpenAPI definitions

_REF = "#/definitions/"
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
LABEL_SELECTOR = "io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector"


def _strict(node: Any, *, crd: bool = False) -> Any:
    """An OpenAPI schema (swagger definition or CRD openAPIV3Schema) -> JSON schema (draft 4) that rejects
    unknown fields, recursively. In a CRD an object schema without properties keeps nothing (the API server
    prunes it) unless it says x-kubernetes-preserve-unknown-fields."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: _strict(sub, crd=crd) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = _strict(value, crd=crd)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [_strict(sub, crd=crd) for sub in value]
        elif not (key.startswith("x-kubernetes-") or key == "nullable"):
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if node.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    open_object = node.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in out
    if not open_object and ("properties" in out or (crd and out.get("type") == "object")):
        out["additionalProperties"] = False
    return out


def _pmo_schemas() -> dict[str, Any]:
    """Strict shapes for the Prometheus Operator kinds, covering the fields the chart renders."""
    string_map = {"type": "object", "additionalProperties": {"type": "string"}}
    duration = {
        "type": "string",
        "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
        r"(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
    }
    relabel = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "sourceLabels": {"type": "array", "items": {"type": "string"}},
            "separator": {"type": "string"},
            "targetLabel": {"type": "string"},
            "regex": {"type": "string"},
            "modulus": {"type": "integer"},
            "replacement": {"type": "string"},
            "action": {
                "enum": [
                    "replace",
                    "keep",
                    "drop",
                    "hashmod",
                    "labelmap",
                    "labeldrop",
                    "labelkeep",
                    "lowercase",
                    "uppercase",
                    "keepequal",
                    "dropequal",
                ]
            },
        },
    }
    endpoint = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "port": {"type": "string"},
            "path": {"type": "string"},
            "scheme": {"enum": ["http", "https"]},
            "interval": duration,
            "scrapeTimeout": duration,
            "honorLabels": {"type": "boolean"},
            "relabelings": {"type": "array", "items": relabel},
            "metricRelabelings": {"type": "array", "items": relabel},
        },
    }
    namespace_selector = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "any": {"type": "boolean"},
            "matchNames": {"type": "array", "items": {"type": "string"}},
        },
    }

    def monitor(endpoints_key: str) -> dict[str, Any]:
        return {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", endpoints_key],
            "properties": {
                "selector": {"$ref": _REF + LABEL_SELECTOR},
                "namespaceSelector": namespace_selector,
                endpoints_key: {"type": "array", "minItems": 1, "items": endpoint},
                "jobLabel": {"type": "string"},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "sampleLimit": {"type": "integer"},
            },
        }

    rule = {
        "type": "object",
        "additionalProperties": False,
        "required": ["expr"],
        "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
        "properties": {
            "alert": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"},
            "record": {"type": "string"},
            "expr": {"type": "string", "minLength": 1},
            "for": duration,
            "keep_firing_for": duration,
            "labels": string_map,
            "annotations": string_map,
        },
    }
    rules = {
        "type": "object",
        "additionalProperties": False,
        "required": ["groups"],
        "properties": {
            "groups": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "rules"],
                    "properties": {
                        "name": {"type": "string"},
                        "interval": duration,
                        "rules": {"type": "array", "minItems": 1, "items": rule},
                    },
                },
            }
        },
    }
    return {
        "ServiceMonitor": monitor("endpoints"),
        "PodMonitor": monitor("podMetricsEndpoints"),
        "PrometheusRule": rules,
    }


class KubeValidator:
    """Validates manifests strictly: built-in kinds by the swagger, custom resources by their schemas."""

    def __init__(self, swagger: Path = SWAGGER, crds: Iterable[dict[str, Any]] = ()) -> None:
        spec = json.loads(swagger.read_text())
        definitions = {name: _strict(d) for name, d in spec["definitions"].items()}
        # Typed as plain strings in the swagger, but YAML may give numbers; the API server takes both.
        definitions[INT_OR_STRING] = {"type": ["string", "integer"]}
        definitions[QUANTITY] = {"type": ["string", "number"]}
        self.gvk: dict[tuple[str, str], str] = {}
        for name, d in spec["definitions"].items():
            for gvk in d.get("x-kubernetes-group-version-kind", []):
                api_version = f"{gvk['group']}/{gvk['version']}" if gvk["group"] else gvk["version"]
                self.gvk[(api_version, gvk["kind"])] = name
        for kind, spec_schema in _pmo_schemas().items():
            name = f"monitoring.coreos.com.v1.{kind}"
            definitions[name] = self._custom(spec_schema)
            self.gvk[("monitoring.coreos.com/v1", kind)] = name
        for crd in crds:
            self.add_crd(crd, definitions)
        self.definitions = definitions

    @staticmethod
    def _custom(spec_schema: dict[str, Any], status_schema: dict[str, Any] | None = None) -> dict[str, Any]:
        properties = {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"$ref": _REF + OBJECT_META},
            "spec": spec_schema,
        }
        if status_schema is not None:
            properties["status"] = status_schema
        return {
            "type": "object",
            "additionalProperties": False,
            "required": ["apiVersion", "kind", "metadata"],
            "properties": properties,
        }

    def add_crd(self, crd: dict[str, Any], definitions: dict[str, Any] | None = None) -> None:
        definitions = self.definitions if definitions is None else definitions
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = _strict(version["schema"]["openAPIV3Schema"], crd=True)
            props = schema.get("properties", {})
            name = f"{group}.{version['name']}.{kind}"
            definitions[name] = self._custom(props.get("spec", {"type": "object"}), props.get("status"))
            definitions[name]["required"] = sorted(
                {*definitions[name]["required"], *schema.get("required", [])}
            )
            self.gvk[(f"{group}/{version['name']}", kind)] = name

    @functools.cache  # noqa: B019 - validators live as long as the module's one KubeValidator
    def _validator(self, definition: str) -> jsonschema.protocols.Validator:
        schema = {"definitions": self.definitions, "$ref": _REF + definition}
        return jsonschema.Draft4Validator(schema)

    def errors(self, obj: dict[str, Any]) -> list[str]:
        """Human-readable validation errors of one manifest (empty when it is valid)."""
        key = (obj.get("apiVersion"), obj.get("kind"))
        definition = self.gvk.get(key)
        if definition is None:
            return [f"unknown kind {key[1]} in {key[0]}"]
        where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        return [
            f"{where}: {'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
            for e in self._validator(definition).iter_errors(obj)
        ]


@functools.cache
def validator() -> KubeValidator:
    crd_path = REPO / "crds" / "modeldeployment.yaml"
    crds = [d for d in yaml.safe_load_all(crd_path.read_text()) if d] if crd_path.exists() else []
    return KubeValidator(crds=crds)
