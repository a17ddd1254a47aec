"""The restricted Pod Security Standard checker: a compliant pod passes, each control reports violations."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from pagedserve.testing.pod_security import (
    BASELINE,
    RESTRICTED,
    baseline_violations,
    pods_of,
    restricted_violations,
)


def compliant_pod() -> dict[str, Any]:
    """What the restricted profile asks for, and everything it allows."""
    locked = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
        "readOnlyRootFilesystem": True,
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "annotations": {"container.apparmor.security.beta.kubernetes.io/app": ""}},
        "spec": {
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 10001,
                "seccompProfile": {"type": "RuntimeDefault"},
                "sysctls": [{"name": "net.ipv4.tcp_keepalive_time", "value": "60"}],
                "seLinuxOptions": {"type": "container_t"},
                "appArmorProfile": {"type": "RuntimeDefault"},
            },
            "initContainers": [{"name": "init", "image": "x", "securityContext": copy.deepcopy(locked)}],
            "containers": [
                {
                    "name": "app",
                    "image": "x",
                    "ports": [{"containerPort": 8000}],
                    "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}},
                    "securityContext": {**copy.deepcopy(locked), "procMount": "Default"},
                }
            ],
            "volumes": [
                {"name": "tmp", "emptyDir": {}},
                {"name": "cache", "persistentVolumeClaim": {"claimName": "c"}},
                {"name": "cfg", "configMap": {"name": "c"}},
                {"name": "token", "projected": {"sources": []}},
                {"name": "s", "secret": {"secretName": "s"}},
                {"name": "d", "downwardAPI": {"items": []}},
                {"name": "e", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}},
                {"name": "c", "csi": {"driver": "d"}},
            ],
        },
    }


def test_a_compliant_pod_passes() -> None:
    assert restricted_violations(compliant_pod()) == []


def _app(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["spec"]["containers"][0]


def _init(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["spec"]["initContainers"][0]


# (the control's name, a change that violates it)
VIOLATIONS: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("HostProcess", lambda p: p["spec"]["securityContext"].update(windowsOptions={"hostProcess": True})),
    ("HostProcess", lambda p: _app(p)["securityContext"].update(windowsOptions={"hostProcess": True})),
    ("Host Namespaces", lambda p: p["spec"].update(hostNetwork=True)),
    ("Host Namespaces", lambda p: p["spec"].update(hostPID=True)),
    ("Host Namespaces", lambda p: p["spec"].update(hostIPC=True)),
    ("Privileged Containers", lambda p: _init(p)["securityContext"].update(privileged=True)),
    ("Capabilities", lambda p: _app(p)["securityContext"]["capabilities"].update(add=["SYS_ADMIN"])),
    ("Capabilities", lambda p: _app(p)["securityContext"]["capabilities"].update(add=["CHOWN"])),
    ("Capabilities", lambda p: _app(p)["securityContext"]["capabilities"].update(drop=["NET_RAW"])),
    ("Capabilities", lambda p: _init(p)["securityContext"].pop("capabilities")),
    ("Volume Types", lambda p: p["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}})),
    (
        "Volume Types",
        lambda p: p["spec"]["volumes"].append({"name": "n", "nfs": {"server": "s", "path": "/"}}),
    ),
    ("Volume Types", lambda p: p["spec"]["volumes"].append({"name": "g", "gitRepo": {"repository": "r"}})),
    ("Host Ports", lambda p: _app(p)["ports"][0].update(hostPort=80)),
    ("Host Probes / Lifecycle Hooks", lambda p: _app(p)["readinessProbe"]["httpGet"].update(host="10.0.0.1")),
    (
        "Host Probes / Lifecycle Hooks",
        lambda p: _app(p).update(lifecycle={"preStop": {"tcpSocket": {"port": 1, "host": "metadata"}}}),
    ),
    ("AppArmor", lambda p: p["spec"]["securityContext"].update(appArmorProfile={"type": "Unconfined"})),
    ("AppArmor", lambda p: _app(p)["securityContext"].update(appArmorProfile={"type": "Unconfined"})),
    (
        "AppArmor",
        lambda p: p["metadata"]["annotations"].update(
            {"container.apparmor.security.beta.kubernetes.io/app": "unconfined"}
        ),
    ),
    ("SELinux", lambda p: p["spec"]["securityContext"].update(seLinuxOptions={"type": "spc_t"})),
    ("SELinux", lambda p: _app(p)["securityContext"].update(seLinuxOptions={"user": "system_u"})),
    ("SELinux", lambda p: _init(p)["securityContext"].update(seLinuxOptions={"role": "sysadm_r"})),
    ("/proc Mount Type", lambda p: _app(p)["securityContext"].update(procMount="Unmasked")),
    ("Seccomp", lambda p: p["spec"]["securityContext"].update(seccompProfile={"type": "Unconfined"})),
    ("Seccomp", lambda p: _app(p)["securityContext"].update(seccompProfile={"type": "Unconfined"})),
    ("Seccomp", lambda p: p["spec"]["securityContext"].pop("seccompProfile")),
    (
        "Sysctls",
        lambda p: p["spec"]["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
    ),
    ("Privilege Escalation", lambda p: _app(p)["securityContext"].pop("allowPrivilegeEscalation")),
    ("Privilege Escalation", lambda p: _init(p)["securityContext"].update(allowPrivilegeEscalation=True)),
    ("Running as Non-root", lambda p: p["spec"]["securityContext"].pop("runAsNonRoot")),
    ("Running as Non-root", lambda p: p["spec"]["securityContext"].update(runAsNonRoot=False)),
    ("Running as Non-root", lambda p: _app(p)["securityContext"].update(runAsNonRoot=False)),
    ("Running as Non-root user", lambda p: p["spec"]["securityContext"].update(runAsUser=0)),
    ("Running as Non-root user", lambda p: _init(p)["securityContext"].update(runAsUser=0)),
]


@pytest.mark.parametrize(("control", "change"), VIOLATIONS)
def test_each_control_reports_its_violation(control: str, change: Callable[[dict[str, Any]], None]) -> None:
    pod = compliant_pod()
    change(pod)
    found = restricted_violations(pod)
    assert [v.split(":")[0] for v in found] == [control], found


def test_every_control_of_the_profile_is_exercised() -> None:
    assert {control for control, _ in VIOLATIONS} == set(RESTRICTED)
    assert set(BASELINE) - set(RESTRICTED) == {"HostPath Volumes"}  # "Volume Types" covers hostPath


def test_ephemeral_containers_count_too() -> None:
    pod = compliant_pod()
    pod["spec"]["ephemeralContainers"] = [{"name": "debug", "image": "busybox"}]
    found = {v.split(":")[0] for v in restricted_violations(pod)}
    assert found == {"Privilege Escalation", "Capabilities"}


def test_what_the_profile_allows() -> None:
    # runAsNonRoot and seccomp on every container instead of the pod
    pod = compliant_pod()
    del pod["spec"]["securityContext"]["runAsNonRoot"], pod["spec"]["securityContext"]["seccompProfile"]
    for container in (_app(pod), _init(pod)):
        container["securityContext"].update(runAsNonRoot=True, seccompProfile={"type": "Localhost"})
    assert restricted_violations(pod) == []
    # a user namespace (hostUsers: false) relaxes the non-root controls
    pod = compliant_pod()
    pod["spec"]["hostUsers"] = False
    pod["spec"]["securityContext"].update(runAsNonRoot=False, runAsUser=0)
    assert restricted_violations(pod) == []
    # Windows pods are exempt from the Linux-only controls
    pod = compliant_pod()
    pod["spec"]["os"] = {"name": "windows"}
    for container in (_app(pod), _init(pod)):
        del (
            container["securityContext"]["allowPrivilegeEscalation"],
            container["securityContext"]["capabilities"],
        )
    assert restricted_violations(pod) == []


def test_baseline_is_weaker() -> None:
    pod = compliant_pod()
    del pod["spec"]["securityContext"]
    _app(pod)["securityContext"] = {"capabilities": {"add": ["CHOWN"]}}
    assert baseline_violations(pod) == []
    assert restricted_violations(pod)
    pod["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}})
    assert [v.split(":")[0] for v in baseline_violations(pod)] == ["HostPath Volumes"]


def test_pods_of_workloads() -> None:
    pod = compliant_pod()
    template = {"metadata": pod["metadata"], "spec": pod["spec"]}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "spec": {"template": template}}
    cron = {"kind": "CronJob", "spec": {"jobTemplate": {"spec": {"template": template}}}}
    for obj in (pod, deployment, cron, pod["spec"]):
        assert [spec for _, spec in pods_of(obj)] == [pod["spec"]]
    assert list(pods_of({"kind": "Service", "spec": {"ports": []}})) == []
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["hostPID"] = True
    assert restricted_violations(broken) == ["Host Namespaces: hostPID must not be true"]
