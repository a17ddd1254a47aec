"""The Pod Security Standards "restricted" profile (version "latest"), as a check of pod manifests.

What a namespace labelled ``pod-security.kubernetes.io/enforce: restricted`` admits: every control of
the baseline profile plus the restricted ones, as the Kubernetes docs list them
(https://kubernetes.io/docs/concepts/security/pod-security-standards/) and the built-in admission
controller (k8s.io/pod-security-admission, policy/check_*.go) evaluates them at its newest version.
No maintained Python package implements these levels (checkov and its kin run their own CIS-style
rule sets, not the PSS profiles), so the controls are written out here, one function each.

``restricted_violations(obj)`` takes a Pod, a pod template holder (Deployment, StatefulSet, DaemonSet,
ReplicaSet, Job: ``spec.template``; CronJob: ``spec.jobTemplate.spec.template``) or a bare pod spec,
and returns one ``"<control>: <detail>"`` line per violated control; ``[]`` means admitted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

Pod = tuple[dict[str, Any], dict[str, Any]]  # (pod metadata, pod spec)

# Baseline: capabilities a container may add (the container runtime's default set).
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
        "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
    }
)  # fmt: skip
# Baseline: namespaced sysctls isolated from other pods (the 1.37 list, the newest).
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
        "net.ipv4.tcp_rmem",
        "net.ipv4.tcp_wmem",
        "net.ipv4.tcp_slow_start_after_idle",
        "net.ipv4.tcp_notsent_lowat",
    }
)
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
PROFILE_TYPES = frozenset({"RuntimeDefault", "Localhost"})  # seccomp and AppArmor
# Restricted: the only volume sources a pod may declare.
RESTRICTED_VOLUME_SOURCES = frozenset(
    {
        "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "image", "persistentVolumeClaim",
        "projected", "secret",
    }
)  # fmt: skip
APPARMOR_ANNOTATION_PREFIX = "container.apparmor.security.beta.kubernetes.io/"


# -- reading pods ----------------------------------------------------------------------------------


def pods_of(obj: dict[str, Any]) -> Iterator[Pod]:
    """The pod (metadata, spec) pairs an object declares; nothing for objects that make no pods."""
    kind = obj.get("kind")
    spec = obj.get("spec") or {}
    if kind == "Pod":
        yield obj.get("metadata") or {}, spec
    elif kind == "CronJob":
        template = ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}
        yield template.get("metadata") or {}, template.get("spec") or {}
    elif kind is None and "containers" in obj:
        yield {}, obj
    elif isinstance(spec.get("template"), dict) and "containers" in (spec["template"].get("spec") or {}):
        yield spec["template"].get("metadata") or {}, spec["template"]["spec"]


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Init, regular and ephemeral containers: every control applies to all three."""
    return [
        *spec.get("initContainers", []),
        *spec.get("containers", []),
        *spec.get("ephemeralContainers", []),
    ]


def _sc(holder: dict[str, Any]) -> dict[str, Any]:
    return holder.get("securityContext") or {}


def _names(found: list[dict[str, Any]]) -> str:
    return ", ".join(repr(c.get("name")) for c in found)


def _windows(spec: dict[str, Any]) -> bool:
    """Pods with spec.os.name=windows are exempt from the Linux-only restricted controls."""
    return (spec.get("os") or {}).get("name") == "windows"


def _user_namespace(spec: dict[str, Any]) -> bool:
    """hostUsers: false puts the pod in a user namespace: root in it is not root on the node."""
    return spec.get("hostUsers") is False


# -- baseline --------------------------------------------------------------------------------------


def host_process(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    holders = [spec, *containers(spec)]
    if any((_sc(h).get("windowsOptions") or {}).get("hostProcess") is True for h in holders):
        return "windowsOptions.hostProcess must not be true"
    return None


def host_namespaces(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    shared = [field for field in ("hostNetwork", "hostPID", "hostIPC") if spec.get(field) is True]
    return f"{', '.join(shared)} must not be true" if shared else None


def privileged(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    bad = [c for c in containers(spec) if _sc(c).get("privileged") is True]
    return f"containers {_names(bad)} must not set privileged=true" if bad else None


def baseline_capabilities(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    added = {cap for c in containers(spec) for cap in (_sc(c).get("capabilities") or {}).get("add") or []}
    extra = sorted(added - BASELINE_CAPABILITIES)
    return f"capabilities {extra} must not be added" if extra else None


def host_path_volumes(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    bad = [v.get("name") for v in spec.get("volumes") or [] if "hostPath" in v]
    return f"volumes {bad} must not be hostPath" if bad else None


def host_ports(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    ports = sorted(p["hostPort"] for c in containers(spec) for p in c.get("ports") or [] if p.get("hostPort"))
    return f"hostPorts {ports} must not be set" if ports else None


def host_probes_and_lifecycle(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    hosts = set()
    for c in containers(spec):
        handlers = [c.get(p) or {} for p in ("livenessProbe", "readinessProbe", "startupProbe")]
        handlers += [(c.get("lifecycle") or {}).get(h) or {} for h in ("postStart", "preStop")]
        for handler in handlers:
            for action in ("httpGet", "tcpSocket"):
                if (handler.get(action) or {}).get("host"):
                    hosts.add(handler[action]["host"])
    return f"probe or lifecycle hosts {sorted(hosts)} must not be set" if hosts else None


def apparmor(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    bad = [
        profile["type"]
        for h in [spec, *containers(spec)]
        if (profile := _sc(h).get("appArmorProfile")) and profile.get("type") not in PROFILE_TYPES
    ]
    bad += [
        f"{key}={value}"
        for key, value in (meta.get("annotations") or {}).items()
        if key.startswith(APPARMOR_ANNOTATION_PREFIX)
        and value
        and value != "runtime/default"
        and not value.startswith("localhost/")
    ]
    return f"AppArmor profiles {bad} are forbidden" if bad else None


def selinux(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    problems = set()
    for h in [spec, *containers(spec)]:
        options = _sc(h).get("seLinuxOptions")
        if options is None:
            continue
        if options.get("type", "") not in SELINUX_TYPES:
            problems.add(f"type {options['type']!r}")
        problems.update(f"{field} may not be set" for field in ("user", "role") if options.get(field))
    return f"seLinuxOptions: {', '.join(sorted(problems))}" if problems else None


def baseline_proc_mount(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    bad = [c for c in containers(spec) if _sc(c).get("procMount", "Default") != "Default"]
    return f"containers {_names(bad)} must not set procMount other than Default" if bad else None


def baseline_seccomp(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    """The securityContext fields only: the seccomp annotations stopped counting in Kubernetes 1.19."""
    bad = [
        profile.get("type")
        for h in [spec, *containers(spec)]
        if (profile := _sc(h).get("seccompProfile")) and profile.get("type") not in PROFILE_TYPES
    ]
    return f"seccomp profiles {bad} are forbidden" if bad else None


def sysctls(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    bad = [s.get("name") for s in _sc(spec).get("sysctls") or [] if s.get("name") not in SAFE_SYSCTLS]
    return f"sysctls {bad} are forbidden" if bad else None


# -- restricted ------------------------------------------------------------------------------------


def volume_types(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    bad = [
        f"{v.get('name')} ({', '.join(sorted(set(v) - {'name'}))})"
        for v in spec.get("volumes") or []
        # A volume with no source is defaulted to emptyDir by the API server.
        if not set(v) - {"name"} <= RESTRICTED_VOLUME_SOURCES
    ]
    return f"volumes {bad} use a forbidden type" if bad else None


def privilege_escalation(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    if _windows(spec):
        return None
    bad = [c for c in containers(spec) if _sc(c).get("allowPrivilegeEscalation") is not False]
    return f"containers {_names(bad)} must set allowPrivilegeEscalation=false" if bad else None


def run_as_non_root(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    if _user_namespace(spec):
        return None
    pod_value = _sc(spec).get("runAsNonRoot")
    if pod_value is False:
        return "the pod must not set runAsNonRoot=false"
    bad = [
        c
        for c in containers(spec)
        if _sc(c).get("runAsNonRoot") is False
        or (_sc(c).get("runAsNonRoot") is None and pod_value is not True)
    ]
    return f"pod or containers {_names(bad)} must set runAsNonRoot=true" if bad else None


def run_as_user(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    if _user_namespace(spec):
        return None
    holders = [("pod", spec), *((f"container {c.get('name')!r}", c) for c in containers(spec))]
    bad = [label for label, h in holders if _sc(h).get("runAsUser") == 0]
    return f"{', '.join(bad)} must not set runAsUser=0" if bad else None


def restricted_seccomp(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    if _windows(spec):
        return None
    pod_profile = (_sc(spec).get("seccompProfile") or {}).get("type")
    if pod_profile is not None and pod_profile not in PROFILE_TYPES:
        return f"the pod's seccompProfile.type {pod_profile!r} is forbidden"
    # A container without its own profile inherits the pod's; one that sets it must set a good one.
    bad = [
        c
        for c in containers(spec)
        if ((profile := _sc(c).get("seccompProfile")) is None and pod_profile is None)
        or (profile is not None and profile.get("type") not in PROFILE_TYPES)
    ]
    if not bad:
        return None
    return f'pod or containers {_names(bad)} must set seccompProfile.type "RuntimeDefault" or "Localhost"'


def restricted_capabilities(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    if _windows(spec):
        return None
    problems = []
    for c in containers(spec):
        caps = _sc(c).get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append(f"container {c.get('name')!r} must drop ALL")
        extra = sorted(set(caps.get("add") or []) - {"NET_BIND_SERVICE"})
        if extra:
            problems.append(f"container {c.get('name')!r} must not add {extra}")
    return "; ".join(problems) or None


def restricted_proc_mount(meta: dict[str, Any], spec: dict[str, Any]) -> str | None:
    """Restricted keeps the default /proc masks even in a user namespace (baseline relaxes there)."""
    return baseline_proc_mount(meta, spec)


Control = Callable[[dict[str, Any], dict[str, Any]], "str | None"]

# Baseline controls, by the names the Kubernetes docs give them. In the restricted profile the volume
# types (hostPath included), seccomp, capabilities and /proc mount controls below replace their
# baseline versions (they are strictly stronger), as in the admission controller.
BASELINE: dict[str, Control] = {
    "HostProcess": host_process,
    "Host Namespaces": host_namespaces,
    "Privileged Containers": privileged,
    "Capabilities": baseline_capabilities,
    "HostPath Volumes": host_path_volumes,
    "Host Ports": host_ports,
    "Host Probes / Lifecycle Hooks": host_probes_and_lifecycle,
    "AppArmor": apparmor,
    "SELinux": selinux,
    "/proc Mount Type": baseline_proc_mount,
    "Seccomp": baseline_seccomp,
    "Sysctls": sysctls,
}
RESTRICTED: dict[str, Control] = {
    **{name: check for name, check in BASELINE.items() if name != "HostPath Volumes"},
    "Volume Types": volume_types,
    "Privilege Escalation": privilege_escalation,
    "Running as Non-root": run_as_non_root,
    "Running as Non-root user": run_as_user,
    "Seccomp": restricted_seccomp,
    "Capabilities": restricted_capabilities,
    "/proc Mount Type": restricted_proc_mount,
}


def violations(obj: dict[str, Any], controls: dict[str, Control]) -> list[str]:
    """``"<control>: <detail>"`` for every control that a pod of ``obj`` violates."""
    found = []
    for meta, spec in pods_of(obj):
        for name, check in controls.items():
            detail = check(meta, spec)
            if detail:
                found.append(f"{name}: {detail}")
    return found


def restricted_violations(obj: dict[str, Any]) -> list[str]:
    return violations(obj, RESTRICTED)


def baseline_violations(obj: dict[str, Any]) -> list[str]:
    return violations(obj, BASELINE)
