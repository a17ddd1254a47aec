"""The images `make images` builds, run as their pods run them (`make image-test`).

The operator renders a CPU ModelDeployment of the embedded model (pagedserve/testing/pods.py); its engine
and router containers run under podman (runc) as the manifests say: the image the operator names by
default, the command, args and env, the pod's user and group, a read-only root filesystem with no other
writable place than the volumes the pod mounts (an emptyDir: a fresh folder here owned by the fsGroup;
a memory emptyDir: a tmpfs of its sizeLimit), all capabilities dropped, no privilege escalation. The
network is the host's, and only its loopback is used (the listen addresses are 127.0.0.1).

- the CPU server image answers through the router in the control image (``DEMO_ANSWER``) and runs the C++
  kernels built into it (/version says backend "cpu" and prebuilt kernels) and the embedded model
  converted into it (no conversion in the engine's log);
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

import httpx
import pytest
from pagedserve.operator.resources import DEFAULT_CPU_IMAGE, DEFAULT_IMAGE, DEFAULT_ROUTER_IMAGE

from pagedserve.testing import pods
from pagedserve.testing.images import NAME_PREFIX, PODMAN, podman_run
from pagedserve.testing.net import free_port
from pagedserve.testing.processes import DEMO_ANSWER, ManagedProcess, ServerProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.environ.get("PAGEDSERVE_IMAGE_TEST"), reason="`make image-test` runs it, after `make images`"
    ),
]
IMAGES = (DEFAULT_IMAGE, DEFAULT_CPU_IMAGE, DEFAULT_ROUTER_IMAGE)


@pytest.fixture(scope="module", autouse=True)
def images_present() -> None:
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed: `make image-tools` installs it (as root)", pytrace=False)
    missing = [tag for tag in IMAGES if subprocess.run([*PODMAN, "image", "exists", tag]).returncode != 0]
    if missing:
        pytest.fail(f"no image {', '.join(missing)}: run `make images` first", pytrace=False)


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
    # The image carries what a start would build: the kernels (prebuilt) and the converted model.
    assert version["cpu_kernels"]["origin"] == "prebuilt", version
    assert "Converting" not in processes[0].log_text(), processes[0].log_tail()
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
