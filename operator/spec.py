"""The ModelDeployment spec, typed, with its defaults in one place.

The CRD (crds/modeldeployment.yaml) carries the same defaults and limits so that the API server
defaults and rejects; this module is what the operator reads, and it re-checks the same rules so
that an object that reached the operator without server-side validation (an old CRD, an emulator)
still fails with a message naming the field. ``tests/operator`` checks that both agree.

``model`` is a Hugging Face repo id, ``pvc://<claim>/<path>`` (weights on an existing claim,
mounted read-only) or a path inside the image. The special value ``embedded`` starts
``pagedserve serve`` with no model argument, which serves the image's embedded default model
(SmolLM2-135M-Instruct); handy for smoke tests and CPU clusters.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

GROUP = "pagedserve.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ModelDeployment"
PLURAL = "modeldeployments"

EMBEDDED_MODEL = "embedded"
PVC_SCHEME = "pvc://"

# Kubernetes' own quantity grammar (the same regex controller-gen puts into CRDs).
QUANTITY_RE = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# pvc://<claim>/<optional path>; the claim is a DNS-1123 subdomain.
PVC_MODEL_RE = re.compile(r"^pvc://([a-z0-9]([-a-z0-9.]*[a-z0-9])?)(/.*)?$")


def quantity(value: Any) -> str:
    """A Kubernetes quantity as a string: numbers become their canonical text (0.5 -> 500m)."""
    if isinstance(value, bool):
        raise ValueError("must be a quantity such as 8, 500m or 32Gi")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        milli = round(value * 1000)
        if abs(milli / 1000 - value) > 1e-9:
            raise ValueError(f"{value} has more than 3 decimal places")
        return f"{milli}m"
    if isinstance(value, str) and re.fullmatch(r"[0-9]+\.[0-9]+", value):
        return quantity(float(value))  # "0.5" -> "500m", as the API server would store it
    if isinstance(value, str) and QUANTITY_RE.match(value):
        return value
    raise ValueError(f"{value!r} is not a quantity such as 8, 500m or 32Gi")


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class Resources(_Model):
    gpus: int = Field(1, ge=0)
    gpu_resource_name: str = Field("nvidia.com/gpu", min_length=1)
    # Requests; memory is also the limit. Defaults depend on gpus (see the properties below).
    cpu: str | None = None
    memory: str | None = None
    shm_size: str = "1Gi"

    @field_validator("cpu", "memory", "shm_size", mode="before")
    @classmethod
    def _quantity(cls, value: Any) -> Any:
        return None if value is None else quantity(value)

    @property
    def cpu_request(self) -> str:
        return self.cpu or ("4" if self.gpus else "2")

    @property
    def memory_request(self) -> str:
        return self.memory or ("16Gi" if self.gpus else "4Gi")


class Engine(_Model):
    max_model_len: int | None = Field(None, ge=1)
    block_size: Literal[8, 16, 32] = 16
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    enable_prefix_caching: bool = True
    # Seconds the startup probe waits for the model to load before the pod is restarted.
    startup_timeout_seconds: int = Field(1800, ge=10)
    extra_args: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _batched_tokens(self) -> Engine:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("engine.maxNumBatchedTokens must be >= engine.maxNumSeqs")
        return self


class RouterResources(_Model):
    cpu: str = "1"
    memory: str = "2Gi"

    @field_validator("cpu", "memory", mode="before")
    @classmethod
    def _quantity(cls, value: Any) -> Any:
        return quantity(value)


class Router(_Model):
    replicas: int = Field(2, ge=0)
    strategy: Literal["prefix-hash", "least-load", "round-robin"] = "prefix-hash"
    mean_load_factor: float = Field(1.25, ge=1.0)
    image: str | None = Field(None, min_length=1)
    # Where the router loads the tokenizer from; default: the model (nothing for "embedded").
    tokenizer: str | None = Field(None, min_length=1)
    resources: RouterResources = Field(default_factory=RouterResources)
    extra_args: list[str] = Field(default_factory=list)


class ModelCache(_Model):
    size: str = "50Gi"
    storage_class_name: str | None = Field(None, min_length=1, max_length=253)
    access_mode: Literal["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"] = "ReadWriteOnce"

    @field_validator("size", mode="before")
    @classmethod
    def _quantity(cls, value: Any) -> Any:
        return quantity(value)


class HFTokenSecret(_Model):
    name: str = Field(min_length=1)
    key: str = Field("token", min_length=1)


class APIKeySecret(_Model):
    name: str = Field(min_length=1)
    key: str = Field("key", min_length=1)


class Autoscaling(_Model):
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(ge=1)
    target_waiting_requests: float = Field(5, gt=0)
    # The Pods metric the HPA reads (exposed by e.g. prometheus-adapter from vllm:num_requests_waiting).
    metric_name: str = Field("vllm_num_requests_waiting", min_length=1)

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError("autoscaling.maxReplicas must be >= autoscaling.minReplicas")
        return self


class LocalObjectReference(_Model):
    name: str = Field(min_length=1)


class ModelDeploymentSpec(_Model):
    model: str = Field(min_length=1, max_length=1024)
    served_model_name: str | None = Field(None, min_length=1)
    replicas: int = Field(1, ge=0)
    image: str | None = Field(None, min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list)
    resources: Resources = Field(default_factory=Resources)
    engine: Engine = Field(default_factory=Engine)
    router: Router = Field(default_factory=Router)
    model_cache: ModelCache | None = None
    hf_token_secret: HFTokenSecret | None = None
    api_key_secret: APIKeySecret | None = None
    autoscaling: Autoscaling | None = None
    # Passed through to the engine pods as Kubernetes objects (the CRD schema checks their shape).
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    pod_annotations: dict[str, str] = Field(default_factory=dict)
    env: list[dict[str, Any]] = Field(default_factory=list)

    @field_validator("model")
    @classmethod
    def _model(cls, value: str) -> str:
        if value.startswith(PVC_SCHEME) and not PVC_MODEL_RE.match(value):
            raise ValueError("model: pvc:// models look like pvc://<claim>/<path>")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for item in value:
            if not isinstance(item.get("name"), str) or not item["name"]:
                raise ValueError("env: every entry needs a name")
        return value

    @property
    def is_embedded(self) -> bool:
        return self.model == EMBEDDED_MODEL

    @property
    def pvc_model(self) -> tuple[str, str] | None:
        """(claim, path inside the claim) for pvc:// models."""
        match = PVC_MODEL_RE.match(self.model)
        if not match:
            return None
        return match.group(1), (match.group(3) or "/").lstrip("/")


def parse_spec(spec: dict[str, Any] | None) -> ModelDeploymentSpec:
    """Validate and default a ModelDeployment's spec (raises pydantic.ValidationError)."""
    return ModelDeploymentSpec.model_validate(spec or {})


def format_validation_error(error: Exception) -> str:
    """One line per problem, each naming the field as spec.a.b (for status conditions and Events)."""
    errors = getattr(error, "errors", None)
    if not callable(errors):
        return str(error)
    lines = []
    for item in errors():
        path = ".".join(["spec", *(str(part) for part in item.get("loc", ()))])
        lines.append(f"{path}: {item.get('msg', 'invalid')}")
    return "; ".join(lines)
