"""Pure rendering: a ModelDeployment (a dict, as the API server returns it) -> its child manifests.

No I/O and no Kubernetes client here: ``render`` is a function of its input, so it is tested on its
own (every manifest validates against the Kubernetes OpenAPI schema) and the e2e test starts the
rendered containers as local processes.

Children, all named after the ModelDeployment ``<name>``:

- ``<name>-engine``  Deployment (``pagedserve serve``), or with ``nodes`` > 1 a LeaderWorkerSet (a group of
                     pods per replica: the leader serves, the others run ``serve --headless``), and a
                     headless Service of the serving pods (the router's discovery)
- ``<name>-prefill`` with ``disaggregation``: the prefill engines' Deployment and headless Service (the
                     router's prefill discovery); ``<name>-engine`` is then the decode engines
- ``<name>-router``  Deployment (``pagedserve router``), ServiceAccount, Role, RoleBinding
- ``<name>``         ClusterIP Service in front of the router: the OpenAI endpoint
                     ``http://<name>.<namespace>.svc/v1``
- ``<name>-cache``   PersistentVolumeClaim for the weights (when ``modelCache`` is set)
- ``<name>``         HorizontalPodAutoscaler on the ModelDeployment's scale subresource (``autoscaling``)
- ``<name>-engine``, ``<name>-router`` (and ``<name>-prefill``)  PodDisruptionBudgets
- ``<name>``         PodMonitor (when the Prometheus Operator's API is served)
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from typing import Any

from pagedserve.common.engine_args import EngineArgs, to_cli
from pagedserve.common.resource import API_VERSION, GROUP, KIND, PLURAL
from pagedserve.operator.idle import activity_interval
from pagedserve.operator.spec import (
    HF_SCHEME,
    Adapter,
    ModelDeploymentSpec,
    Resources,
    parse_spec,
    quantity,
)

from pagedserve.version import __version__

MANAGER = "pagedserve-operator"
APP_NAME = "pagedserve"
HASH_ANNOTATION = "pagedserve.io/spec-hash"
ENGINE_PORT = 8000
# A multi-node engine's group (spec.nodes > 1): the leader's port where every rank joins (--master-port),
# and the one after it, where each other node keeps its link (server/executor/node_link.py).
MASTER_PORT = 29500
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
# LeaderWorkerSet's own environment in every pod of a group: the leader's address, each pod's index.
LWS_LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"
LWS_WORKER_INDEX = "$(LWS_WORKER_INDEX)"
# Prefill/decode disaggregation (spec.disaggregation): each engine's --kv-transfer-config (vLLM's JSON,
# server/kv_transfer_config.py) names its role and the address its peers reach it at, its own pod IP
# (Kubernetes expands $(POD_IP), from the downward API, in the args). Decode engines connect to a prefill
# engine's side channel (kv_port) and its Mooncake transfer engine (a port of its own) at that IP.
KV_CONNECTOR = "MooncakeConnector"
KV_SIDE_CHANNEL_PORT = 14579  # vLLM's default kv_port
POD_IP = "$(POD_IP)"
PD_STRATEGY = "pd"  # `pagedserve router --strategy pd` (router/pd.py)
ROUTER_PORT = 8000
SERVICE_PORT = 80
HF_HOME = "/cache/huggingface"
MODEL_PVC_MOUNT = "/model-pvc"
# LoRA adapters. The engines start with the ModelDeployment's *startup* adapter set (--lora-modules), kept
# in this annotation on the ModelDeployment; spec.adapters changes reach running engines through their
# load/unload API (operator/adapters.py) and leave the pod template alone. The operator writes the
# annotation when a ModelDeployment first has adapters, and again (the fallback) when an engine refuses a
# load or does not answer: the template then changes, with the adapter set's hash on the pods, and the
# Deployment rolls to pods that start with every adapter.
STARTUP_ADAPTERS_ANNOTATION = f"{GROUP}/startup-adapters"
ADAPTERS_HASH_ANNOTATION = f"{GROUP}/adapters-hash"
ADAPTERS_MOUNT = "/adapters"  # pvc:// adapters: each claim read-only at /adapters/<claim>
# The user and group of both images (Dockerfile: `useradd --uid 10001`). Set in the pods too, so that a
# namespace enforcing PodSecurity "restricted" admits them and fsGroup makes the cache volume theirs.
RUN_AS_USER = 10001
# Everything the processes write, other than HF_HOME (the cache volume) and /dev/shm, goes to an emptyDir
# at /tmp: the root filesystem is read-only. Set here, not only in the Dockerfile, so that a custom
# spec.image behaves the same.
TMP = "/tmp"
WRITABLE_ENV = {
    "HOME": TMP,
    "TMPDIR": TMP,
    # Where server/loader/default_model.py converts the embedded model in an image that does not carry it
    # converted (the project's images do: the Dockerfile).
    "XDG_CACHE_HOME": f"{TMP}/.cache",
}
# The engine compiles kernels at startup: Triton (kernels/*.py) and torch.compile, each into its own cache.
# The C++ CPU kernels come built in the image (kernels/cpu_build.py); a custom image without them builds
# its CPU's level into $XDG_CACHE_HOME/pagedserve.
ENGINE_WRITABLE_ENV = {
    "TRITON_HOME": TMP,
    "TRITON_CACHE_DIR": f"{TMP}/triton-cache",
    "TORCHINDUCTOR_CACHE_DIR": f"{TMP}/torchinductor",
}

# The images a ModelDeployment gets when it names none: the engine (Dockerfile target `server`, CUDA),
# its CPU flavour for `resources.gpus: 0` (the same target on a Debian base with CPU torch and the C++
# compiler kernels/cpu.py needs) and the slim router/operator image (target `control`). `make images`
# tags what it builds with these names; `pagedserve operator` can override each.
DEFAULT_IMAGE = f"pagedserve/pagedserve:{__version__}"
DEFAULT_CPU_IMAGE = f"pagedserve/pagedserve:{__version__}-cpu"
DEFAULT_ROUTER_IMAGE = f"pagedserve/pagedserve-control:{__version__}"

# Every kind render() may produce: apiVersion, kind -> plural (for the REST paths).
CHILD_KINDS: dict[tuple[str, str], str] = {
    ("apps/v1", "Deployment"): "deployments",
    (LWS_API_VERSION, "LeaderWorkerSet"): "leaderworkersets",
    ("v1", "Service"): "services",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
}


# What each router's Role grants: it discovers the engine pods through their EndpointSlices.
# operator/rbac.py grants the operator the same (RBAC lets it grant only what it holds itself).
ROUTER_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
]
# With spec.scaleFromZero the routers also wake the engines through their ModelDeployment's scale
# subresource and record their last request in its annotation (router/activator.py); the Role limits
# both to that one ModelDeployment (resourceNames). The operator holds them too, for every one.
ROUTER_SCALE_RULES: list[dict[str, Any]] = [
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["patch"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/scale"], "verbs": ["get", "patch"]},
]


def engine_name(name: str) -> str:
    return f"{name}-engine"


def prefill_name(name: str) -> str:
    return f"{name}-prefill"


def router_name(name: str) -> str:
    return f"{name}-router"


def cache_name(name: str) -> str:
    return f"{name}-cache"


def endpoint(name: str, namespace: str) -> str:
    return f"http://{name}.{namespace}.svc/v1"


def selector_labels(name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": APP_NAME,
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
    }


def labels(name: str, component: str) -> dict[str, str]:
    return {**selector_labels(name, component), "app.kubernetes.io/managed-by": MANAGER}


def label_selector(name: str, component: str) -> str:
    """The engine pods' selector as a string (status.selector, read by the HPA via the scale subresource)."""
    return ",".join(f"{key}={value}" for key, value in selector_labels(name, component).items())


def potential_children(name: str) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of every child any spec of this ModelDeployment can produce."""
    return [
        ("apps/v1", "Deployment", engine_name(name)),
        (LWS_API_VERSION, "LeaderWorkerSet", engine_name(name)),
        ("apps/v1", "Deployment", prefill_name(name)),
        ("apps/v1", "Deployment", router_name(name)),
        ("v1", "Service", engine_name(name)),
        ("v1", "Service", prefill_name(name)),
        ("v1", "Service", name),
        ("v1", "ServiceAccount", router_name(name)),
        ("rbac.authorization.k8s.io/v1", "Role", router_name(name)),
        ("rbac.authorization.k8s.io/v1", "RoleBinding", router_name(name)),
        ("v1", "PersistentVolumeClaim", cache_name(name)),
        ("policy/v1", "PodDisruptionBudget", engine_name(name)),
        ("policy/v1", "PodDisruptionBudget", prefill_name(name)),
        ("policy/v1", "PodDisruptionBudget", router_name(name)),
        ("autoscaling/v2", "HorizontalPodAutoscaler", name),
        ("monitoring.coreos.com/v1", "PodMonitor", name),
    ]


def adapter_path(adapter: Adapter) -> str:
    """The adapter's lora_path as the engine sees it: a Hugging Face id, or a folder in the container."""
    pvc = adapter.pvc
    if pvc is not None:
        return f"{ADAPTERS_MOUNT}/{pvc[0]}/{pvc[1]}".rstrip("/")
    if adapter.url.startswith(HF_SCHEME):
        return adapter.url[len(HF_SCHEME) :]
    return adapter.url


def adapter_set_json(adapters: list[Adapter]) -> str:
    """The startup annotation's value: the adapters as the spec lists them, canonical JSON."""
    return json.dumps([a.model_dump() for a in adapters], sort_keys=True, separators=(",", ":"))


def startup_adapters(modeldeployment: dict[str, Any], spec: ModelDeploymentSpec) -> list[Adapter]:
    """The adapters the engines start with: the annotation's, else (unpinned or unreadable) the spec's."""
    annotations = (modeldeployment.get("metadata") or {}).get("annotations") or {}
    raw = annotations.get(STARTUP_ADAPTERS_ANNOTATION)
    if raw is None:
        return list(spec.adapters)
    try:
        return [Adapter.model_validate(item) for item in json.loads(raw)]
    except (ValueError, TypeError):  # pydantic's ValidationError is a ValueError
        return list(spec.adapters)


def spec_hash(manifest: dict[str, Any]) -> str:
    """A digest of a rendered manifest, without its own hash annotation."""
    body = copy.deepcopy(manifest)
    meta = body.get("metadata", {})
    meta.get("annotations", {}).pop(HASH_ANNOTATION, None)
    if meta.get("annotations") == {}:
        del meta["annotations"]
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def render(
    modeldeployment: dict[str, Any],
    *,
    with_podmonitor: bool = True,
    default_image: str = DEFAULT_IMAGE,
    default_cpu_image: str = DEFAULT_CPU_IMAGE,
    default_router_image: str = DEFAULT_ROUTER_IMAGE,
) -> list[dict[str, Any]]:
    """Every child manifest of a ModelDeployment, each with its ownerReference, labels and spec hash.

    ``with_podmonitor``: include the PodMonitor (the operator passes whether monitoring.coreos.com
    is served). Raises pydantic.ValidationError on a bad spec and ValueError on missing metadata.
    """
    meta = modeldeployment.get("metadata") or {}
    name, namespace, uid = meta.get("name"), meta.get("namespace"), meta.get("uid")
    if not name or not namespace or not uid:
        raise ValueError("a ModelDeployment needs metadata.name, metadata.namespace and metadata.uid")
    spec = parse_spec(modeldeployment.get("spec"))
    spec.check_adapter_names(name)
    ctx = _Context(name, namespace, uid, spec, default_image, default_cpu_image, default_router_image)
    ctx.startup_adapters = startup_adapters(modeldeployment, spec)

    children = [
        ctx.engine_leader_worker_set() if spec.nodes > 1 else ctx.engine_deployment(),
        ctx.engine_service(),
        ctx.router_service_account(),
        ctx.router_role(),
        ctx.router_role_binding(),
        ctx.router_deployment(),
        ctx.router_service(),
        ctx.pdb(engine_name(name), "engine"),
        ctx.pdb(router_name(name), "router"),
    ]
    if spec.disaggregation is not None:
        children[2:2] = [ctx.engine_deployment(prefill=True), ctx.engine_service(prefill=True)]
        children.append(ctx.pdb(prefill_name(name), "engine-prefill"))
    if spec.model_cache is not None:
        children.append(ctx.cache_pvc())
    if spec.autoscaling is not None:
        children.append(ctx.hpa())
    if with_podmonitor:
        children.append(ctx.pod_monitor())
    for child in children:
        child["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = spec_hash(child)
    return children


class _Context:
    def __init__(
        self,
        name: str,
        namespace: str,
        uid: str,
        spec: ModelDeploymentSpec,
        default_image: str,
        default_cpu_image: str,
        default_router_image: str,
    ) -> None:
        self.name = name
        self.namespace = namespace
        self.uid = uid
        self.spec = spec
        # Without GPUs the engine runs on --device cpu: the CPU flavour (CPU torch, the C++ compiler).
        self.image = spec.image or (default_image if spec.resources.gpus else default_cpu_image)
        self.router_image = spec.router.image or default_router_image
        self.served_model_name = spec.served_model_name or name
        self.startup_adapters: list[Adapter] = list(spec.adapters)

    @property
    def lora(self) -> bool:
        """LoRA on: adapters in the spec or in the startup set (so removing the last adapter restarts no
        engine; adding the first one does, as the engines start without LoRA)."""
        return bool(self.spec.adapters or self.startup_adapters)

    # -- shared pieces -------------------------------------------------------------------------

    def meta(self, name: str, component: str) -> dict[str, Any]:
        return {
            "name": name,
            "namespace": self.namespace,
            "labels": labels(self.name, component),
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": KIND,
                    "name": self.name,
                    "uid": self.uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        }

    def secret_env(self, var: str, secret: Any) -> dict[str, Any]:
        return {"name": var, "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}}

    def common_env(self, writable: dict[str, str], *api_key_vars: str) -> list[dict[str, Any]]:
        env = [{"name": "HF_HOME", "value": HF_HOME}]
        env += [{"name": name, "value": value} for name, value in writable.items()]
        if self.spec.hf_token_secret is not None:
            env.append(self.secret_env("HF_TOKEN", self.spec.hf_token_secret))
        if self.spec.api_key_secret is not None:
            env += [self.secret_env(var, self.spec.api_key_secret) for var in api_key_vars]
        return env

    def model_path(self) -> str | None:
        """The model argument as the container sees it (None: the embedded default)."""
        if self.spec.is_embedded:
            return None
        pvc = self.spec.pvc_model
        if pvc is not None:
            return f"{MODEL_PVC_MOUNT}/{pvc[1]}".rstrip("/")
        return self.spec.model

    def model_volumes(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(volumes, mounts) for a pvc:// model, mounted read-only."""
        pvc = self.spec.pvc_model
        if pvc is None:
            return [], []
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": pvc[0], "readOnly": True}}
        return [volume], [{"name": "model", "mountPath": MODEL_PVC_MOUNT, "readOnly": True}]

    def scrape_annotations(self, port: int) -> dict[str, str]:
        return {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics",
        }

    def pod_common(self) -> dict[str, Any]:
        pod: dict[str, Any] = {
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": RUN_AS_USER,
                "runAsGroup": RUN_AS_USER,
                # The cache PVC holds tens of GB of weights: relabel it only when its root is not ours yet.
                "fsGroup": RUN_AS_USER,
                "fsGroupChangePolicy": "OnRootMismatch",
                "seccompProfile": {"type": "RuntimeDefault"},
            }
        }
        if self.spec.image_pull_secrets:
            pod["imagePullSecrets"] = [{"name": ref.name} for ref in self.spec.image_pull_secrets]
        return pod

    def container_common(self, image: str) -> dict[str, Any]:
        container: dict[str, Any] = {
            "image": image,
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            },
        }
        if self.spec.image_pull_policy:
            container["imagePullPolicy"] = self.spec.image_pull_policy
        return container

    # -- engine --------------------------------------------------------------------------------

    def engine_args(self, prefill: bool = False) -> list[str]:
        """`pagedserve serve`'s arguments: the engine settings rendered by their one declaration
        (common/engine_args.py ``to_cli``, defaults left out), after the same checks the engine makes."""
        settings = EngineArgs(**self.engine_settings(prefill))
        address = ["--host", "0.0.0.0", "--port", str(ENGINE_PORT)]
        return address + to_cli(dataclasses.asdict(settings)) + list(self.spec.engine.extra_args)

    def engine_settings(self, prefill: bool = False) -> dict[str, Any]:
        """The engine settings of this ModelDeployment: spec.engine's, and those the operator decides from
        the rest of the spec; ``prefill``: a disaggregated ModelDeployment's prefill engines'."""
        spec, engine = self.spec, self.spec.engine
        values: dict[str, Any] = {
            **engine.engine_settings(),
            "model": self.model_path(),
            "served_model_name": self.served_model_name,
            "device": "cuda" if self.engine_resources(prefill).gpus else "cpu",
            "tensor_parallel_size": spec.tensor_parallel_size,
            "pipeline_parallel_size": spec.pipeline_parallel_size,
            # the router subscribes to them (router/kv_events.py)
            "enable_kv_events": engine.enable_prefix_caching and spec.router.strategy == "kv-events",
        }
        if spec.nodes > 1:  # the group's leader; its other pods add worker_args()
            values.update(nnodes=spec.nodes, master_addr=LWS_LEADER_ADDRESS, master_port=MASTER_PORT)
        if not self.engine_resources(prefill).gpus:  # no GPU memory to share out
            values.pop("gpu_memory_utilization")
        if spec.disaggregation is not None:
            values["kv_transfer_config"] = self.kv_transfer_config(prefill)
        if self.lora:
            values["enable_lora"] = True
            values["lora_modules"] = [f"{a.name}={adapter_path(a)}" for a in self.startup_adapters] or None
        return values

    def engine_resources(self, prefill: bool = False) -> Resources:
        """An engine pod's resources: spec.resources, or the prefill engines' own where they have some."""
        if prefill and self.spec.disaggregation is not None:
            return self.spec.disaggregation.prefill.resources or self.spec.resources
        return self.spec.resources

    def kv_transfer_config(self, prefill: bool) -> str:
        """--kv-transfer-config of a disaggregated ModelDeployment's prefill (producer) or decode (consumer)
        engines, each at its own pod's IP."""
        config = {
            "kv_connector": KV_CONNECTOR,
            "kv_role": "kv_producer" if prefill else "kv_consumer",
            "kv_ip": POD_IP,
            "kv_port": KV_SIDE_CHANNEL_PORT,
        }
        return json.dumps(config, separators=(",", ":"))

    def adapter_volumes(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(volumes, mounts) for the claims of pvc:// adapters, spec and startup ones: a claim is mounted
        before an adapter on it is loaded at runtime (a new claim changes the template: a restart)."""
        claims = sorted(
            {a.pvc[0] for a in [*self.spec.adapters, *self.startup_adapters] if a.pvc is not None}
        )
        volumes = [
            {"name": f"adapters-{i}", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
            for i, claim in enumerate(claims)
        ]
        mounts = [
            {"name": f"adapters-{i}", "mountPath": f"{ADAPTERS_MOUNT}/{claim}", "readOnly": True}
            for i, claim in enumerate(claims)
        ]
        return volumes, mounts

    def lora_env(self) -> list[dict[str, Any]]:
        # vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter, which the operator calls.
        return [{"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"}] if self.lora else []

    def lora_annotations(self) -> dict[str, str]:
        if not self.lora:
            return {}
        digest = hashlib.sha256(adapter_set_json(self.startup_adapters).encode()).hexdigest()[:16]
        return {ADAPTERS_HASH_ANNOTATION: digest}

    def engine_pod_template(self, worker: bool = False, prefill: bool = False) -> dict[str, Any]:
        """The engine pods' template; ``worker``: a LeaderWorkerSet group's other pods, which run their
        ranks headless (no API: no probes, no port, not scraped, not selected by the engine Service);
        ``prefill``: a disaggregated ModelDeployment's prefill engines (the others are then its decode
        engines)."""
        spec, res = self.spec, self.engine_resources(prefill)
        requests = {"cpu": res.cpu_request, "memory": res.memory_request}
        limits = {"memory": res.memory_request}
        tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]
        if res.gpus:
            requests[res.gpu_resource_name] = str(res.gpus)
            limits[res.gpu_resource_name] = str(res.gpus)
            tolerations.insert(
                0, {"key": res.gpu_resource_name, "operator": "Exists", "effect": "NoSchedule"}
            )

        health = {"path": "/health", "port": "http"}
        startup_period = 10
        container = {
            "name": "engine",
            **self.container_common(self.image),
            "command": ["pagedserve", "serve"],
            "args": self.engine_args(prefill) + (self.worker_args() if worker else []),
            "env": self.common_env({**WRITABLE_ENV, **ENGINE_WRITABLE_ENV}, "PAGEDSERVE_API_KEY")
            + self.lora_env()
            + self.kv_transfer_env()
            + [
                e.model_dump(by_alias=True, exclude_none=True)
                for e in spec.env
                if not (spec.disaggregation is not None and e.name == "POD_IP")  # the operator's own
            ],
            "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
            "resources": {"requests": requests, "limits": limits},
            "startupProbe": {
                "httpGet": health,
                "periodSeconds": startup_period,
                "failureThreshold": -(-spec.engine.startup_timeout_seconds // startup_period),
                "timeoutSeconds": 5,
            },
            "readinessProbe": {
                "httpGet": health,
                "periodSeconds": 5,
                "failureThreshold": 3,
                "timeoutSeconds": 5,
            },
            "livenessProbe": {
                "httpGet": health,
                "periodSeconds": 15,
                "failureThreshold": 4,
                "timeoutSeconds": 10,
            },
        }
        model_volumes, model_mounts = self.model_volumes()
        adapter_volumes, adapter_mounts = self.adapter_volumes()
        if spec.model_cache is not None:
            cache_volume = {"name": "cache", "persistentVolumeClaim": {"claimName": cache_name(self.name)}}
        else:
            cache_volume = {"name": "cache", "emptyDir": {}}
        shm_limit = res.shm_limit(spec.ranks_per_pod)
        volumes = [
            cache_volume,
            {"name": "tmp", "emptyDir": {}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_limit}},
            *model_volumes,
            *adapter_volumes,
        ]
        container["volumeMounts"] = [
            {"name": "cache", "mountPath": HF_HOME},
            {"name": "tmp", "mountPath": TMP},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *model_mounts,
            *adapter_mounts,
        ]
        pod_spec: dict[str, Any] = {
            **self.pod_common(),
            # The engine never calls the Kubernetes API: no service account token in its pods.
            "automountServiceAccountToken": False,
            "containers": [container],
            "volumes": volumes,
            "terminationGracePeriodSeconds": 60,
        }
        if spec.node_selector:
            pod_spec["nodeSelector"] = dict(spec.node_selector)
        if tolerations:
            pod_spec["tolerations"] = tolerations
        if worker:
            for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe"):
                del container[key]
        if prefill:  # where decode engines reach its side channel (by pod IP)
            side = {"name": "kv-side", "containerPort": KV_SIDE_CHANNEL_PORT, "protocol": "TCP"}
            container["ports"].append(side)
        component = "engine-worker" if worker else "engine-prefill" if prefill else "engine"
        annotations = {**self.lora_annotations(), **spec.pod_annotations}
        if not worker:
            annotations = {**self.scrape_annotations(ENGINE_PORT), **annotations}
        return {
            "metadata": {"labels": labels(self.name, component), "annotations": annotations},
            "spec": pod_spec,
        }

    def worker_args(self) -> list[str]:
        """What a group's other pods add to the leader's arguments: their place, and no API."""
        return to_cli({"node_rank": LWS_WORKER_INDEX, "headless": True})

    def engine_role(self, prefill: bool) -> tuple[str, str]:
        """(name, component) of the engines' Deployment and Service: the prefill engines' or the others."""
        return (prefill_name(self.name), "engine-prefill") if prefill else (engine_name(self.name), "engine")

    def kv_transfer_env(self) -> list[dict[str, Any]]:
        """A disaggregated engine's own pod IP, which its --kv-transfer-config names as $(POD_IP)."""
        if self.spec.disaggregation is None:
            return []
        return [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]

    def engine_deployment(self, prefill: bool = False) -> dict[str, Any]:
        """The engines' Deployment; ``prefill``: a disaggregated ModelDeployment's prefill engines'."""
        spec = self.spec
        name, component = self.engine_role(prefill)
        replicas = spec.disaggregation.prefill.replicas if prefill and spec.disaggregation else spec.replicas
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": self.meta(name, component),
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": selector_labels(self.name, component)},
                # A rollout waits for model loading; only then is it "stuck".
                "progressDeadlineSeconds": spec.engine.startup_timeout_seconds + 600,
                "template": self.engine_pod_template(prefill=prefill),
            },
        }

    def engine_leader_worker_set(self) -> dict[str, Any]:
        """One group of spec.nodes pods per replica (LeaderWorkerSet): created together, and recreated
        together when any of them restarts, since the engine's ranks cannot rejoin a running group."""
        return {
            "apiVersion": LWS_API_VERSION,
            "kind": "LeaderWorkerSet",
            "metadata": self.meta(engine_name(self.name), "engine"),
            "spec": {
                "replicas": self.spec.replicas,
                # The workers start with the leader, not after it is ready: it is ready only once they joined.
                "startupPolicy": "LeaderCreated",
                "leaderWorkerTemplate": {
                    "size": self.spec.nodes,
                    "restartPolicy": "RecreateGroupOnPodRestart",
                    "leaderTemplate": self.engine_pod_template(),
                    "workerTemplate": self.engine_pod_template(worker=True),
                },
            },
        }

    def engine_service(self, prefill: bool = False) -> dict[str, Any]:
        """The engines' headless Service, whose EndpointSlices the routers watch (``prefill``: the prefill
        engines', --prefill-k8s-service)."""
        name, component = self.engine_role(prefill)
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self.meta(name, component),
            "spec": {
                "clusterIP": "None",
                "selector": selector_labels(self.name, component),
                "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
            },
        }

    # -- router --------------------------------------------------------------------------------

    def router_tokenizer(self) -> str | None:
        if self.spec.router.tokenizer:
            return self.spec.router.tokenizer
        return self.model_path()

    def router_args(self) -> list[str]:
        router = self.spec.router
        disaggregated = self.spec.disaggregation is not None
        # disaggregated: the engine Service is the decode engines', and the prefill engines' have their own
        prefill = ["--prefill-k8s-service", prefill_name(self.name)] if disaggregated else []
        args = [
            "--host", "0.0.0.0",
            "--port", str(ROUTER_PORT),
            "--k8s-service", engine_name(self.name),
            *prefill,
            "--namespace", self.namespace,
            "--target-port", str(ENGINE_PORT),
            "--strategy", PD_STRATEGY if disaggregated else router.strategy,
            "--mean-load-factor", str(router.mean_load_factor),
            "--block-size", str(self.spec.engine.block_size),
            "--model-name", self.served_model_name,
        ]  # fmt: skip
        tokenizer = self.router_tokenizer()
        if tokenizer is not None:
            args += ["--tokenizer", tokenizer]
        return args + self.scale_from_zero_args() + list(router.extra_args)

    def scale_from_zero_args(self) -> list[str]:
        zero = self.spec.scale_from_zero
        if zero is None:
            return []
        return [
            "--scale-from-zero", self.name,
            "--max-held-requests", str(zero.max_held_requests),
            "--held-request-timeout", str(zero.held_request_timeout_seconds),
            "--activity-interval", str(activity_interval(zero.scale_down_delay_seconds)),
        ]  # fmt: skip

    def router_deployment(self) -> dict[str, Any]:
        router = self.spec.router
        health = {"path": "/health", "port": "http"}
        ready = {"path": "/ready", "port": "http"}  # 503 until an engine replica is ready
        volumes: list[dict[str, Any]] = [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
        mounts: list[dict[str, Any]] = [
            {"name": "cache", "mountPath": HF_HOME},
            {"name": "tmp", "mountPath": TMP},
        ]
        if not router.tokenizer:  # the router reads the tokenizer from the model's own place
            model_volumes, model_mounts = self.model_volumes()
            volumes += model_volumes
            mounts += model_mounts
        container = {
            "name": "router",
            **self.container_common(self.router_image),
            "command": ["pagedserve", "router"],
            "args": self.router_args(),
            # The router passes clients' Authorization on to the engines, and with the same key checks
            # it itself at the edge (PAGEDSERVE_ROUTER_API_KEY), before tokenizing or proxying.
            "env": self.common_env(WRITABLE_ENV, "PAGEDSERVE_API_KEY", "PAGEDSERVE_ROUTER_API_KEY"),
            "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
            "resources": {
                "requests": {"cpu": router.resources.cpu, "memory": router.resources.memory},
                "limits": {"memory": router.resources.memory},
            },
            "readinessProbe": {
                "httpGet": ready,
                "periodSeconds": 5,
                "failureThreshold": 3,
                "timeoutSeconds": 5,
            },
            "livenessProbe": {
                "httpGet": health,
                "initialDelaySeconds": 30,
                "periodSeconds": 15,
                "failureThreshold": 4,
                "timeoutSeconds": 10,
            },
            "volumeMounts": mounts,
        }
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": self.meta(router_name(self.name), "router"),
            "spec": {
                "replicas": router.replicas,
                "selector": {"matchLabels": selector_labels(self.name, "router")},
                "template": {
                    "metadata": {
                        "labels": labels(self.name, "router"),
                        "annotations": self.scrape_annotations(ROUTER_PORT),
                    },
                    "spec": {
                        **self.pod_common(),
                        "serviceAccountName": router_name(self.name),
                        "containers": [container],
                        "volumes": volumes,
                    },
                },
            },
        }

    def router_service(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self.meta(self.name, "router"),
            "spec": {
                "type": "ClusterIP",
                "selector": selector_labels(self.name, "router"),
                "ports": [{"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}],
            },
        }

    def router_service_account(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": self.meta(router_name(self.name), "router"),
        }

    def router_role(self) -> dict[str, Any]:
        return {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": self.meta(router_name(self.name), "router"),
            "rules": self.router_rules(),
        }

    def router_rules(self) -> list[dict[str, Any]]:
        rules = copy.deepcopy(ROUTER_RULES)
        if self.spec.scale_from_zero is not None:
            rules += [{**copy.deepcopy(rule), "resourceNames": [self.name]} for rule in ROUTER_SCALE_RULES]
        return rules

    def router_role_binding(self) -> dict[str, Any]:
        return {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": self.meta(router_name(self.name), "router"),
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": router_name(self.name),
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": router_name(self.name), "namespace": self.namespace}
            ],
        }

    # -- the rest ------------------------------------------------------------------------------

    def pdb(self, name: str, component: str) -> dict[str, Any]:
        return {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": self.meta(name, component),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(self.name, component)}},
        }

    def cache_pvc(self) -> dict[str, Any]:
        cache = self.spec.model_cache
        assert cache is not None
        spec: dict[str, Any] = {
            "accessModes": [cache.access_mode],
            "resources": {"requests": {"storage": cache.size}},
        }
        if cache.storage_class_name:
            spec["storageClassName"] = cache.storage_class_name
        return {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": self.meta(cache_name(self.name), "cache"),
            "spec": spec,
        }

    def hpa(self) -> dict[str, Any]:
        scaling = self.spec.autoscaling
        assert scaling is not None
        return {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": self.meta(self.name, "autoscaler"),
            "spec": {
                # The ModelDeployment's scale subresource: the HPA writes spec.replicas, the operator
                # copies it to the engine Deployment, so the two never fight over the Deployment.
                "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": self.name},
                # At least 1: minReplicas 0 means scale-from-zero, whose 0 <-> 1 edge the routers and the
                # operator own (operator/idle.py); the HPA rests while its target is at 0.
                "minReplicas": max(1, scaling.min_replicas),
                "maxReplicas": scaling.max_replicas,
                "metrics": [
                    {
                        "type": "Pods",
                        "pods": {
                            "metric": {"name": scaling.metric_name},
                            "target": {
                                "type": "AverageValue",
                                "averageValue": quantity(scaling.target_waiting_requests),
                            },
                        },
                    }
                ],
            },
        }

    def pod_monitor(self) -> dict[str, Any]:
        components = ["engine", "router"]
        if self.spec.disaggregation is not None:
            components.insert(1, "engine-prefill")
        return {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PodMonitor",
            "metadata": self.meta(self.name, "monitoring"),
            "spec": {
                "selector": {
                    "matchLabels": {
                        "app.kubernetes.io/name": APP_NAME,
                        "app.kubernetes.io/instance": self.name,
                    },
                    "matchExpressions": [
                        {
                            "key": "app.kubernetes.io/component",
                            "operator": "In",
                            "values": components,
                        }
                    ],
                },
                "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
            },
        }
