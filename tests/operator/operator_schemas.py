"""Schema checks for the operator tests, with no cluster.

- ``swagger_validator(apiVersion, kind)``: a jsonschema validator for a built-in kind from the official
  Kubernetes 1.36 OpenAPI (swagger) document, strict like ``kubectl --validate=strict``: unknown fields
  are errors everywhere, IntOrString takes an int or a string, Quantity a number or a quantity string.
- ``CRDSchema``: the ModelDeployment CRD's openAPIV3Schema as the API server uses it: defaulting, the
  structural schema (x-kubernetes-int-or-string, x-kubernetes-preserve-unknown-fields, unknown fields
  rejected) and the CEL ``x-kubernetes-validations`` rules, evaluated with cel-python. Messages name
  the field the way the API server does (``spec.engine.blockSize: ...``).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from pagedserve.operator.spec import QUANTITY_RE

REPO = Path(__file__).resolve().parents[2]
SWAGGER = REPO.parent / "shared" / "kubernetes-openapi" / "swagger-1.36.json"
CRD_PATH = REPO / "crds" / "modeldeployment.yaml"

QUANTITY_PATTERN = QUANTITY_RE.pattern
INT_OR_STRING = {"anyOf": [{"type": "integer"}, {"type": "string"}]}
QUANTITY = {"anyOf": [{"type": "number"}, {"type": "string", "pattern": QUANTITY_PATTERN}]}


# -- the Kubernetes swagger document ------------------------------------------------------------


def _strict(schema: Any) -> Any:
    """Swagger schema -> strict JSON schema (draft 4): no unknown fields, int-or-string understood."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if schema.get("format") == "int-or-string":
        return dict(INT_OR_STRING)
    out = {
        key: _strict(value)
        for key, value in schema.items()
        if not key.startswith("x-") and key != "properties"
    }
    if "properties" in schema:  # property names are data here (JSONSchemaProps has x-kubernetes-* fields)
        out["properties"] = {name: _strict(value) for name, value in schema["properties"].items()}
    if "$ref" in out:
        return {"$ref": out["$ref"]}  # draft 4 ignores siblings of $ref anyway
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


@functools.cache
def _swagger() -> dict[str, Any]:
    if not SWAGGER.exists():
        raise FileNotFoundError(f"{SWAGGER} is missing: the tests need shared/ beside the repository")
    definitions = json.loads(SWAGGER.read_text())["definitions"]
    strict = {name: _strict(schema) for name, schema in definitions.items()}
    strict["io.k8s.apimachinery.pkg.util.intstr.IntOrString"] = dict(INT_OR_STRING)
    strict["io.k8s.apimachinery.pkg.api.resource.Quantity"] = dict(QUANTITY)
    return {"raw": definitions, "strict": strict}


def _definition_for(api_version: str, kind: str) -> str:
    group, _, version = api_version.rpartition("/")
    for name, schema in _swagger()["raw"].items():
        for gvk in schema.get("x-kubernetes-group-version-kind", []):
            if (gvk["group"], gvk["version"], gvk["kind"]) == (group, version, kind):
                return name
    raise KeyError(f"{api_version} {kind} is not in {SWAGGER.name}")


@functools.cache
def swagger_validator(api_version: str, kind: str) -> jsonschema.Draft4Validator:
    name = _definition_for(api_version, kind)
    root = {"definitions": _swagger()["strict"], "$ref": f"#/definitions/{name}"}
    return jsonschema.Draft4Validator(root)


def _path(error: jsonschema.ValidationError) -> str:
    return ".".join(str(part) for part in error.absolute_path) or "<root>"


def _describe(error: jsonschema.ValidationError) -> str:
    """'path: message'; a missing required field is named itself, as the API server does."""
    if error.validator == "required":
        missing = error.message.split("'")[1]
        parts = [str(part) for part in error.absolute_path] + [missing]
        return f"{'.'.join(parts)}: Required value"
    return f"{_path(error)}: {error.message}"


def swagger_errors(manifest: dict[str, Any]) -> list[str]:
    """Every problem kubectl --validate=strict would report for a built-in kind, as 'path: message'."""
    validator = swagger_validator(manifest.get("apiVersion", ""), manifest.get("kind", ""))
    return sorted(_describe(error) for error in validator.iter_errors(manifest))


# -- the CRD ------------------------------------------------------------------------------------


def load_crd(path: Path = CRD_PATH) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _structural_to_jsonschema(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD structural schema (OpenAPI v3.0) -> a strict draft-4 JSON schema."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("properties",):
            out[key] = {name: _structural_to_jsonschema(sub) for name, sub in value.items()}
        elif key == "items" or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = _structural_to_jsonschema(value)
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


class CRDSchema:
    """The ModelDeployment CRD's version schema: default, validate (structure + CEL), name the field."""

    def __init__(self, crd: dict[str, Any] | None = None, version: str = "v1alpha1") -> None:
        crd = crd or load_crd()
        (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
        self.schema: dict[str, Any] = entry["schema"]["openAPIV3Schema"]
        self.validator = jsonschema.Draft4Validator(_structural_to_jsonschema(self.schema))

    def default(self, obj: dict[str, Any]) -> dict[str, Any]:
        return _apply_defaults(self.schema, copy.deepcopy(obj))

    def errors(self, obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
        """Problems the API server would report on create (or on update from ``old``), 'path: message'."""
        obj = self.default(obj)
        problems = [_describe(error) for error in self.validator.iter_errors(obj)]
        if not problems:  # the API server runs CEL only on a structurally valid object
            old = self.default(old) if old is not None else None
            problems += cel_errors(self.schema, obj, old)
        return sorted(problems)


# -- CEL (x-kubernetes-validations) -------------------------------------------------------------


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
