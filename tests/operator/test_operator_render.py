"""render(): every child manifest of a ModelDeployment, checked strictly against the official schemas of the
oldest and the newest Kubernetes minor we support (pagedserve/testing/kube.py)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from pagedserve.operator import render
from pagedserve.operator.resources import HASH_ANNOTATION, spec_hash
from pydantic import ValidationError

from pagedserve.testing.kube import KUBERNETES_MINORS, errors, manifest_errors
from pagedserve.testing.operator_examples import LORA_SPEC, design_example

UID = "0f3c2c52-7d0e-4a53-a1f9-9a8e1e0a1b2c"


def md(name: str = "llama-8b", namespace: str = "ml", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pagedserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": namespace, "uid": UID, "generation": 1},
        "spec": {"model": "meta-llama/Llama-3.1-8B-Instruct", **spec},
    }


SPECS: dict[str, dict[str, Any]] = {
    "defaults": md(),
    "design-example": design_example(uid=UID, generation=1),
    "gpus": md(
        resources={
            "gpus": 4,
            "gpuResourceName": "amd.com/gpu",
            "cpu": 16,
            "memory": "128Gi",
            "shmSize": "16Gi",
        },
        nodeSelector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
        tolerations=[{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
        podAnnotations={"team": "ml"},
    ),
    "cpu": md(model="embedded", resources={"gpus": 0}, router={"replicas": 1, "strategy": "round-robin"}),
    "autoscaling": md(replicas=2, autoscaling={"maxReplicas": 10, "targetWaitingRequests": 0.5}),
    "secrets": md(hfTokenSecret={"name": "hf"}, apiKeySecret={"name": "api", "key": "token"}),
    "scale-from-zero": md(
        replicas=0,
        autoscaling={"minReplicas": 0, "maxReplicas": 4},
        scaleFromZero={"scaleDownDelaySeconds": 120, "maxHeldRequests": 50},
    ),
    "lora-adapters": md(**LORA_SPEC),
    "tensor-parallel": md(tensorParallelSize=4, resources={"gpus": 4}),
    "tensor-parallel-cpu": md(model="embedded", tensorParallelSize=3, resources={"gpus": 0}),
    "pipeline-parallel": md(tensorParallelSize=2, pipelineParallelSize=2, resources={"gpus": 4}),
    "multi-node": md(
        replicas=2, tensorParallelSize=8, pipelineParallelSize=2, nodes=2, resources={"gpus": 8}
    ),
    # prefill/decode disaggregation: decode engines (spec.replicas, autoscaled) and prefill engines
    "disaggregated": md(
        model="embedded",
        replicas=3,
        resources={"gpus": 0},
        disaggregation={"prefill": {"replicas": 2, "resources": {"gpus": 0, "cpu": 8, "memory": "16Gi"}}},
        autoscaling={"maxReplicas": 6},
        env=[{"name": "POD_IP", "value": "not-mine"}, {"name": "LOG_LEVEL", "value": "debug"}],
    ),
    "extra-args": md(
        engine={
            "extraArgs": ["--enforce-eager", "--seed", "7"],
            "enablePrefixCaching": False,
            "maxNumBatchedTokens": 4096,
            "maxModelLen": 2048,
        },
        router={"extraArgs": ["--max-retries", "5"], "tokenizer": "meta-llama/Llama-3.1-8B-Instruct"},
        env=[
            {"name": "LOG_LEVEL", "value": "debug"},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ],
        imagePullPolicy="Always",
        imagePullSecrets=[{"name": "registry"}],
    ),
    "pvc-model": md(
        model="pvc://weights/llama/8b", modelCache={"size": "20Gi", "accessMode": "ReadWriteMany"}
    ),
    # Every field of the spec set (the "minimal" case is "defaults").
    "full": md(
        servedModelName="llama",
        replicas=3,
        tensorParallelSize=2,
        pipelineParallelSize=1,
        nodes=1,
        image="registry.example/pagedserve:0.1.0",
        imagePullPolicy="IfNotPresent",
        imagePullSecrets=[{"name": "registry"}],
        resources={
            "gpus": 2,
            "gpuResourceName": "nvidia.com/gpu",
            "cpu": "500m",
            "memory": 64,
            "shmSize": "8Gi",
        },
        engine={
            "maxModelLen": 4096,
            "blockSize": 32,
            "gpuMemoryUtilization": 0.85,
            "maxNumSeqs": 64,
            "maxNumBatchedTokens": 8192,
            "dtype": "float16",
            "enablePrefixCaching": False,
            "startupTimeoutSeconds": 600,
            "extraArgs": ["--seed", "1"],
        },
        router={
            "replicas": 3,
            "strategy": "least-load",
            "meanLoadFactor": 1.5,
            "image": "registry.example/pagedserve-control:0.1.0",
            "tokenizer": "meta-llama/Llama-3.1-8B-Instruct",
            "resources": {"cpu": 2, "memory": "1Gi"},
            "extraArgs": ["--max-retries", "2"],
        },
        modelCache={"size": "100Gi", "storageClassName": "fast", "accessMode": "ReadWriteOncePod"},
        hfTokenSecret={"name": "hf", "key": "t"},
        apiKeySecret={"name": "api", "key": "k"},
        autoscaling={
            "minReplicas": 2,
            "maxReplicas": 6,
            "targetWaitingRequests": 2.5,
            "metricName": "waiting",
        },
        nodeSelector={"pool": "gpu"},
        tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60}],
        podAnnotations={"team": "ml"},
        env=[
            {"name": "A", "value": "1"},
            {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        ],
    ),
}


def by_kind(children: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def container(children: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (deployment,) = [c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == name]
    return deployment["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


@pytest.mark.parametrize("case", sorted(SPECS))
def test_every_child_validates_and_is_owned(case: str) -> None:
    modeldeployment = SPECS[case]
    children = render(modeldeployment)
    name = modeldeployment["metadata"]["name"]
    assert len({(c["kind"], c["metadata"]["name"]) for c in children}) == len(children)
    for child in children:
        meta = child["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "pagedserve.io/v1alpha1",
                "kind": "ModelDeployment",
                "name": name,
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        labels = meta["labels"]
        assert labels["app.kubernetes.io/name"] == "pagedserve"
        assert labels["app.kubernetes.io/instance"] == name
        assert labels["app.kubernetes.io/managed-by"] == "pagedserve-operator"
        assert labels["app.kubernetes.io/component"]
        assert meta["annotations"][HASH_ANNOTATION] == spec_hash(child)
        if child["kind"] == "PodMonitor":
            check_podmonitor(child)
        assert manifest_errors(child) == [], f"{child['kind']}/{meta['name']}"


@pytest.mark.parametrize("case", sorted(SPECS))
def test_the_modeldeployment_itself_validates(case: str) -> None:
    """Every input above is one the API server accepts (the generated CRD's schema, defaults, CEL)."""
    assert manifest_errors(SPECS[case]) == []


def check_podmonitor(monitor: dict[str, Any]) -> None:
    """What the operator puts into its PodMonitor (kube.py checks it against the official schema too)."""
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    spec = monitor["spec"]
    assert set(spec) <= {
        "selector",
        "podMetricsEndpoints",
        "namespaceSelector",
        "jobLabel",
        "podTargetLabels",
    }
    assert isinstance(spec["selector"]["matchLabels"], dict)
    for expression in spec["selector"].get("matchExpressions", []):
        assert expression["operator"] in {"In", "NotIn", "Exists", "DoesNotExist"}
    for endpoint in spec["podMetricsEndpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scheme", "scrapeTimeout", "honorLabels"}
        assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"


@pytest.mark.parametrize("minor", KUBERNETES_MINORS)
def test_the_validator_is_strict(minor: str) -> None:
    """The schema check would catch unknown fields, bad types and bad quantities deep in a manifest."""
    deployment = copy.deepcopy(render(SPECS["defaults"])[0])
    spec = deployment["spec"]["template"]["spec"]
    spec["containers"][0]["bogus"] = 1
    spec["containers"][0]["resources"]["limits"]["memory"] = "lots"
    spec["containers"][0]["ports"][0]["containerPort"] = "8000"
    spec["containers"][0]["readinessProbe"]["httpGet"]["port"] = 8000  # int-or-string: fine
    problems = errors(deployment, minor)
    assert any("containers.0: Additional properties" in e and "bogus" in e for e in problems), problems
    assert any("limits.memory" in e for e in problems), problems
    assert any("containerPort" in e for e in problems), problems
    assert len(problems) == 3, problems


def test_children_and_names() -> None:
    children = by_kind(render(SPECS["design-example"]))
    assert sorted(children) == sorted(
        [
            ("Deployment", "llama-8b-engine"),
            ("Service", "llama-8b-engine"),
            ("Deployment", "llama-8b-router"),
            ("Service", "llama-8b"),
            ("ServiceAccount", "llama-8b-router"),
            ("Role", "llama-8b-router"),
            ("RoleBinding", "llama-8b-router"),
            ("PersistentVolumeClaim", "llama-8b-cache"),
            ("HorizontalPodAutoscaler", "llama-8b"),
            ("PodDisruptionBudget", "llama-8b-engine"),
            ("PodDisruptionBudget", "llama-8b-router"),
            ("PodMonitor", "llama-8b"),
        ]
    )
    kinds = {c["kind"] for c in render(SPECS["defaults"], with_podmonitor=False)}
    assert "PodMonitor" not in kinds and "HorizontalPodAutoscaler" not in kinds
    assert "PersistentVolumeClaim" not in kinds


def test_engine_on_gpus() -> None:
    children = render(SPECS["design-example"])
    deployment = by_kind(children)[("Deployment", "llama-8b-engine")]
    pod = deployment["spec"]["template"]["spec"]
    engine = container(children, "llama-8b-engine")
    assert deployment["spec"]["replicas"] == 2
    assert engine["image"] == "registry.example/pagedserve:0.1.0"
    assert engine["command"] == ["pagedserve", "serve"]
    # The engine settings in their declaration's order (common/engine_args.py), defaults left out.
    assert engine["args"] == [
        "--host", "0.0.0.0", "--port", "8000",
        "meta-llama/Llama-3.1-8B-Instruct", "--served-model-name", "llama-8b", "--dtype", "bfloat16",
        "--device", "cuda", "--max-model-len", "8192",
    ]  # fmt: skip
    assert engine["resources"] == {
        "requests": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"},
        "limits": {"memory": "32Gi", "nvidia.com/gpu": "1"},
    }
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "nodeSelector" not in pod
    # probes on /health, a startup probe long enough for loading a model (30 min by default)
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert engine[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
    assert engine["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    # /dev/shm in memory, the model cache PVC at HF_HOME
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    hf_home = env_of(engine)["HF_HOME"]
    assert volumes[mounts[hf_home]]["persistentVolumeClaim"] == {"claimName": "llama-8b-cache"}
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
    }
    pvc = by_kind(children)[("PersistentVolumeClaim", "llama-8b-cache")]
    assert pvc["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "50Gi"}},
        "storageClassName": "standard",
    }


def test_gpu_resource_name_tolerations_and_node_selector() -> None:
    children = render(SPECS["gpus"])
    engine = container(children, "llama-8b-engine")
    pod = by_kind(children)[("Deployment", "llama-8b-engine")]["spec"]["template"]["spec"]
    assert engine["resources"]["limits"] == {"memory": "128Gi", "amd.com/gpu": "4"}
    assert engine["resources"]["requests"]["cpu"] == "16"
    assert pod["tolerations"] == [
        {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"},
    ]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "16Gi"
    template = by_kind(children)[("Deployment", "llama-8b-engine")]["spec"]["template"]["metadata"]
    assert template["annotations"]["team"] == "ml"


def test_cpu_deployment_of_the_embedded_model() -> None:
    children = render(SPECS["cpu"])
    engine = container(children, "llama-8b-engine")
    pod = by_kind(children)[("Deployment", "llama-8b-engine")]["spec"]["template"]["spec"]
    # "embedded": no model argument, so `pagedserve serve` serves its embedded default model
    assert engine["args"][:2] == ["--host", "0.0.0.0"]
    assert engine["args"][engine["args"].index("--device") + 1] == "cpu"
    assert "--gpu-memory-utilization" not in engine["args"]
    assert not any("gpu" in key for key in engine["resources"]["limits"])
    assert "tolerations" not in pod
    assert engine["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}
    router = container(children, "llama-8b-router")
    assert "--tokenizer" not in router["args"]
    assert router["args"][router["args"].index("--strategy") + 1] == "round-robin"
    assert by_kind(children)[("Deployment", "llama-8b-router")]["spec"]["replicas"] == 1


def test_router_deployment_service_and_rbac() -> None:
    children = by_kind(render(SPECS["design-example"]))
    router = container(list(children.values()), "llama-8b-router")
    assert router["command"] == ["pagedserve", "router"]
    args = router["args"]
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags == {
        "--host": "0.0.0.0",
        "--port": "8000",
        "--k8s-service": "llama-8b-engine",
        "--namespace": "ml",
        "--target-port": "8000",
        "--strategy": "prefix-hash",
        "--mean-load-factor": "1.25",
        "--block-size": "16",
        "--model-name": "llama-8b",
        "--tokenizer": "meta-llama/Llama-3.1-8B-Instruct",
    }
    assert router["image"] == "pagedserve/pagedserve-control:0.1.0"
    assert router["readinessProbe"]["httpGet"]["path"] == "/ready"
    pod = children[("Deployment", "llama-8b-router")]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "llama-8b-router"
    # the endpoint: a ClusterIP Service named after the ModelDeployment, on port 80
    service = children[("Service", "llama-8b")]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "router"
    headless = children[("Service", "llama-8b-engine")]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"]["app.kubernetes.io/component"] == "engine"
    assert children[("Role", "llama-8b-router")]["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    binding = children[("RoleBinding", "llama-8b-router")]
    assert binding["roleRef"]["name"] == "llama-8b-router"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-8b-router", "namespace": "ml"}]


def test_autoscaling_targets_the_scale_subresource() -> None:
    children = by_kind(render(SPECS["autoscaling"]))
    hpa = children[("HorizontalPodAutoscaler", "llama-8b")]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"] == {
        "scaleTargetRef": {
            "apiVersion": "pagedserve.io/v1alpha1",
            "kind": "ModelDeployment",
            "name": "llama-8b",
        },
        "minReplicas": 1,
        "maxReplicas": 10,
        "metrics": [
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": "vllm_num_requests_waiting"},
                    "target": {"type": "AverageValue", "averageValue": "500m"},
                },
            }
        ],
    }
    # the operator copies spec.replicas (which the HPA writes) to the engine Deployment
    assert children[("Deployment", "llama-8b-engine")]["spec"]["replicas"] == 2


def test_secrets_become_env() -> None:
    children = render(SPECS["secrets"])
    engine = env_of(container(children, "llama-8b-engine"))
    router = env_of(container(children, "llama-8b-router"))
    hf = {"secretKeyRef": {"name": "hf", "key": "token"}}
    api = {"secretKeyRef": {"name": "api", "key": "token"}}
    assert engine["HF_TOKEN"] == hf and engine["PAGEDSERVE_API_KEY"] == api
    assert router["HF_TOKEN"] == hf and router["PAGEDSERVE_API_KEY"] == api
    assert router["PAGEDSERVE_ROUTER_API_KEY"] == api
    engine_args = container(children, "llama-8b-engine")["args"]
    assert "--api-key" not in engine_args  # never on the command line
    none = env_of(container(render(SPECS["defaults"]), "llama-8b-engine"))
    assert "HF_TOKEN" not in none and "PAGEDSERVE_API_KEY" not in none


def test_extra_args_and_env() -> None:
    children = render(SPECS["extra-args"])
    engine = container(children, "llama-8b-engine")
    args = engine["args"]
    assert args[-3:] == ["--enforce-eager", "--seed", "7"]
    assert "--no-enable-prefix-caching" in args
    assert args[args.index("--max-num-batched-tokens") + 1] == "4096"
    assert args[args.index("--max-model-len") + 1] == "2048"
    assert env_of(engine)["LOG_LEVEL"] == "debug"
    assert env_of(engine)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert engine["imagePullPolicy"] == "Always"
    router = container(children, "llama-8b-router")
    assert router["args"][-2:] == ["--max-retries", "5"]
    for deployment in ("llama-8b-engine", "llama-8b-router"):
        pod = by_kind(children)[("Deployment", deployment)]["spec"]["template"]["spec"]
        assert pod["imagePullSecrets"] == [{"name": "registry"}]


def test_pvc_model_is_mounted_read_only() -> None:
    children = render(SPECS["pvc-model"])
    for name in ("llama-8b-engine", "llama-8b-router"):
        pod = by_kind(children)[("Deployment", name)]["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model")
        assert mount["readOnly"] is True
    engine = container(children, "llama-8b-engine")
    assert engine["args"][4] == "/model-pvc/llama/8b"  # the positional MODEL, after --host and --port
    router = container(children, "llama-8b-router")
    assert router["args"][router["args"].index("--tokenizer") + 1] == "/model-pvc/llama/8b"
    pvc = by_kind(children)[("PersistentVolumeClaim", "llama-8b-cache")]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and "storageClassName" not in pvc["spec"]


def test_render_is_pure_and_the_hash_follows_the_spec() -> None:
    modeldeployment = SPECS["design-example"]
    snapshot = copy.deepcopy(modeldeployment)
    first, second = render(modeldeployment), render(modeldeployment)
    assert first == second and modeldeployment == snapshot
    changed = copy.deepcopy(modeldeployment)
    changed["spec"]["replicas"] = 3
    hashes = {c["metadata"]["name"] + c["kind"]: c["metadata"]["annotations"][HASH_ANNOTATION] for c in first}
    after = {
        c["metadata"]["name"] + c["kind"]: c["metadata"]["annotations"][HASH_ANNOTATION]
        for c in render(changed)
    }
    assert {key for key in hashes if hashes[key] != after[key]} == {"llama-8b-engineDeployment"}


def test_default_images_come_from_the_operator() -> None:
    images = {"default_image": "reg/engine:1", "default_cpu_image": "reg/engine:1-cpu"}
    children = render(SPECS["defaults"], **images, default_router_image="reg/control:1")
    assert container(children, "llama-8b-engine")["image"] == "reg/engine:1"
    assert container(children, "llama-8b-router")["image"] == "reg/control:1"
    cpu = render(md(resources={"gpus": 0}), **images)
    assert container(cpu, "llama-8b-engine")["image"] == "reg/engine:1-cpu"


def test_cpu_engines_get_the_cpu_flavour_by_default() -> None:
    """`resources.gpus: 0` runs --device cpu: the image `make images` builds with CPU torch and g++."""
    from pagedserve.operator.resources import DEFAULT_CPU_IMAGE, DEFAULT_IMAGE

    assert container(render(md(resources={"gpus": 0})), "llama-8b-engine")["image"] == DEFAULT_CPU_IMAGE
    assert f"{DEFAULT_IMAGE}-cpu" == DEFAULT_CPU_IMAGE
    assert container(render(SPECS["defaults"]), "llama-8b-engine")["image"] == DEFAULT_IMAGE
    own = md(resources={"gpus": 0}, image="reg/mine:1")
    assert container(render(own), "llama-8b-engine")["image"] == "reg/mine:1"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"model": "m", "replicas": -1}, "spec.replicas"),
        ({"model": "m", "router": {"strategy": "random"}}, "spec.router.strategy"),
        ({"model": "m", "engine": {"blockSize": 12}}, "spec.engine.blockSize"),
        ({"model": "m", "engine": {"runner": "embed"}}, "spec.engine.runner"),
        ({"replicas": 1}, "spec.model"),
        ({"model": "m", "resources": {"gpus": -1}}, "spec.resources.gpus"),
        ({"model": "m", "resources": {"memory": "lots"}}, "spec.resources.memory"),
        ({"model": "m", "bogus": True}, "spec.bogus"),
        ({"model": "m", "tensorParallelSize": 0}, "spec.tensorParallelSize"),
        ({"model": "m", "tensorParallelSize": 2}, "resources.gpus (1) must be >= tensorParallelSize (2)"),
        ({"model": "m", "pipelineParallelSize": 0}, "spec.pipelineParallelSize"),
        ({"model": "m", "nodes": 3, "tensorParallelSize": 2}, "nodes (3) must divide"),
        (
            {"model": "m", "nodes": 2, "tensorParallelSize": 8, "resources": {"gpus": 2}},
            "resources.gpus (2) must be >= tensorParallelSize (8) / nodes (2)",
        ),
        (
            {"model": "m", "tensorParallelSize": 2, "pipelineParallelSize": 2, "resources": {"gpus": 3}},
            "resources.gpus (3) must be >= tensorParallelSize (2) * pipelineParallelSize (2)",
        ),
    ],
)
def test_bad_specs_are_rejected_naming_the_field(spec: dict[str, Any], field: str) -> None:
    from pagedserve.operator.spec import format_validation_error

    bad = md()
    bad["spec"] = spec
    with pytest.raises(ValidationError) as error:
        render(bad)
    assert field in format_validation_error(error.value)


def test_missing_metadata_is_an_error() -> None:
    bad = md()
    del bad["metadata"]["uid"]
    with pytest.raises(ValueError, match=r"metadata\.uid"):
        render(bad)


def test_an_embedding_model_runs_the_pooling_runner() -> None:
    """An embedding checkpoint's ModelDeployment (issue 40): its engines get --runner pooling, everything
    else as for a chat model (the router proxies /v1/embeddings, /score and /rerank by load)."""
    embedder = md(name="qwen3-embed", model="Qwen/Qwen3-Embedding-0.6B", engine={"runner": "pooling"})
    assert manifest_errors(embedder) == []
    children = render(embedder)
    args = container(children, "qwen3-embed-engine")["args"]
    assert args[args.index("--runner") + 1] == "pooling"
    assert all(manifest_errors(child) == [] for child in children)
    assert "--runner" not in container(render(SPECS["defaults"]), "llama-8b-engine")["args"]  # auto


def test_kv_events_strategy_turns_on_the_engines_kv_events() -> None:
    children = render(md(router={"strategy": "kv-events"}))
    assert "--enable-kv-events" in container(children, "llama-8b-engine")["args"]
    router_args = container(children, "llama-8b-router")["args"]
    assert router_args[router_args.index("--strategy") + 1] == "kv-events"
    assert "--enable-kv-events" not in container(render(SPECS["defaults"]), "llama-8b-engine")["args"]
    # Without prefix caching there is nothing to publish: the router falls back to prefix-hash.
    no_cache = render(md(router={"strategy": "kv-events"}, engine={"enablePrefixCaching": False}))
    assert "--enable-kv-events" not in container(no_cache, "llama-8b-engine")["args"]


def test_tensor_parallel_engine_gets_its_gpus_flag_and_shared_memory() -> None:
    """N ranks: the flag, N GPUs requested, /dev/shm sized 1Gi per rank for NCCL unless shmSize says."""
    children = render(SPECS["tensor-parallel"])
    engine = container(children, "llama-8b-engine")
    pod = by_kind(children)[("Deployment", "llama-8b-engine")]["spec"]["template"]["spec"]
    args = engine["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert engine["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "4"
    shm = {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]
    assert shm == {"medium": "Memory", "sizeLimit": "4Gi"}
    mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
    assert mounts["/dev/shm"] == "dshm"
    pinned = md(tensorParallelSize=4, resources={"gpus": 8, "shmSize": "2Gi"})
    pod = by_kind(render(pinned))[("Deployment", "llama-8b-engine")]["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "2Gi"
    # one rank: no flag, the 1Gi /dev/shm as before
    single = render(SPECS["defaults"])
    assert "--tensor-parallel-size" not in container(single, "llama-8b-engine")["args"]
    pod = by_kind(single)[("Deployment", "llama-8b-engine")]["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "1Gi"


def test_pipeline_stages_get_their_flag_and_shared_memory_per_rank() -> None:
    """2 stages of 2 ranks: both flags, 4 GPUs, /dev/shm sized for 4 ranks."""
    children = render(SPECS["pipeline-parallel"])
    args = container(children, "llama-8b-engine")["args"]
    assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    pod = by_kind(children)[("Deployment", "llama-8b-engine")]["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "4Gi"
    assert "--pipeline-parallel-size" not in container(render(SPECS["defaults"]), "llama-8b-engine")["args"]


def test_replicas_across_nodes_are_leaderworkerset_groups() -> None:
    """nodes 2: one LeaderWorkerSet (no engine Deployment), a group of 2 pods per replica; the leader serves
    and leads the ranks' group, the other pod runs its ranks headless; only leaders are engine endpoints."""
    children = by_kind(render(SPECS["multi-node"]))
    assert ("Deployment", "llama-8b-engine") not in children
    lws = children[("LeaderWorkerSet", "llama-8b-engine")]
    group = lws["spec"]["leaderWorkerTemplate"]
    assert (lws["spec"]["replicas"], group["size"]) == (2, 2)
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = group["leaderTemplate"]["spec"]["containers"][0]
    worker = group["workerTemplate"]["spec"]["containers"][0]
    args = leader["args"]
    assert args[args.index("--nnodes") + 1] == "2"
    assert args[args.index("--master-addr") + 1] == "$(LWS_LEADER_ADDRESS)"
    assert args[args.index("--master-port") + 1] == "29500"
    assert worker["args"] == [*args, "--node-rank", "$(LWS_WORKER_INDEX)", "--headless"]
    assert "readinessProbe" in leader and "readinessProbe" not in worker and "ports" not in worker
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == "8"  # 16 ranks over 2 pods
    leader_labels = group["leaderTemplate"]["metadata"]["labels"]
    worker_labels = group["workerTemplate"]["metadata"]["labels"]
    selector = children[("Service", "llama-8b-engine")]["spec"]["selector"]
    assert selector.items() <= leader_labels.items() and not selector.items() <= worker_labels.items()


def test_tensor_parallel_on_cpu_needs_no_gpus() -> None:
    engine = container(render(SPECS["tensor-parallel-cpu"]), "llama-8b-engine")
    args = engine["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "3"
    assert args[args.index("--device") + 1] == "cpu"
    assert not any("gpu" in key for key in engine["resources"]["requests"])


def kv_transfer_config(args: list[str]) -> dict[str, Any]:
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def test_disaggregation_renders_a_prefill_and_a_decode_role() -> None:
    """spec.disaggregation: the engine Deployment and Service are the decode engines (kv_consumer), a
    second Deployment and Service <name>-prefill the prefill engines (kv_producer), each engine at its own
    pod IP ($(POD_IP), from the downward API); the router runs --strategy pd over both Services."""
    children = by_kind(render(SPECS["disaggregated"]))
    assert {key for key in children if "prefill" in key[1]} == {
        ("Deployment", "llama-8b-prefill"),
        ("Service", "llama-8b-prefill"),
        ("PodDisruptionBudget", "llama-8b-prefill"),
    }
    decode = container(list(children.values()), "llama-8b-engine")
    prefill = container(list(children.values()), "llama-8b-prefill")
    for engine, role in ((decode, "kv_consumer"), (prefill, "kv_producer")):
        assert kv_transfer_config(engine["args"]) == {
            "kv_connector": "MooncakeConnector",
            "kv_role": role,
            "kv_ip": "$(POD_IP)",
            "kv_port": 14579,
        }
        env = env_of(engine)
        # the operator's POD_IP, not the spec's: $(POD_IP) must be the pod's own address
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert [e["name"] for e in engine["env"]].count("POD_IP") == 1
        assert env["LOG_LEVEL"] == "debug"
        assert engine["args"][engine["args"].index("--device") + 1] == "cpu"
    # the same engine otherwise: only the role in --kv-transfer-config differs
    differ = [(a, b) for a, b in zip(decode["args"], prefill["args"], strict=True) if a != b]
    assert len(differ) == 1 and "kv_producer" in differ[0][1]
    # the side channel decode engines connect to, on the prefill pods
    assert prefill["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "kv-side", "containerPort": 14579, "protocol": "TCP"},
    ]
    assert decode["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    # replicas and resources: spec.replicas (which the HPA writes) for decode, prefill's own for prefill
    decode_deployment = children[("Deployment", "llama-8b-engine")]
    prefill_deployment = children[("Deployment", "llama-8b-prefill")]
    assert (decode_deployment["spec"]["replicas"], prefill_deployment["spec"]["replicas"]) == (3, 2)
    assert decode["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}
    assert prefill["resources"] == {"requests": {"cpu": "8", "memory": "16Gi"}, "limits": {"memory": "16Gi"}}
    assert children[("HorizontalPodAutoscaler", "llama-8b")]["spec"]["scaleTargetRef"]["name"] == "llama-8b"
    # each role's pods, selected by its own Service, Deployment and PodDisruptionBudget only
    prefill_labels = prefill_deployment["spec"]["template"]["metadata"]["labels"]
    decode_labels = decode_deployment["spec"]["template"]["metadata"]["labels"]
    assert prefill_labels["app.kubernetes.io/component"] == "engine-prefill"
    for kind in ("Service", "PodDisruptionBudget", "Deployment"):
        spec = children[(kind, "llama-8b-prefill")]["spec"]
        selector = spec["selector"].get("matchLabels", spec["selector"])
        assert selector.items() <= prefill_labels.items() and not selector.items() <= decode_labels.items()
        spec = children[(kind, "llama-8b-engine")]["spec"]
        selector = spec["selector"].get("matchLabels", spec["selector"])
        assert selector.items() <= decode_labels.items() and not selector.items() <= prefill_labels.items()
    assert children[("Service", "llama-8b-prefill")]["spec"]["clusterIP"] == "None"
    # both roles scraped
    assert prefill_deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    monitored = children[("PodMonitor", "llama-8b")]["spec"]["selector"]["matchExpressions"][0]["values"]
    assert set(monitored) == {"engine", "engine-prefill", "router"}
    # the router: pd over the decode Service (--k8s-service) and the prefill one
    args = container(list(children.values()), "llama-8b-router")["args"]
    assert args[args.index("--strategy") + 1] == "pd"
    assert args[args.index("--k8s-service") + 1] == "llama-8b-engine"
    assert args[args.index("--prefill-k8s-service") + 1] == "llama-8b-prefill"
    # its Role lets it watch every EndpointSlice of its namespace, the prefill Service's too
    assert children[("Role", "llama-8b-router")]["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]


def test_prefill_engines_default_to_the_decode_engines_resources() -> None:
    spec = md(model="embedded", resources={"gpus": 0, "cpu": 3, "memory": "6Gi"}, disaggregation={})
    children = render(spec)
    decode, prefill = container(children, "llama-8b-engine"), container(children, "llama-8b-prefill")
    assert prefill["resources"] == decode["resources"] == {
        "requests": {"cpu": "3", "memory": "6Gi"},
        "limits": {"memory": "6Gi"},
    }
    assert by_kind(children)[("Deployment", "llama-8b-prefill")]["spec"]["replicas"] == 1


@pytest.mark.parametrize("case", sorted(set(SPECS) - {"disaggregated"}))
def test_colocated_renders_have_no_disaggregation(case: str) -> None:
    """Without spec.disaggregation nothing of it is rendered (the other tests pin the colocated renders)."""
    children = render(SPECS[case])
    assert not any(c["metadata"]["name"].endswith("-prefill") for c in children)
    for child in children:
        text = json.dumps(child)
        assert "kv-transfer-config" not in text and "kv-side" not in text and "engine-prefill" not in text
        assert "--prefill-k8s-service" not in text and '"pd"' not in text


ONE_NODE = "disaggregation needs nodes 1"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"nodes": 2, "tensorParallelSize": 2}, ONE_NODE),
        ({"nodes": 2, "pipelineParallelSize": 2}, ONE_NODE),
        ({"resources": {"gpus": 1}}, "disaggregation needs CPU engines for now"),
        ({"disaggregation": {"prefill": {"resources": {}}}}, "disaggregation needs CPU engines for now"),
        ({"disaggregation": {"prefill": {"replicas": 0}}}, "spec.disaggregation.prefill.replicas"),
        ({"adapters": LORA_SPEC["adapters"]}, "disaggregation does not support spec.adapters yet"),
        (
            {"scaleFromZero": {}, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}},
            "disaggregation does not support spec.scaleFromZero yet",
        ),
        ({"router": {"strategy": "kv-events"}}, "router.strategy does not apply with spec.disaggregation"),
    ],
)
def test_what_disaggregation_does_not_run_with_is_refused(spec: dict[str, Any], message: str) -> None:
    """The typed spec's refusals, as the CRD's CEL rules (test_operator_crd.py) make them."""
    from pagedserve.operator.spec import format_validation_error

    bad = md(model="embedded", resources={"gpus": 0}, disaggregation={})
    bad["spec"].update(spec)
    with pytest.raises(ValidationError) as error:
        render(bad)
    assert message in format_validation_error(error.value)
    assert any(message in problem for problem in manifest_errors(bad)), manifest_errors(bad)
