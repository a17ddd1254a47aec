"""The Helm chart: lint, render with default and non-default values, strict schema validation."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from pagedserve.testing.helm import CHART, NAMESPACE, REPO, by_kind, find_tool, helm, lint, one, render
from pagedserve.testing.kube import manifest_errors

pytestmark = pytest.mark.skipif(find_tool("helm") is None, reason="helm missing: run `make tools`")

ALL_ON = {
    "monitoring": {
        "serviceMonitor": {"enabled": True},
        "podMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
    },
    "sample": {"enabled": True},
}
NON_DEFAULT = {
    "fullnameOverride": "llm-operator",
    "commonLabels": {"team": "ml-platform"},
    "operator": {
        "replicas": 2,
        "peering": "pagedserve",
        "image": {
            "repository": "registry.internal/ml/pagedserve-control",
            "tag": "9.9.9",
            "pullPolicy": "Always",
        },
        "imagePullSecrets": [{"name": "regcred"}],
        "watchNamespaces": ["ml", "ml-staging"],
        "verbose": True,
        "policy": {"allowSecretEnv": True, "allowedImagePrefixes": ["registry.internal/ml/", "ghcr.io/x/"]},
        "extraArgs": ["--resync-seconds=30"],
        "env": [{"name": "EXTRA", "value": "1"}],
        "defaults": {
            "engineImage": "registry.internal/ml/pagedserve:9.9.9",
            "engineCpuImage": "registry.internal/ml/pagedserve:9.9.9-cpu",
            "routerImage": "r/x:1",
        },
        "resources": {"requests": {"cpu": 1, "memory": "256Mi"}},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}
                    ]
                }
            }
        },
        "podAnnotations": {"example.com/a": "b"},
        "podLabels": {"tier": "control"},
        "priorityClassName": "system-cluster-critical",
    },
    "serviceAccount": {"name": "custom-sa", "annotations": {"iam.example.com/role": "x"}},
    "monitoring": {
        "labels": {"release": "kube-prometheus-stack"},
        "namespaces": ["ml"],
        "interval": "30s",
        "serviceMonitor": {"enabled": True},
        "podMonitor": {"enabled": True},
        "prometheusRule": {
            "enabled": True,
            "additionalAlertLabels": {"team": "ml"},
            "alerts": {"ttftHigh": {"p95Seconds": 5, "for": "15m", "severity": "critical"}},
        },
    },
    "dashboards": {"namespace": "monitoring", "annotations": {"grafana_folder": "LLM"}},
    "sample": {
        "enabled": True,
        "name": "demo",
        "spec": {"model": "Qwen/Qwen2.5-0.5B-Instruct", "replicas": 3},
    },
}

# kopf names a replica in its peering object by this (charts/pagedserve/templates/deployment.yaml)
POD_ID_ENV = {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
CASES = {"default": None, "all-on": ALL_ON, "non-default": NON_DEFAULT}


@pytest.fixture(scope="module", params=list(CASES))
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(CASES[request.param])


@pytest.mark.parametrize("case", list(CASES))
def test_helm_lint_has_no_warnings(case: str) -> None:
    output = lint(CASES[case])
    assert "[WARNING]" not in output and "[ERROR]" not in output, output


def test_every_object_validates_strictly(rendered) -> None:
    """Strict, for the oldest and the newest Kubernetes minor we support (pagedserve/testing/kube.py)."""
    _, objects = rendered
    problems = [problem for obj in objects for problem in manifest_errors(obj)]
    assert not problems, "\n".join(problems)


def test_objects_are_namespaced_in_the_release_namespace(rendered) -> None:
    case, objects = rendered
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
    for obj in objects:
        ns = obj["metadata"].get("namespace")
        if obj["kind"] in cluster_scoped:
            assert ns is None, obj["kind"]
        elif obj["kind"] == "ConfigMap" and case == "non-default":
            assert ns == "monitoring"
        elif obj["kind"] == "KopfPeering":  # one in each watched namespace: the operators meet there
            assert ns in ("ml", "ml-staging"), ns
        else:
            assert ns == NAMESPACE, f"{obj['kind']}/{obj['metadata']['name']}"


def test_default_render_has_the_operator_and_dashboards_only(rendered) -> None:
    case, objects = rendered
    kinds = sorted(o["kind"] for o in objects if o["kind"] != "CustomResourceDefinition")
    if case == "default":
        assert kinds == sorted(
            ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "ConfigMap", "ConfigMap"]
        )
    else:
        for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule", "ModelDeployment"):
            assert len(by_kind(objects, kind)) == 1, kind


def test_operator_deployment_follows_values() -> None:
    objects = render(NON_DEFAULT)
    deployment = one(objects, "Deployment")
    assert deployment["metadata"]["name"] == "llm-operator"
    assert deployment["metadata"]["labels"]["team"] == "ml-platform"
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"]["tier"] == "control"
    assert pod["metadata"]["annotations"] == {"example.com/a": "b"}
    spec = pod["spec"]
    assert spec["serviceAccountName"] == "custom-sa"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["priorityClassName"] == "system-cluster-critical"
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    (container,) = spec["containers"]
    assert container["image"] == "registry.internal/ml/pagedserve-control:9.9.9"
    assert container["imagePullPolicy"] == "Always"
    assert container["args"] == [
        "operator",
        "--liveness=http://0.0.0.0:8080/healthz",
        "--namespace=ml",
        "--namespace=ml-staging",
        "--peering=pagedserve",
        "--default-image=registry.internal/ml/pagedserve:9.9.9",
        "--default-cpu-image=registry.internal/ml/pagedserve:9.9.9-cpu",
        "--default-router-image=r/x:1",
        "--allow-secret-env",
        "--allowed-image-prefix=registry.internal/ml/",
        "--allowed-image-prefix=ghcr.io/x/",
        "--verbose",
        "--resync-seconds=30",
    ]
    assert container["env"] == [POD_ID_ENV, {"name": "EXTRA", "value": "1"}]
    binding = one(objects, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "custom-sa", "namespace": NAMESPACE}]
    assert one(objects, "ServiceAccount")["metadata"]["annotations"] == {"iam.example.com/role": "x"}


def test_default_operator_args() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    (container,) = one(render(), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"pagedserve/pagedserve-control:{chart['appVersion']}"
    # All namespaces, standalone, the operator's own engine image default, routers on the operator's image.
    assert container["args"] == [
        "operator",
        "--liveness=http://0.0.0.0:8080/healthz",
        f"--default-router-image={container['image']}",
    ]
    assert container["env"] == [POD_ID_ENV]


@pytest.mark.parametrize("case", list(CASES))
def test_operator_args_are_the_operators_flags(case: str) -> None:
    """`pagedserve operator` accepts the arguments the chart renders."""
    main = pytest.importorskip("pagedserve.operator.main")
    parser = argparse.ArgumentParser(prog="pagedserve operator")
    main.add_arguments(parser)
    (container,) = one(render(CASES[case]), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["args"][0] == "operator"
    parser.parse_args(container["args"][1:])  # exits (SystemExit) on an unknown flag


def test_several_replicas_need_peering() -> None:
    result = helm("template", "x", str(CHART), "--set", "operator.replicas=2", check=False)
    assert result.returncode != 0 and "operator.peering" in result.stderr


def test_operator_pod_is_locked_down() -> None:
    spec = one(render(), "Deployment")["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    (container,) = spec["containers"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    # The read-only root filesystem needs a writable /tmp (HOME and caches point there).
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert "limits" in container["resources"] and "requests" in container["resources"]


def test_toggles_remove_objects() -> None:
    objects = render(
        {"rbac": {"create": False}, "serviceAccount": {"create": False}, "dashboards": {"enabled": False}},
        include_crds=False,
    )
    assert [o["kind"] for o in objects] == ["Deployment"]
    spec = objects[0]["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "default"


def test_cluster_role_is_least_privilege() -> None:
    role = one(render(), "ClusterRole")
    assert role["rules"], "the ClusterRole has no rules"
    for rule in role["rules"]:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule.get(key, []), f"wildcard in {key}: {rule}"
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
        assert "nonResourceURLs" not in rule, rule
        # Secrets are referenced by name in the pods the operator creates; it never reads them.
        assert "secrets" not in rule["resources"] or set(rule["verbs"]) <= {"get", "list", "watch"}, rule
    modeldeployments = [r for r in role["rules"] if "modeldeployments" in r["resources"]]
    assert modeldeployments and {"get", "list", "watch"} <= set(modeldeployments[0]["verbs"])


def test_monitors_scrape_metrics_with_the_dashboard_labels() -> None:
    objects = render(NON_DEFAULT)
    endpoints = [
        one(objects, "ServiceMonitor")["spec"]["endpoints"][0],
        one(objects, "PodMonitor")["spec"]["podMetricsEndpoints"][0],
    ]
    for endpoint in endpoints:
        assert endpoint["path"] == "/metrics" and endpoint["interval"] == "30s"
        targets = {r["targetLabel"] for r in endpoint["relabelings"]}
        # The router dashboard and the alerts group by these.
        assert {"modeldeployment", "component", "pod"} <= targets
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        obj = one(objects, kind)
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert one(objects, "PodMonitor")["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}
    assert one(render(ALL_ON), "PodMonitor")["spec"]["namespaceSelector"] == {"any": True}


def test_prometheus_rule_covers_the_required_alerts() -> None:
    rule = one(render(NON_DEFAULT), "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) >= {
        "PagedserveQueueBuildingUp",
        "PagedserveKVCacheNearFull",
        "PagedserveTTFTHigh",
        "PagedserveReplicaDown",
        "PagedserveRouterBackendErrors",
    }
    for alert in alerts.values():
        assert alert["labels"]["team"] == "ml"
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]
        assert "{{ $labels." in alert["annotations"]["description"]  # Helm left Prometheus' templates alone
    ttft = alerts["PagedserveTTFTHigh"]
    assert (
        ttft["expr"].rstrip().endswith("> 5")
        and ttft["for"] == "15m"
        and ttft["labels"]["severity"] == "critical"
    )


def test_dashboards_are_configmaps_for_the_grafana_sidecar() -> None:
    objects = render(NON_DEFAULT)
    maps = by_kind(objects, "ConfigMap")
    files = sorted((CHART / "dashboards").glob("*.json"))
    assert len(maps) == len(files) == 2
    uids = set()
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
        ((filename, text),) = cm["data"].items()
        assert json.loads(text) == json.loads((CHART / "dashboards" / filename).read_text())
        uids.add(json.loads(text)["uid"])
    assert len(uids) == 2


def test_sample_model_deployment_follows_values() -> None:
    sample = one(render(NON_DEFAULT), "ModelDeployment")
    assert sample["metadata"]["name"] == "demo"
    assert sample["spec"]["model"] == "Qwen/Qwen2.5-0.5B-Instruct" and sample["spec"]["replicas"] == 3


def test_values_keys_users_rely_on() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert isinstance(values["operator"]["replicas"], int)
    assert set(values["operator"]["image"]) >= {"repository", "tag", "pullPolicy"}
    for key in ("serviceMonitor", "podMonitor", "prometheusRule"):
        assert isinstance(values["monitoring"][key]["enabled"], bool)
    assert isinstance(values["dashboards"]["enabled"], bool)


def test_values_are_documented() -> None:
    """Every key of values.yaml has a comment above it, except sections (keys whose children all carry
    their own comments) and the content of a documented key (example data such as resources)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    undocumented = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "-")) or ":" not in stripped:
            continue
        indent = len(line) - len(stripped)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        documented = i > 0 and lines[i - 1].strip().startswith("#")
        inside_documented = any(doc for _, doc in stack)
        is_section = (
            stripped.endswith(":") and i + 1 < len(lines) and lines[i + 1].startswith(" " * (indent + 1))
        )
        if not (documented or inside_documented or is_section):
            undocumented.append(f"values.yaml:{i + 1}: {stripped}")
        stack.append((indent, documented))
    assert not undocumented, "\n".join(undocumented)


def test_chart_crd_is_the_generated_crd() -> None:
    """charts/pagedserve/crds/ holds what `make manifests` writes (crds/ holds the same file)."""
    from pagedserve.operator.manifests import generated

    copy = CHART / "crds" / "modeldeployment.yaml"
    assert copy.read_text() == generated()["charts/pagedserve/crds/modeldeployment.yaml"], (
        "charts/pagedserve/crds/modeldeployment.yaml is out of date: run `make manifests`"
    )
    crds = {c["spec"]["names"]["kind"]: c for c in by_kind(render(), "CustomResourceDefinition")}
    # kopf's peering kinds ship beside it (crds/kopf-peering.yaml) for operator.replicas > 1
    assert set(crds) == {"ModelDeployment", "KopfPeering", "ClusterKopfPeering"}
    assert crds["ModelDeployment"]["spec"]["group"] == "pagedserve.io"


def test_several_operator_replicas_get_their_peering_object() -> None:
    objects = render({"operator": {"replicas": 2, "peering": "ps-peers"}})
    assert [p["metadata"]["name"] for p in by_kind(objects, "ClusterKopfPeering")] == ["ps-peers"]
    args = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--peering=ps-peers" in args
    assert not by_kind(render(), "ClusterKopfPeering")  # one replica: standalone, no object


def test_chart_rbac_is_the_operators() -> None:
    from pagedserve.operator.manifests import RBAC_FILE, generated
    from pagedserve.operator.rbac import RULES

    assert (REPO / RBAC_FILE).read_text() == generated()[RBAC_FILE], (
        f"{RBAC_FILE} is out of date: run `make manifests`"
    )
    source_rules = RULES
    assert one(render(), "ClusterRole")["rules"] == source_rules
    # Several replicas add what kopf's peering needs, and nothing else.
    peering_rules = one(render(NON_DEFAULT), "ClusterRole")["rules"]
    assert peering_rules[: len(source_rules)] == source_rules
    assert [r["apiGroups"] for r in peering_rules[len(source_rules) :]] == [["kopf.dev"]]
