"""spec.adapters on running engines, without a restart: load and unload on each ready engine pod.

Each ready engine pod (Ready condition, an IP, not terminating) is asked what it serves (GET /v1/models,
the adapters are the entries with a ``parent``), then gets vLLM's POST /v1/unload_lora_adapter for each
adapter the spec no longer names (or names with another path) and POST /v1/load_lora_adapter for each
one it lacks. The pod's engine port is ``Options.engine_port`` (the engine's port, resources.py's
ENGINE_PORT; tests point it elsewhere). Calls are short-timed and run for all pods at once.

A pod that refuses a load or does not answer is reported in ``AdapterSync.failed``; reconcile.py then
takes the fallback: the startup adapter set (resources.py's STARTUP_ADAPTERS_ANNOTATION) becomes the
spec's, which changes the engine pod template, and the Deployment rolls to pods started with every
adapter (--lora-modules). The operator sends no API key: with spec.apiKeySecret the engines refuse the
calls (401) and adapter changes always take the fallback.

The pure parts (``ready_pods``, ``plan``) are separate from the HTTP (``sync_pod``, ``sync_adapters``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx

MODELS_TIMEOUT_S = 5.0
# vLLM loads synchronously (a Hugging Face id is downloaded first): an adapter of a few hundred MB.
LOAD_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class EnginePod:
    name: str
    ip: str


@dataclass
class PodAdapters:
    """What one pod serves after the sync, and what went wrong there."""

    pod: str
    adapters: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass
class AdapterSync:
    pods: list[PodAdapters] = field(default_factory=list)
    list_error: str | None = None  # the pods could not be listed: nothing was asked

    @property
    def failed(self) -> list[str]:
        return [f"{p.pod}: {error}" for p in self.pods for error in p.errors]

    def status(self) -> list[dict[str, Any]]:
        """status.adapters: per ready engine pod, the adapters it serves."""
        return [{"pod": p.pod, "adapters": sorted(p.adapters)} for p in self.pods]


def ready_pods(pods: list[dict[str, Any]]) -> list[EnginePod]:
    """The pods that serve: Ready, with an IP, not being deleted; by name."""
    out = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        if ready and status.get("podIP") and not meta.get("deletionTimestamp"):
            out.append(EnginePod(meta.get("name", ""), status["podIP"]))
    return sorted(out, key=lambda p: p.name)


def served_adapters(models: Any) -> dict[str, str]:
    """{adapter name: its root (the lora_path it was loaded from)} from a /v1/models body."""
    data = models.get("data") if isinstance(models, dict) else None
    return {
        card["id"]: str(card.get("root") or "")
        for card in data or []
        if isinstance(card, dict) and isinstance(card.get("id"), str) and card.get("parent")
    }


def plan(served: dict[str, str], desired: dict[str, str]) -> tuple[list[str], list[str]]:
    """(names to unload, names to load): unknown to the spec, or at another path, go; missing ones come."""
    changed = {name for name, path in desired.items() if name in served and served[name] != path}
    unload = sorted(name for name in served if name not in desired or name in changed)
    load = sorted(name for name in desired if name not in served or name in changed)
    return unload, load


def engine_url(pod: EnginePod, port: int) -> str:
    host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
    return f"http://{host}:{port}"


async def sync_pod(
    client: httpx.AsyncClient, pod: EnginePod, port: int, desired: dict[str, str]
) -> PodAdapters:
    """Make one engine serve exactly ``desired`` ({name: lora_path}); never raises."""
    url = engine_url(pod, port)
    result = PodAdapters(pod.name)
    try:
        response = await client.get(f"{url}/v1/models", timeout=MODELS_TIMEOUT_S)
        response.raise_for_status()
        served = served_adapters(response.json())
    except (httpx.HTTPError, ValueError) as error:
        result.errors.append(f"GET /v1/models: {error!r}")
        return result
    unload, load = plan(served, desired)
    for name in unload:
        ok = await _call(client, f"{url}/v1/unload_lora_adapter", {"lora_name": name}, (200, 404), result)
        if ok:
            served.pop(name, None)
    for name in load:
        body = {"lora_name": name, "lora_path": desired[name]}
        if await _call(client, f"{url}/v1/load_lora_adapter", body, (200,), result):
            served[name] = desired[name]
    result.adapters = sorted(served)
    return result


async def _call(
    client: httpx.AsyncClient, url: str, body: dict[str, str], ok: tuple[int, ...], result: PodAdapters
) -> bool:
    path = url[url.index("/v1/") :]
    try:
        response = await client.post(url, json=body, timeout=LOAD_TIMEOUT_S)
    except httpx.HTTPError as error:
        result.errors.append(f"{path} {body['lora_name']}: {error!r}")
        return False
    if response.status_code not in ok:
        result.errors.append(f"{path} {body['lora_name']}: {response.status_code} {response.text[:200]}")
        return False
    return True


async def sync_adapters(pods: list[dict[str, Any]], port: int, desired: dict[str, str]) -> AdapterSync:
    """Load and unload on every ready pod at once."""
    engines = ready_pods(pods)
    if not engines:
        return AdapterSync()
    async with httpx.AsyncClient(trust_env=False) as client:
        results = await asyncio.gather(*(sync_pod(client, pod, port, desired) for pod in engines))
    return AdapterSync(list(results))
