"""A CPU ModelDeployment of the embedded model as the operator renders it, to run its pods on one machine.

e2e/test_local_e2e.py runs the rendered engine and router containers as local processes, and
e2e/test_images.py runs them in the images under podman. Only the addresses may differ from what the
cluster would run (``ADDRESS_FLAGS``): the engine listens on the loopback and the router, instead of
discovering engines through the Kubernetes API, is given the engine's address.
"""

from __future__ import annotations

from typing import Any

from pagedserve.operator import render
from pagedserve.testing.processes import DEMO_QUESTION

NAME, NAMESPACE, API_KEY = "e2e", "default", "e2e-secret-key"
# The Secrets the ModelDeployment refers to: (name, key) -> value.
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
    """Container name -> {"container", "volumes", "securityContext" (the pod's)} of each Deployment."""
    found = {}
    for child in render(MODELDEPLOYMENT):
        if child["kind"] == "Deployment":
            pod = child["spec"]["template"]["spec"]
            (container,) = pod["containers"]
            found[container["name"]] = {
                "container": container,
                "volumes": pod["volumes"],
                "securityContext": pod.get("securityContext", {}),
            }
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


def loopback_args(
    engine: dict[str, Any], router: dict[str, Any], engine_port: int, router_port: int
) -> tuple[list[str], list[str]]:
    """The engine's and the router's args on this machine's loopback, the router pointed at the engine."""
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
    return engine_args, router_args


def env_value(item: dict[str, Any]) -> str:
    """One env entry's value: a literal, or the Secret it refers to (from ``SECRETS``)."""
    if "valueFrom" in item:
        ref = item["valueFrom"]["secretKeyRef"]
        return SECRETS[(ref["name"], ref["key"])]
    return item["value"]


def ask_demo_question(base_url: str) -> str:
    """The answer of the served model (through the OpenAI client) to the question every e2e test asks
    (``DEMO_QUESTION``; it holds ``DEMO_ANSWER``)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=API_KEY, timeout=120, max_retries=0)
    reply = client.chat.completions.create(
        model=NAME,  # servedModelName defaults to the ModelDeployment's name
        messages=[{"role": "user", "content": DEMO_QUESTION}],
        temperature=0,
        max_tokens=32,
    )
    return reply.choices[0].message.content or ""
