"""The chart's autoscaling on engine signals: the prometheus-adapter rule (a ConfigMap, and the values file
for the adapter's chart) that the operator's HPA reads, and KEDA ScaledObjects; off by default."""

from __future__ import annotations

import pytest
import yaml
from pagedserve.operator.spec import Autoscaling

from pagedserve.testing.helm import CHART, NAMESPACE, by_kind, find_tool, lint, one, render
from pagedserve.testing.kube import manifest_errors

pytestmark = pytest.mark.skipif(find_tool("helm") is None, reason="helm missing: run `make tools`")

ON = {
    "autoscaling": {
        "prometheusAdapter": {"enabled": True, "namespace": "monitoring"},
        "keda": {
            "enabled": True,
            "serverAddress": "http://prom.monitoring.svc:9090",
            "modelDeployments": [
                {"name": "llama", "maxReplicas": 8, "targetWaitingRequests": 2.5},
                {"name": "qwen", "namespace": "ml", "minReplicas": 0, "maxReplicas": 3},
            ],
        },
    }
}


def test_off_by_default() -> None:
    objects = render()
    assert by_kind(objects, "ScaledObject") == []
    assert [o for o in by_kind(objects, "ConfigMap") if "adapter" in o["metadata"]["name"]] == []


def test_rendered_objects_validate_strictly_and_lint_clean() -> None:
    objects = render(ON)
    problems = [p for obj in objects for p in manifest_errors(obj)]
    assert problems == [], "\n".join(problems)
    output = lint(ON)
    assert "[WARNING]" not in output and "[ERROR]" not in output, output


def test_adapter_rule_serves_the_metric_the_operators_hpa_reads() -> None:
    (config_map,) = [o for o in by_kind(render(ON), "ConfigMap") if "adapter" in o["metadata"]["name"]]
    assert config_map["metadata"]["namespace"] == "monitoring"
    (rule,) = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    assert rule["seriesQuery"].startswith("vllm:num_requests_waiting{")
    assert rule["name"]["as"] == Autoscaling.model_fields["metric_name"].default
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}  # a per-pod (Pods) metric
    # the values file for the prometheus-adapter chart holds the same rule
    values = yaml.safe_load((CHART / "files" / "prometheus-adapter-values.yaml").read_text())
    assert values["rules"]["custom"] == [rule]


def test_keda_scales_the_modeldeployment_on_waiting_requests_per_replica() -> None:
    scaled = {o["metadata"]["name"]: o for o in by_kind(render(ON), "ScaledObject")}
    llama, qwen = scaled["llama"], scaled["qwen"]
    assert llama["spec"]["scaleTargetRef"] == {
        "apiVersion": "pagedserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "name": "llama",
    }
    assert (llama["spec"]["minReplicaCount"], llama["spec"]["maxReplicaCount"]) == (1, 8)
    (trigger,) = llama["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"] == {
        "serverAddress": "http://prom.monitoring.svc:9090",
        "query": f'sum(vllm:num_requests_waiting{{namespace="{NAMESPACE}",pod=~"llama-engine-.*"}})',
        "threshold": "2.5",
    }
    # minReplicas 0 is raised to 1: the 0 <-> 1 edge belongs to spec.scaleFromZero, not to KEDA
    assert qwen["metadata"]["namespace"] == "ml" and qwen["spec"]["minReplicaCount"] == 1
    assert qwen["spec"]["triggers"][0]["metadata"]["threshold"] == "5"
    assert 'namespace="ml"' in qwen["spec"]["triggers"][0]["metadata"]["query"]


def test_sample_can_use_scale_from_zero() -> None:
    sample = {"enabled": True, "spec": {"model": "embedded", "replicas": 0, "scaleFromZero": {}}}
    md = one(render({"sample": sample}), "ModelDeployment")
    assert manifest_errors(md) == []
