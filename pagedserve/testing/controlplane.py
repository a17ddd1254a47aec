"""A real Kubernetes control plane on 127.0.0.1 for the e2e tests, started the way controller-runtime's
envtest starts one: etcd, kube-apiserver and kube-controller-manager from ``KUBEBUILDER_ASSETS``.

The binaries are found by pagedserve/testing/kube_assets.py. Each run gets new certificates
(pagedserve/testing/certs.py), free ports and a data folder of its own; every process is a
``ManagedProcess`` stopped by its own process group. There is no scheduler and no kubelet: the test node
(pagedserve/testing/test_node.py) binds pods and runs their containers as local processes.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagedserve.testing import certs
from pagedserve.testing.kube_assets import KubeAssets
from pagedserve.testing.net import free_port, wait_until
from pagedserve.testing.processes import ManagedProcess

SERVICE_RANGE = "10.0.0.0/24"
SERVICE_IP = "10.0.0.1"  # the `kubernetes` Service: the first address of SERVICE_RANGE
START_TIMEOUT_S = 120.0
# Controllers a cluster without kubelets can run: nodelifecycle would mark the test node unhealthy (it
# posts no heartbeats) and taint-evict its pods; the rest are what scenarios rely on (deployment,
# replicaset, garbagecollector, endpointslice, serviceaccount, namespace, horizontalpodautoscaling...).
CONTROLLERS = "*,-nodelifecycle"


@dataclass
class ControlPlane:
    assets: KubeAssets
    workdir: Path
    processes: list[ManagedProcess] = field(default_factory=list)
    url: str = ""
    certs: certs.ClusterCerts | None = None

    @property
    def admin_kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    def start(self) -> ControlPlane:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.certs = certs.generate(self.workdir / "pki", SERVICE_IP)
        etcd_url = self._start_etcd()
        port = free_port()
        self.url = f"https://127.0.0.1:{port}"
        self._start_apiserver(etcd_url, port)
        self.write_kubeconfig(
            self.admin_kubeconfig, client_cert=self.certs.admin.cert, client_key=self.certs.admin.key
        )
        self._wait_ready()
        manager = self.workdir / "controller-manager.kubeconfig"
        self.write_kubeconfig(
            manager,
            client_cert=self.certs.controller_manager.cert,
            client_key=self.certs.controller_manager.key,
        )
        self._start_controller_manager(manager)
        # Pods are admitted only once their namespace's default ServiceAccount exists (the
        # serviceaccount controller makes it): until then every pod create is refused.
        wait_until(
            lambda: self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0,
            60,
            "the default ServiceAccount",
        )
        return self

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()

    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(argv=argv, log_path=self.workdir / f"{name}.log", stop_timeout_s=10)
        self.processes.append(proc.start())
        return proc

    def _start_etcd(self) -> str:
        client, peer = free_port(), free_port()
        url = f"http://127.0.0.1:{client}"
        proc = self._spawn(
            "etcd",
            [
                str(self.assets.etcd),
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={url}",
                f"--advertise-client-urls={url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",  # a throwaway store: durability costs seconds on this disk
            ],
        )
        wait_until(lambda: _healthy(f"{url}/health", proc), 30, "etcd healthy")
        return url

    def _start_apiserver(self, etcd_url: str, port: int) -> None:
        assert self.certs is not None
        c = self.certs
        self._spawn(
            "kube-apiserver",
            [
                str(self.assets.kube_apiserver),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                f"--tls-cert-file={c.serving.cert}",
                f"--tls-private-key-file={c.serving.key}",
                f"--client-ca-file={c.ca.cert}",
                f"--service-cluster-ip-range={SERVICE_RANGE}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={c.service_account_key}",
                f"--service-account-signing-key-file={c.service_account_key}",
                "--authorization-mode=RBAC",
                "--allow-privileged=false",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                "--profiling=false",
            ],
        )

    def _start_controller_manager(self, kubeconfig: Path) -> None:
        assert self.certs is not None
        self._spawn(
            "kube-controller-manager",
            [
                str(self.assets.kube_controller_manager),
                f"--kubeconfig={kubeconfig}",
                f"--controllers={CONTROLLERS}",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={self.certs.service_account_key}",
                f"--root-ca-file={self.certs.ca.cert}",
                "--secure-port=0",
                # GC and Deployments react at once rather than after the default resyncs
                "--concurrent-gc-syncs=5",
            ],
        )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for proc in self.processes:
                proc.check_alive()
            if self.kubectl("get", "--raw", "/readyz", check=False).returncode == 0:
                return
            time.sleep(0.5)
        raise TimeoutError(
            f"kube-apiserver not ready in {START_TIMEOUT_S} s:\n{self.processes[-1].log_tail()}"
        )

    def write_kubeconfig(
        self,
        path: Path,
        *,
        token: str | None = None,
        client_cert: Path | None = None,
        client_key: Path | None = None,
        namespace: str = "default",
    ) -> Path:
        """A kubeconfig for this API server: a token (a ServiceAccount's) or a client certificate."""
        assert self.certs is not None
        user: dict[str, str] = (
            {"token": token}
            if token
            else {
                "client-certificate": str(client_cert),
                "client-key": str(client_key),
            }
        )
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "e2e",
                    "cluster": {"server": self.url, "certificate-authority": str(self.certs.ca.cert)},
                }
            ],
            "users": [{"name": "e2e", "user": user}],
            "contexts": [
                {"name": "e2e", "context": {"cluster": "e2e", "user": "e2e", "namespace": namespace}}
            ],
            "current-context": "e2e",
        }
        path.write_text(json.dumps(config))
        path.chmod(0o600)
        return path

    def kubectl(
        self, *args: str, check: bool = True, stdin: str | None = None, kubeconfig: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.assets.kubectl), f"--kubeconfig={kubeconfig or self.admin_kubeconfig}", *args]
        result = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120)
        if check and result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
        return result

    def kubectl_json(self, *args: str) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def version(self) -> str:
        info = json.loads(self.kubectl("get", "--raw", "/version").stdout)
        return str(info["gitVersion"])

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600) -> str:
        """A token of ServiceAccount ``name`` from the TokenRequest API, as a kubelet projects one."""
        result = self.kubectl("create", "token", name, "-n", namespace, f"--duration={seconds}s")
        return result.stdout.strip()


def _healthy(url: str, proc: ManagedProcess) -> bool:
    proc.check_alive()
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
