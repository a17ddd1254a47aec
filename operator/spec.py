"""The ModelDeployment spec, typed: the one source of its fields, types, defaults, limits and rules.

operator/crd.py generates the CRD's openAPIV3Schema from these models (``make manifests`` writes
crds/modeldeployment.yaml and the chart's copy), the way controller-gen generates CRDs from Go types.
What only the API server can check is attached to the fields as schema extras: CEL rules
(``x-kubernetes-validations``), server-side defaults of nested objects, integer formats. The
operator re-checks the same rules here, so that an object that reached it without server-side
validation (an old CRD, an emulator) still fails with a message naming the field.

``model`` is a Hugging Face repo id, ``pvc://<claim>/<path>`` (weights on an existing claim,
mounted read-only) or a path inside the image. The special value ``embedded`` starts
``pagedserve serve`` with no model argument, which serves the image's embedded default model
(SmolLM2-135M-Instruct); handy for smoke tests and CPU clusters.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pagedserve.common.engine_args import EngineArgs, flag, settings, value_type
from pagedserve.common.routing import DEFAULT_STRATEGY, STRATEGIES
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator
from pydantic.alias_generators import to_camel

EMBEDDED_MODEL = "embedded"
PVC_SCHEME = "pvc://"

# Kubernetes' own quantity grammar (the same regex controller-gen puts into CRDs).
QUANTITY_RE = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# pvc://<claim>/<optional path>; the claim is a DNS-1123 subdomain.
PVC_MODEL_RE = re.compile(r"^pvc://([a-z0-9]([-a-z0-9.]*[a-z0-9])?)(/.*)?$")
# LoRA adapters (KubeAI's convention): hf://<org>/<repo>, pvc://<claim>/<path> or an absolute path.
HF_SCHEME = "hf://"
HF_ADAPTER_RE = re.compile(r"^hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*$")
# An adapter's name is a model name in requests and in vLLM's --lora-modules name=path: DNS-1123-ish
# (lower case, digits, '-', '.', '_'), so that it is also safe in label values and metric labels.
ADAPTER_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9._]*[a-z0-9])?$")
MAX_ADAPTERS = 64


def pvc_location(url: str) -> tuple[str, str] | None:
    """(claim, path inside the claim) of a pvc://<claim>/<path> url (a model's or an adapter's), else None."""
    match = PVC_MODEL_RE.match(url)
    if not match:
        return None
    return match.group(1), (match.group(3) or "/").lstrip("/")


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


# Kubernetes integer formats (the scale subresource's replicas are int32).
Int32 = Annotated[int, Field(json_schema_extra={"format": "int32"})]
Int64 = Annotated[int, Field(json_schema_extra={"format": "int64"})]
# A quantity (8, 500m, 32Gi): an int or a string in the API, normalised to a string by quantity().
Quantity = Annotated[
    str, Field(json_schema_extra={"x-kubernetes-int-or-string": True, "pattern": QUANTITY_RE.pattern})
]


def cel(rule: str, message: str) -> dict[str, Any]:
    """An x-kubernetes-validations entry: a rule the API server evaluates (CEL) on the field it sits on."""
    return {"x-kubernetes-validations": [{"rule": rule, "message": message}]}


# The API server fills in an absent nested object (or list), so that the defaults inside it apply.
SERVER_DEFAULT_OBJECT = {"default": {}}
SERVER_DEFAULT_LIST = {"default": []}


class CamelModel(BaseModel):
    """Kubernetes-style camelCase fields, unknown fields rejected, immutable."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class Resources(CamelModel):
    gpus: int = Field(
        1, ge=0, description="GPUs per engine replica; 0 runs the engine on CPU (--device cpu)."
    )
    gpu_resource_name: str = Field("nvidia.com/gpu", min_length=1)
    # Requests; memory is also the limit. Defaults depend on gpus (see the properties below).
    cpu: Quantity | None = Field(
        None, description="CPU request per engine replica (default 4 with GPUs, 2 without)."
    )
    memory: Quantity | None = Field(
        None,
        description="Memory request and limit per engine replica (default 16Gi with GPUs, 4Gi without).",
    )
    shm_size: Quantity | None = Field(
        None,
        description="Size of the memory-backed /dev/shm (default 1Gi per tensor-parallel rank, for NCCL).",
    )

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

    def shm_limit(self, ranks: int) -> str:
        """/dev/shm's sizeLimit. NCCL keeps buffers there wherever GPUs exchange through host memory (its
        SHM transport and its proxy's host buffers: NCCL_BUFFSIZE, 4 MiB, per channel and direction, for
        each of up to 32 channels to each peer, some hundreds of MiB per rank), and torch shares tensors
        there: 1 GiB per rank holds that with room. A memory-backed emptyDir's limit is a cap, not a
        reservation: only what is written counts against the pod's memory."""
        return self.shm_size or f"{ranks}Gi"


def engine_setting_fields(cls: type = EngineArgs) -> dict[str, Any]:
    """spec.engine's fields for the engine settings marked ``operator=True`` in common/engine_args.py:
    type, default, choices, bounds and help from that one declaration (the description leads with the
    `pagedserve serve` flag the operator renders the field into)."""
    fields: dict[str, Any] = {}
    for declared, how in settings(cls):
        if not how.operator:
            continue
        kind = Literal[how.choices] if how.choices else value_type(cls, declared.name)
        annotation = kind | None if declared.default is None else kind
        description = f"{flag(declared.name)}: {how.help}."
        bounds = {k: v for k, v in {"ge": how.ge, "gt": how.gt, "le": how.le}.items() if v is not None}
        fields[declared.name] = (annotation, Field(declared.default, description=description, **bounds))
    return fields


class EngineBase(CamelModel):
    """spec.engine's own fields; the engine settings join it in ``Engine``."""

    settings_class: ClassVar[type] = EngineArgs  # the settings' declaration (engine_model())
    model_config = ConfigDict(
        json_schema_extra=cel(
            "!has(self.maxNumBatchedTokens) || self.maxNumBatchedTokens >= self.maxNumSeqs",
            "spec.engine.maxNumBatchedTokens must be >= spec.engine.maxNumSeqs",
        )
    )

    startup_timeout_seconds: int = Field(
        1800, ge=10, description="How long the startup probe waits for the model to load."
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Appended to `pagedserve serve` (vLLM-compatible flags).",
        json_schema_extra=SERVER_DEFAULT_LIST,
    )

    def engine_settings(self) -> dict[str, Any]:
        """The engine settings this spec.engine sets, by their names in common/engine_args.py."""
        own = EngineBase.model_fields
        return {name: getattr(self, name) for name in type(self).model_fields if name not in own}

    @model_validator(mode="after")
    def _batched_tokens(self) -> EngineBase:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("engine.maxNumBatchedTokens must be >= engine.maxNumSeqs")
        return self

    @model_validator(mode="after")
    def _as_the_engine_checks_them(self) -> EngineBase:
        """What `pagedserve serve` would refuse at start (its torch-free checks) is refused here."""
        self.settings_class(**self.engine_settings())
        return self


def engine_model(cls: type = EngineArgs) -> type[EngineBase]:
    """spec.engine's model: its own fields and, from their one declaration, the settings of ``cls``."""
    return create_model(
        "Engine",
        __base__=EngineBase,
        __module__=__name__,
        settings_class=(ClassVar[type], cls),
        **engine_setting_fields(cls),
    )


Engine = engine_model()


class Adapter(CamelModel):
    """A LoRA adapter of the model, served beside it under its own name (KubeAI's `adapters`)."""

    name: str = Field(
        min_length=1,
        max_length=63,
        description="The model name clients send to use this adapter (lower case, digits, '-', '.', '_').",
        json_schema_extra=cel(
            f"self.matches('{ADAPTER_NAME_RE.pattern}')",
            "spec.adapters[].name must be lower case letters, digits, '-', '.' or '_', starting and ending"
            " with a letter or digit",
        ),
    )
    url: str = Field(
        min_length=1,
        max_length=1024,
        description=(
            "Where the PEFT adapter is: hf://<org>/<repo> (downloaded by the engine), pvc://<claim>/<path>"
            " (the claim is mounted read-only) or an absolute path inside the image."
        ),
        json_schema_extra=cel(
            f"self.matches('{HF_ADAPTER_RE.pattern}') || self.matches('{PVC_MODEL_RE.pattern}')"
            " || self.startsWith('/')",
            "spec.adapters[].url must be hf://<org>/<repo>, pvc://<claim>/<path> or an absolute path",
        ),
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not ADAPTER_NAME_RE.match(value):
            raise ValueError(
                "adapter names are lower case letters, digits, '-', '.' or '_', starting and ending with a"
                " letter or digit"
            )
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not (HF_ADAPTER_RE.match(value) or PVC_MODEL_RE.match(value) or value.startswith("/")):
            raise ValueError(
                "adapter url must be hf://<org>/<repo>, pvc://<claim>/<path> or an absolute path"
            )
        return value

    @property
    def pvc(self) -> tuple[str, str] | None:
        """(claim, path inside the claim) for pvc:// adapters."""
        return pvc_location(self.url)


class RouterResources(CamelModel):
    cpu: Quantity = "1"
    memory: Quantity = "2Gi"

    @field_validator("cpu", "memory", mode="before")
    @classmethod
    def _quantity(cls, value: Any) -> Any:
        return quantity(value)


class Router(CamelModel):
    replicas: Int32 = Field(2, ge=0)
    # kv-events: the engines publish their KV events (--enable-kv-events) and the router routes on them.
    strategy: Literal[STRATEGIES] = DEFAULT_STRATEGY  # `pagedserve router --strategy`
    mean_load_factor: float = Field(1.25, ge=1)
    image: str | None = Field(
        None,
        min_length=1,
        description=(
            "Router image (default chosen by the operator, the slim `control` image). Must start with one"
            " of the operator's allowed image prefixes, when it has some (--allowed-image-prefix)."
        ),
    )
    tokenizer: str | None = Field(
        None, min_length=1, description="Where the router loads the tokenizer from (default the model)."
    )
    resources: RouterResources = Field(
        default_factory=RouterResources, json_schema_extra=SERVER_DEFAULT_OBJECT
    )
    extra_args: list[str] = Field(default_factory=list, json_schema_extra=SERVER_DEFAULT_LIST)


class ModelCache(CamelModel):
    size: Quantity = "50Gi"
    # Immutable: the claim is created once (a transition rule, so only the API server can check it).
    storage_class_name: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        json_schema_extra=cel("self == oldSelf", "spec.modelCache.storageClassName is immutable"),
    )
    access_mode: Literal["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"] = Field(
        "ReadWriteOnce",
        description="ReadWriteMany lets engine replicas on several nodes share the cache.",
        json_schema_extra=cel("self == oldSelf", "spec.modelCache.accessMode is immutable"),
    )

    @field_validator("size", mode="before")
    @classmethod
    def _quantity(cls, value: Any) -> Any:
        return quantity(value)


class HFTokenSecret(CamelModel):
    name: str = Field(min_length=1)
    key: str = Field("token", min_length=1)


class APIKeySecret(CamelModel):
    name: str = Field(min_length=1)
    key: str = Field("key", min_length=1)


class Autoscaling(CamelModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            "self.maxReplicas >= self.minReplicas",
            "spec.autoscaling.maxReplicas must be >= spec.autoscaling.minReplicas",
        )
    )

    min_replicas: Int32 = Field(
        1,
        ge=0,
        description=(
            "0 needs spec.scaleFromZero: the HPA itself keeps at least 1 (an HPA cannot go to 0 without"
            " an alpha feature gate); the routers and the operator own the 0 <-> 1 edge."
        ),
    )
    max_replicas: Int32 = Field(ge=1)
    target_waiting_requests: float = Field(
        5, gt=0, description="Average waiting requests per engine replica the HPA aims for."
    )
    metric_name: str = Field(
        "vllm_num_requests_waiting",
        min_length=1,
        description="The Pods metric (e.g. from prometheus-adapter over vllm:num_requests_waiting).",
    )

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError("autoscaling.maxReplicas must be >= autoscaling.minReplicas")
        return self


class ScaleFromZero(CamelModel):
    """Engine replicas that cost nothing while idle (KubeAI's names where it has them).

    While no engine replica is ready, each router holds requests (up to ``maxHeldRequests``, each for at
    most ``heldRequestTimeoutSeconds``) and sets the scale subresource from 0 to 1; after
    ``scaleDownDelaySeconds`` without a request anywhere, the operator sets it back to 0."""

    scale_down_delay_seconds: Int32 = Field(
        600,
        ge=1,
        description="Seconds without a request (arriving, in flight or held) before the engines go to 0.",
    )
    max_held_requests: Int32 = Field(
        100, ge=1, description="Requests each router replica holds while no engine is ready; more get 503."
    )
    held_request_timeout_seconds: Int32 = Field(
        300, ge=1, description="How long a held request waits for a ready engine before it gets 503."
    )


class LocalObjectReference(CamelModel):
    name: str = Field(min_length=1)


class Toleration(CamelModel):
    """A Kubernetes core/v1 Toleration, passed through to the engine pods."""

    key: str | None = None
    operator: Literal["Exists", "Equal", "Lt", "Gt"] | None = None
    value: str | None = None
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: Int64 | None = None


class EnvVar(CamelModel):
    """A Kubernetes core/v1 EnvVar for the engine container; valueFrom is passed through as written,
    except secretKeyRef, which the operator's policy refuses unless allowed (operator/policy.py)."""

    name: str = Field(min_length=1)
    value: str | None = None
    value_from: dict[str, Any] | None = None


class PrefillRole(CamelModel):
    """The prefill engines of a disaggregated ModelDeployment (spec.disaggregation.prefill)."""

    replicas: Int32 = Field(
        1,
        ge=1,
        description=(
            "Prefill engine replicas (a Deployment of their own; spec.replicas, the scale subresource and"
            " autoscaling are the decode engines')."
        ),
    )
    resources: Resources | None = Field(
        None, description="Each prefill engine pod's resources (default spec.resources, the decode engines')."
    )


class Disaggregation(CamelModel):
    """Prefill/decode disaggregation: prompts are prefilled on their own engines, whose KV cache the decode
    engines read (--kv-transfer-config, Mooncake), and the router runs --strategy pd."""

    prefill: PrefillRole = Field(default_factory=PrefillRole, json_schema_extra=SERVER_DEFAULT_OBJECT)


# What spec.disaggregation does not run with yet, each a CEL rule on the spec and the same check in
# ModelDeploymentSpec._disaggregation: (rule, message).
DISAGGREGATION_RULES: list[tuple[str, str]] = [
    (
        # Tensor and pipeline ranks each move their own shard (server/kv_transfer/), all from the pod's IP.
        "!has(self.disaggregation) || (has(self.nodes) ? self.nodes : 1) == 1",
        "spec.disaggregation needs nodes 1 (an engine's ranks register their KV caches at its pod's"
        " address)",
    ),
    (
        "!has(self.disaggregation) || (has(self.resources) && has(self.resources.gpus)"
        " && self.resources.gpus == 0 && (!has(self.disaggregation.prefill)"
        " || !has(self.disaggregation.prefill.resources)"
        " || (has(self.disaggregation.prefill.resources.gpus)"
        " && self.disaggregation.prefill.resources.gpus == 0)))",
        "spec.disaggregation needs CPU engines for now (resources.gpus 0, and"
        " disaggregation.prefill.resources.gpus 0): the engine's Mooncake transfer moves host memory",
    ),
    (
        "!has(self.disaggregation) || !has(self.adapters) || size(self.adapters) == 0",
        "spec.disaggregation does not support spec.adapters yet",
    ),
    (
        "!has(self.disaggregation) || !has(self.scaleFromZero)",
        "spec.disaggregation does not support spec.scaleFromZero yet (the prefill engines stay up)",
    ),
    (
        "!has(self.disaggregation) || !has(self.router) || !has(self.router.strategy)"
        f" || self.router.strategy == '{DEFAULT_STRATEGY}'",
        "spec.router.strategy does not apply with spec.disaggregation: the router runs --strategy pd",
    ),
]


class ModelDeploymentSpec(CamelModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                *cel(
                    "!has(self.autoscaling) || self.autoscaling.minReplicas >= 1 || has(self.scaleFromZero)",
                    "spec.autoscaling.minReplicas 0 needs spec.scaleFromZero",
                )["x-kubernetes-validations"],
                *cel(
                    "!has(self.resources) || !has(self.resources.gpus) || self.resources.gpus == 0"
                    " || self.resources.gpus * (has(self.nodes) ? self.nodes : 1)"
                    " >= (has(self.tensorParallelSize) ? self.tensorParallelSize : 1)"
                    " * (has(self.pipelineParallelSize) ? self.pipelineParallelSize : 1)",
                    "spec.resources.gpus must be >= spec.tensorParallelSize * spec.pipelineParallelSize"
                    " / spec.nodes (one GPU per rank)",
                )["x-kubernetes-validations"],
                *cel(
                    "!has(self.nodes) || ((has(self.tensorParallelSize) ? self.tensorParallelSize : 1)"
                    " * (has(self.pipelineParallelSize) ? self.pipelineParallelSize : 1)) % self.nodes == 0",
                    "spec.nodes must divide spec.tensorParallelSize * spec.pipelineParallelSize (the same"
                    " number of ranks on each node)",
                )["x-kubernetes-validations"],
                *cel(
                    "!has(self.servedModelName) || !has(self.adapters)"
                    " || self.adapters.all(a, a.name != self.servedModelName)",
                    "spec.adapters[].name must differ from spec.servedModelName",
                )["x-kubernetes-validations"],
                *({"rule": rule, "message": message} for rule, message in DISAGGREGATION_RULES),
            ]
        }
    )

    model: str = Field(
        min_length=1,
        max_length=1024,
        description=(
            "A Hugging Face repo id, pvc://<claim>/<path> (weights on an existing claim, mounted"
            ' read-only), a path inside the image, or "embedded" for the image\'s embedded default model'
            " (SmolLM2-135M-Instruct; `pagedserve serve` with no model argument)."
        ),
        json_schema_extra=cel(
            f"!self.startsWith('{PVC_SCHEME}') || self.matches('{PVC_MODEL_RE.pattern}')",
            "spec.model: pvc:// models look like pvc://<claim>/<path>",
        ),
    )
    served_model_name: str | None = Field(
        None, min_length=1, description="The model name clients send in requests (default metadata.name)."
    )
    replicas: Int32 = Field(
        1, ge=0, description="Engine replicas; the scale subresource (and so an HPA) writes here."
    )
    image: str | None = Field(
        None,
        min_length=1,
        description=(
            "Engine image (default chosen by the operator, the `server` image target). Must start with one"
            " of the operator's allowed image prefixes, when it has some (--allowed-image-prefix)."
        ),
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list)
    resources: Resources = Field(default_factory=Resources, json_schema_extra=SERVER_DEFAULT_OBJECT)
    tensor_parallel_size: Int32 = Field(
        1,
        ge=1,
        le=64,
        description=(
            "--tensor-parallel-size: GPUs (ranks) one engine replica splits the model across, one process"
            " each; resources.gpus must be at least this. With gpus 0 the ranks share the pod's CPUs (gloo)."
        ),
    )
    pipeline_parallel_size: Int32 = Field(
        1,
        ge=1,
        le=64,
        description=(
            "--pipeline-parallel-size: stages the model's layers are cut into, each of tensorParallelSize"
            " ranks, all in the engine pod (one process per rank); resources.gpus must be at least"
            " tensorParallelSize * pipelineParallelSize."
        ),
    )
    nodes: Int32 = Field(
        1,
        ge=1,
        le=64,
        description=(
            "Machines one engine replica spans (--nnodes). Above 1, each replica is a LeaderWorkerSet group"
            " of this many pods: the leader serves the API and rank 0, the others run their ranks headless;"
            " the group starts, fails and restarts as one, and the router sees one endpoint per group."
            " Needs the LeaderWorkerSet controller (leaderworkerset.x-k8s.io/v1) in the cluster;"
            " resources apply to each pod."
        ),
    )
    engine: Engine = Field(default_factory=Engine, json_schema_extra=SERVER_DEFAULT_OBJECT)
    router: Router = Field(default_factory=Router, json_schema_extra=SERVER_DEFAULT_OBJECT)
    model_cache: ModelCache | None = Field(
        None, description="A PersistentVolumeClaim mounted at HF_HOME in the engine pods."
    )
    hf_token_secret: HFTokenSecret | None = Field(
        None, description="Secret key passed to engine and router as HF_TOKEN."
    )
    api_key_secret: APIKeySecret | None = Field(
        None, description="Secret key passed to engine and router as PAGEDSERVE_API_KEY (the --api-key)."
    )
    autoscaling: Autoscaling | None = Field(
        None, description="An HPA on this resource's scale subresource, on the waiting-requests metric."
    )
    # Passed through to the engine pods.
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    pod_annotations: dict[str, str] = Field(default_factory=dict)
    env: list[EnvVar] = Field(
        default_factory=list,
        description=(
            "Extra environment variables for the engine container (Kubernetes EnvVar objects)."
            " valueFrom.secretKeyRef is refused unless the operator allows it (--allow-secret-env):"
            " Secrets reach the pods through hfTokenSecret and apiKeySecret."
        ),
    )
    disaggregation: Disaggregation | None = Field(
        None,
        description=(
            "Prefill/decode disaggregation: the engines above become the decode engines, and"
            " disaggregation.prefill adds the prefill engines (<name>-prefill), whose KV cache the decode"
            " engines read (--kv-transfer-config, Mooncake); the router runs --strategy pd. CPU engines"
            " of one rank only, for now."
        ),
    )
    scale_from_zero: ScaleFromZero | None = Field(
        None,
        description=(
            "Go to 0 engine replicas after scaleDownDelaySeconds without traffic, and back to 1 on the next"
            " request, which the routers hold meanwhile."
        ),
    )
    adapters: list[Adapter] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        description=(
            "LoRA adapters served beside the model, each under its own name. Adding or removing one loads"
            " or unloads it on every ready engine replica, without a restart."
        ),
        json_schema_extra={
            # Unique names: the API server merges and checks the list by name (the rule says so in words).
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
            **cel("self.all(a, self.exists_one(b, b.name == a.name))", "spec.adapters[].name must be unique"),
        },
    )

    @model_validator(mode="after")
    def _zero_needs_scale_from_zero(self) -> ModelDeploymentSpec:
        scaling = self.autoscaling
        if scaling is not None and scaling.min_replicas < 1 and self.scale_from_zero is None:
            raise ValueError("autoscaling.minReplicas 0 needs spec.scaleFromZero")
        return self

    @model_validator(mode="after")
    def _gpus_for_ranks(self) -> ModelDeploymentSpec:
        split = f"tensorParallelSize ({self.tensor_parallel_size})"
        if self.pipeline_parallel_size > 1:
            split += f" * pipelineParallelSize ({self.pipeline_parallel_size})"
        if self.ranks % self.nodes:
            raise ValueError(f"nodes ({self.nodes}) must divide {split}: as many ranks on each node")
        if self.nodes > 1:
            split += f" / nodes ({self.nodes})"
        gpus = self.resources.gpus
        if gpus and gpus < self.ranks_per_pod:
            raise ValueError(f"resources.gpus ({gpus}) must be >= {split}: one GPU per rank")
        return self

    @model_validator(mode="after")
    def _disaggregation(self) -> ModelDeploymentSpec:
        """DISAGGREGATION_RULES, as the CRD's CEL checks them."""
        if self.disaggregation is None:
            return self
        prefill = self.disaggregation.prefill.resources
        refused = [  # in DISAGGREGATION_RULES' order
            self.nodes > 1,
            self.resources.gpus > 0 or (prefill is not None and prefill.gpus > 0),
            bool(self.adapters),
            self.scale_from_zero is not None,
            self.router.strategy != DEFAULT_STRATEGY,
        ]
        problems = [
            message.removeprefix("spec.")
            for (_rule, message), bad in zip(DISAGGREGATION_RULES, refused, strict=True)
            if bad
        ]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def ranks(self) -> int:
        """The engine's processes: tensorParallelSize in each of pipelineParallelSize stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_pod(self) -> int:
        """The ranks each engine pod runs: all of them, or its node's share of a LeaderWorkerSet group."""
        return self.ranks // self.nodes

    @model_validator(mode="after")
    def _adapter_names(self) -> ModelDeploymentSpec:
        names = [adapter.name for adapter in self.adapters]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"adapters: names must be unique; repeated: {', '.join(repeated)}")
        if self.served_model_name in names:
            raise ValueError(
                f"adapters: {self.served_model_name!r} is spec.servedModelName, the base model's name"
            )
        return self

    def check_adapter_names(self, name: str) -> None:
        """An adapter may not take the base model's name, metadata.name when servedModelName is unset
        (the spec alone cannot see it: render() calls this)."""
        if self.served_model_name is None and any(adapter.name == name for adapter in self.adapters):
            raise ValueError(f"spec.adapters: {name!r} is the served model name (metadata.name)")

    @field_validator("model")
    @classmethod
    def _model(cls, value: str) -> str:
        if value.startswith(PVC_SCHEME) and not PVC_MODEL_RE.match(value):
            raise ValueError("model: pvc:// models look like pvc://<claim>/<path>")
        return value

    @property
    def is_embedded(self) -> bool:
        return self.model == EMBEDDED_MODEL

    @property
    def pvc_model(self) -> tuple[str, str] | None:
        """(claim, path inside the claim) for pvc:// models."""
        return pvc_location(self.model)


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
