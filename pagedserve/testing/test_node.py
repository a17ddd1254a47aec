"""A test node for the real control plane (pagedserve/testing/controlplane.py): scheduler and kubelet in
one small loop, running each pod's container as a local process.

What a kubelet would do, it does through the real API: it registers a Node, binds unscheduled pods to
it (the scheduler's Binding), gives each pod an address of its own, starts the container's command
and args with its env (Secret and field references resolved from the API, emptyDir volumes as
folders), hands the pod its ServiceAccount's credentials when the pod mounts them (a token from the
TokenRequest API, in a kubeconfig: the process talks to the API server as that ServiceAccount, so RBAC
applies), runs the readiness probe and reports status; a container that exits is restarted, a pod
being deleted is stopped and then removed.

Pod addresses: the API server refuses loopback addresses (127.0.0.0/8) in EndpointSlices, so each pod
gets an address from a /24 of ``POD_NETWORK_PREFIX``, added to this machine's loopback device for its
lifetime (root only). A pod's process binds it where its args say 0.0.0.0, as a process in a pod's own network
namespace would; packets to it never leave this machine.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import logging
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from pagedserve.testing.controlplane import ControlPlane
from pagedserve.testing.processes import CHILD_ENV_DEFAULTS, ManagedProcess, container_program

logger = logging.getLogger(__name__)

# RFC 2544's benchmarking range 198.18.0.0/15: routed nowhere; each node takes a /24 of it that no
# address on this machine is in yet, so two runs side by side (CI beside a developer's) never share one.
POD_NETWORK_PREFIX = "198.18."
FIRST_HOST, LAST_HOST = 2, 254
IMAGE_ENTRYPOINT = ["pagedserve"]  # every pagedserve image's ENTRYPOINT (Dockerfile)
SYNC_INTERVAL_S = 0.5
RESTART_BACKOFF_S = 1.0


def available() -> str | None:
    """None where pods can get addresses here, else why not."""
    if os.geteuid() != 0:
        return "the test node adds pod addresses to the loopback device, which needs root"
    if shutil.which("ip") is None:
        return "the test node needs iproute2's `ip`"
    return None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PodRun:
    """One pod this node runs: its address, its container process, what it last reported."""

    namespace: str
    name: str
    uid: str
    ip: str
    container: dict[str, Any]
    process: ManagedProcess
    started_at: str
    restarts: int = 0
    ready: bool = False
    exited_at: float | None = None
    held: bool = False  # not restarted after it exits (a container in a long back-off)
    reported: tuple | None = None


@dataclass
class TestNode:
    plane: ControlPlane
    workdir: Path
    name: str = "e2e-node"
    pods: dict[str, PodRun] = field(default_factory=dict)  # by pod uid
    _free_hosts: list[int] = field(default_factory=lambda: list(range(FIRST_HOST, LAST_HOST + 1)))
    _subnet: str = ""  # "198.18.N.", chosen at start
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _log: logging.Handler | None = None

    def start(self) -> TestNode:
        self._subnet = _unused_subnet()
        # what the node did and what went wrong, beside the pods' own logs (a kubelet's journal)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._log = logging.FileHandler(self.workdir / "node.log")
        self._log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(self._log)
        logger.setLevel(logging.INFO)
        api_client = config.new_client_from_config(config_file=str(self.plane.admin_kubeconfig))
        self.core = client.CoreV1Api(api_client)
        self._register()
        self._thread = threading.Thread(target=self._loop, name="test-node", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        with self._lock:
            for run in list(self.pods.values()):
                self._end(run)
        if self._log is not None:
            logger.removeHandler(self._log)
            self._log.close()

    # --- the loop ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    self._sync()
            except Exception:  # the API server restarting, a pod deleted mid-sync: next round
                logger.exception("test node sync failed")
            self._stop.wait(SYNC_INTERVAL_S)

    def _sync(self) -> None:
        listed = self.core.list_pod_for_all_namespaces().items
        seen = set()
        for pod in listed:
            if pod.spec.node_name == self.name:
                seen.add(pod.metadata.uid)
            try:  # one pod's trouble (a missing Secret, a failed token) must not stall the others
                if not pod.spec.node_name:
                    self._bind(pod)
                elif pod.spec.node_name == self.name:
                    self._sync_pod(pod)
            except Exception:
                logger.exception("test node: pod %s/%s", pod.metadata.namespace, pod.metadata.name)
        for uid in set(self.pods) - seen:  # force-deleted: nothing left to report to
            self._end(self.pods[uid])

    def _sync_pod(self, pod: Any) -> None:
        run = self.pods.get(pod.metadata.uid)
        if pod.metadata.deletion_timestamp is not None:
            if run is not None:
                self._end(run)
            self._delete(pod)
            return
        if run is None:
            if pod.status.phase in ("Succeeded", "Failed"):
                return
            run = self._start_pod(pod)
            if run is None:
                return
        self._tend(run)
        self._report(run)

    # --- scheduling and registration --------------------------------------------------------------

    def _register(self) -> None:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": {"kubernetes.io/hostname": self.name}},
        }
        self.core.create_node(node)
        status = {
            "status": {
                "conditions": [
                    {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test node"}
                ],
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                "capacity": {"cpu": "64", "memory": "256Gi", "pods": "250"},
                "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "250"},
            }
        }
        self.core.patch_node_status(self.name, status)

    def _bind(self, pod: Any) -> None:
        body = client.V1Binding(
            metadata=client.V1ObjectMeta(name=pod.metadata.name),
            target=client.V1ObjectReference(kind="Node", name=self.name, api_version="v1"),
        )
        with contextlib.suppress(ApiException):  # bound meanwhile, or deleted
            # _preload_content=False: the client cannot decode the Status this call returns
            self.core.create_namespaced_binding(pod.metadata.namespace, body, _preload_content=False)

    # --- one pod ----------------------------------------------------------------------------------

    def _start_pod(self, pod: Any) -> PodRun | None:
        manifest = self.core.api_client.sanitize_for_serialization(pod)
        container = manifest["spec"]["containers"][0]
        ip = self._take_address()
        folder = self.workdir / f"{pod.metadata.namespace}_{pod.metadata.name}"
        folder.mkdir(parents=True, exist_ok=True)
        try:
            env = self._env(manifest, container, ip, folder)
        except ApiException as error:  # a missing Secret: the kubelet's CreateContainerConfigError
            logger.warning("pod %s: %s", pod.metadata.name, error.reason)
            self._release_address(ip)
            return None
        command = container.get("command") or IMAGE_ENTRYPOINT
        argv = [container_program(command[0]), *command[1:]]
        argv += [a.replace("0.0.0.0", ip) for a in container.get("args", [])]
        process = ManagedProcess(
            argv=argv, log_path=folder / "container.log", env=env, cwd=folder, stop_timeout_s=20
        )
        run = PodRun(
            namespace=pod.metadata.namespace,
            name=pod.metadata.name,
            uid=pod.metadata.uid,
            ip=ip,
            container=container,
            process=process.start(),
            started_at=_now(),
        )
        self.pods[run.uid] = run
        logger.info("started %s/%s at %s: %s", run.namespace, run.name, ip, " ".join(argv))
        return run

    def _env(self, pod: dict, container: dict, ip: str, folder: Path) -> dict[str, str]:
        base = {k: os.environ[k] for k in ("PATH", "LANG") if k in os.environ}
        env = {**base, **CHILD_ENV_DEFAULTS}
        mounts = self._mount_folders(container, folder)
        for item in container.get("env", []):
            value = self._env_value(pod, item, ip)
            owner = max((m for m in mounts if f"{value}/".startswith(f"{m}/")), key=len, default=None)
            env[item["name"]] = str(mounts[owner] / value[len(owner) :].lstrip("/")) if owner else value
        if pod["spec"].get("automountServiceAccountToken", True):
            env["KUBECONFIG"] = str(self._credentials(pod, folder))
        return env

    def _mount_folders(self, container: dict, folder: Path) -> dict[str, Path]:
        """Each volume mount's path -> a folder of this pod's (emptyDir-like: new with the pod)."""
        mounts = {}
        for mount in container.get("volumeMounts", []):
            local = folder / "volumes" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            mounts[mount["mountPath"]] = local
        return mounts

    def _env_value(self, pod: dict, item: dict, ip: str) -> str:
        source = item.get("valueFrom")
        if source is None:
            return str(item.get("value", ""))
        if ref := source.get("secretKeyRef"):
            secret = self.core.read_namespaced_secret(ref["name"], pod["metadata"]["namespace"])
            return base64.b64decode(secret.data[ref["key"]]).decode()
        if ref := source.get("configMapKeyRef"):
            return self.core.read_namespaced_config_map(ref["name"], pod["metadata"]["namespace"]).data[
                ref["key"]
            ]
        path = source["fieldRef"]["fieldPath"]
        fields = {
            "metadata.name": pod["metadata"]["name"],
            "metadata.namespace": pod["metadata"]["namespace"],
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
            "spec.nodeName": self.name,
            "status.podIP": ip,
        }
        return fields[path]

    def _credentials(self, pod: dict, folder: Path) -> Path:
        """A kubeconfig with a token of the pod's ServiceAccount, bound to the pod (TokenRequest)."""
        meta = pod["metadata"]
        token = self.plane.kubectl(
            "create",
            "token",
            pod["spec"].get("serviceAccountName", "default"),
            "-n",
            meta["namespace"],
            "--bound-object-kind=Pod",
            f"--bound-object-name={meta['name']}",
            f"--bound-object-uid={meta['uid']}",
            "--duration=2h",
        ).stdout.strip()
        return self.plane.write_kubeconfig(
            folder / "serviceaccount.kubeconfig", token=token, namespace=meta["namespace"]
        )

    def _tend(self, run: PodRun) -> None:
        """Restart an exited container (restartPolicy Always, after a back-off); probe readiness."""
        if not run.process.running:
            run.ready = False
            if run.held:
                return
            if run.exited_at is None:
                run.exited_at = time.monotonic()
            elif time.monotonic() - run.exited_at >= RESTART_BACKOFF_S:
                run.restarts += 1
                run.exited_at = None
                run.started_at = _now()
                run.process.start()
            return
        run.ready = self._probe(run)

    def _probe(self, run: PodRun) -> bool:
        probe = run.container.get("readinessProbe")
        if probe is None:
            return True
        get = probe["httpGet"]
        port = get["port"]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in run.container.get("ports", []) if p.get("name") == port)
        try:
            return httpx.get(f"http://{run.ip}:{port}{get.get('path', '/')}", timeout=1.0).status_code < 400
        except httpx.HTTPError:
            return False

    def _report(self, run: PodRun) -> None:
        state = (run.ready, run.restarts, run.process.running)
        if state == run.reported:
            return
        ready = "True" if run.ready else "False"
        running = {"running": {"startedAt": run.started_at}}
        terminated = {"terminated": {"exitCode": 137, "reason": "Error", "finishedAt": _now()}}
        status = {
            "phase": "Running",
            "hostIP": "127.0.0.1",
            "podIP": run.ip,
            "podIPs": [{"ip": run.ip}],
            "startTime": run.started_at,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": ready},
                {"type": "Ready", "status": ready},
            ],
            "containerStatuses": [
                {
                    "name": run.container["name"],
                    "image": run.container.get("image", ""),
                    "imageID": "",
                    "containerID": f"local://{run.process.pid}",
                    "ready": run.ready,
                    "started": run.process.running,
                    "restartCount": run.restarts,
                    "state": running if run.process.running else terminated,
                }
            ],
        }
        with contextlib.suppress(ApiException):  # deleted meanwhile
            self.core.patch_namespaced_pod_status(run.name, run.namespace, {"status": status})
            run.reported = state

    def _end(self, run: PodRun) -> None:
        logger.info("stopping %s/%s", run.namespace, run.name)
        run.process.stop()
        self.pods.pop(run.uid, None)
        self._release_address(run.ip)

    def _delete(self, pod: Any) -> None:
        """The kubelet's last word on a pod being deleted: its containers are gone, remove it now."""
        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_pod(
                pod.metadata.name,
                pod.metadata.namespace,
                # in the body: with a body, the API server reads the options from it alone
                body=client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=client.V1Preconditions(uid=pod.metadata.uid)
                ),
            )

    # --- addresses --------------------------------------------------------------------------------

    def _take_address(self) -> str:
        ip = f"{self._subnet}{self._free_hosts.pop(0)}"
        subprocess.run(["ip", "addr", "replace", f"{ip}/32", "dev", "lo"], check=True)
        return ip

    def _release_address(self, ip: str) -> None:
        subprocess.run(["ip", "addr", "del", f"{ip}/32", "dev", "lo"], capture_output=True)
        self._free_hosts.append(int(ip.rsplit(".", 1)[1]))

    # --- what tests do to pods ----------------------------------------------------------------------

    def run_of(self, namespace: str, name: str) -> PodRun:
        with self._lock:
            return next(r for r in self.pods.values() if (r.namespace, r.name) == (namespace, name))

    def kill(self, namespace: str, name: str, restart: bool = True) -> None:
        """SIGKILL a pod's container (a crash); the node restarts it as a kubelet would, unless
        ``restart`` is False (as if it were in a long crash-loop back-off)."""
        run = self.run_of(namespace, name)
        run.held = not restart
        run.process.kill()


def _unused_subnet() -> str:
    shown = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    for third in range(256):
        subnet = f"{POD_NETWORK_PREFIX}{third}."
        if f" {subnet}" not in shown:
            return subnet
    raise RuntimeError(f"no free /24 left in {POD_NETWORK_PREFIX}0.0/16")


