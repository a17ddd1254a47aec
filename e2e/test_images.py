"""The images `make images` builds, run as their pods run them (`make image-test`).

The operator renders a CPU ModelDeployment of the embedded model (pagedserve/testing/pods.py); its engine
and router containers run under podman (runc) as the manifests say: the image the operator names by
default, the command, args and env, the pod's user and group, a read-only root filesystem with no other
writable place than the volumes the pod mounts (an emptyDir: a fresh folder here owned by the fsGroup;
a memory emptyDir: a tmpfs of its sizeLimit), all capabilities dropped, no privilege escalation. The
network is the host's, and only its loopback is used (the listen addresses are 127.0.0.1).

- the CPU server image answers through the router in the control image (``DEMO_ANSWER``) and runs the C++
  kernels (/version says backend "cpu", which falls back to "torch" where they cannot build);
- the control image has no torch and starts the operator far enough to show its imports and entry point
  (up to kopf's login, which fails without a cluster);
- every image's size is printed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes.utils.quantity import parse_quantity
from pagedserve.operator.resources import DEFAULT_CPU_IMAGE, DEFAULT_IMAGE, DEFAULT_ROUTER_IMAGE

from pagedserve.testing import pods
from pagedserve.testing.net import free_port
from pagedserve.testing.processes import DEMO_ANSWER, ManagedProcess, ServerProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.environ.get("PAGEDSERVE_IMAGE_TEST"), reason="`make image-test` runs it, after `make images`"
    ),
]
# crun, podman's default runtime, refuses the cgroup layout of the machines this runs on.
PODMAN = ["podman", "--runtime", "runc"]
IMAGES = (DEFAULT_IMAGE, DEFAULT_CPU_IMAGE, DEFAULT_ROUTER_IMAGE)
NAME_PREFIX = "pagedserve-image-test"


@pytest.fixture(scope="module", autouse=True)
def images_present() -> None:
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed: `make image-tools` installs it (as root)", pytrace=False)
    missing = [tag for tag in IMAGES if subprocess.run([*PODMAN, "image", "exists", tag]).returncode != 0]
    if missing:
        pytest.fail(f"no image {', '.join(missing)}: run `make images` first", pytrace=False)


def podman_run(pod: dict[str, Any], argv: list[str], workdir: Path) -> list[str]:
    """`podman run` of the rendered container's image as in its pod, running ``argv`` (its first word as
    the entry point)."""
    container, security = pod["container"], pod["securityContext"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    uid, gid, fs_group = security["runAsUser"], security["runAsGroup"], security["fsGroup"]
    name = f"{NAME_PREFIX}-{container['name']}-{os.getpid()}"
    run = [*PODMAN, "run", "--rm", "--name", name, "--network", "host", "--user", f"{uid}:{gid}"]
    # --read-only-tmpfs=false: podman would otherwise mount writable tmpfs on /tmp, /var/tmp and /run.
    run += ["--read-only", "--read-only-tmpfs=false", "--group-add", str(fs_group)]
    run += ["--cap-drop", "all", "--security-opt", "no-new-privileges"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    for mount in container["volumeMounts"]:
        empty_dir = volumes[mount["name"]]["emptyDir"]  # the only kind the CPU pods mount
        if empty_dir.get("medium") == "Memory":
            size = int(parse_quantity(empty_dir["sizeLimit"]))
            run += ["--mount", f"type=tmpfs,destination={mount['mountPath']},tmpfs-size={size}"]
        else:
            folder = workdir / f"{container['name']}-{mount['name']}"
            folder.mkdir()
            os.chown(folder, uid, fs_group)  # fsGroup makes a pod's volumes its group's
            folder.chmod(0o2775)
            run += ["-v", f"{folder}:{mount['mountPath']}"]
    for item in container["env"]:
        run += ["-e", f"{item['name']}={pods.env_value(item)}"]
    return [*run, "--entrypoint", argv[0], container["image"], *argv[1:]]


@pytest.fixture(autouse=True)
def remove_containers() -> Iterator[None]:
    """A `podman run` killed before its container stopped leaves the container behind."""
    yield
    names = [f"{NAME_PREFIX}-{name}-{os.getpid()}" for name in ("engine", "router")]
    subprocess.run([*PODMAN, "rm", "--force", "--ignore", *names], capture_output=True, timeout=120)


def image_size(tag: str) -> str:
    inspect = [*PODMAN, "image", "inspect", "--format", "{{.Size}}", tag]
    size = subprocess.run(inspect, capture_output=True, text=True, check=True).stdout
    return f"{int(size) / 2**20:.0f} MiB"


def test_image_sizes() -> None:
    for tag in IMAGES:
        print(f"\nimage {tag}: {image_size(tag)}")


def test_server_answers_through_the_router(tmp_path: Path, processes: list[ManagedProcess]) -> None:
    found = pods.containers()
    engine, router = found["engine"]["container"], found["router"]["container"]
    assert (engine["image"], router["image"]) == (DEFAULT_CPU_IMAGE, DEFAULT_ROUTER_IMAGE)
    engine_port, router_port = free_port(), free_port()
    engine_args, router_args = pods.loopback_args(engine, router, engine_port, router_port)

    for name, args, port, ready in (
        ("engine", engine_args, engine_port, "/health"),
        ("router", router_args, router_port, "/ready"),
    ):
        argv = podman_run(found[name], [*found[name]["container"]["command"], *args], tmp_path)
        proc = ServerProcess(argv=argv, log_path=tmp_path / f"{name}.log", port=port, ready_path=ready)
        processes.append(proc.start())
    processes[0].wait_ready(600)
    processes[1].wait_ready(120)

    version = httpx.get(f"http://127.0.0.1:{engine_port}/version", timeout=30).json()
    assert version["backend"] == "cpu", (version, processes[0].log_tail())
    answer = pods.ask_demo_question(f"http://127.0.0.1:{router_port}/v1")
    print(f"\n{DEFAULT_CPU_IMAGE} through {DEFAULT_ROUTER_IMAGE}: {answer!r} (backend {version['backend']})")
    assert DEMO_ANSWER in answer, answer


def test_control_image_has_no_torch(tmp_path: Path) -> None:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
    argv = podman_run(pods.containers()["router"], ["python", "-c", probe], tmp_path)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_control_image_starts_the_operator(tmp_path: Path, processes: list[ManagedProcess]) -> None:
    """`pagedserve operator` imports everything it runs with, then asks kopf to log in: without a cluster
    that fails, which shows the entry point and the imports work."""
    argv = podman_run(pods.containers()["router"], ["pagedserve", "operator"], tmp_path)
    proc = ManagedProcess(argv=argv, log_path=tmp_path / "operator.log")
    processes.append(proc.start())
    deadline = time.monotonic() + 120
    while "LoginError" not in proc.log_text() and proc.running and time.monotonic() < deadline:
        time.sleep(1)
    log = proc.log_text()
    assert "LoginError: Cannot authenticate" in log, log[-4000:]
    assert "Traceback" not in log.split("LoginError")[0].split("kopf")[0], log[-4000:]
