"""Which replica serves which LoRA adapter, and where a request for a model may go. Pure: no I/O.

Each replica lists what it serves at ``GET /v1/models`` (vLLM's shape: the base model with
``"parent": null``, each loaded adapter with ``"parent": "<base>"``); router/discovery.py reads it in
every health poll and keeps it on the replica's ``BackendState.models``. A request's ``model`` then
decides its route (``route_for``), as in KubeAI and the vLLM production stack:

- an adapter some replica lists: only the ready replicas that list it (the balancer's bounded-load
  choice among them); none of them ready -> 503 with Retry-After (it exists: a holder is coming back or
  loading it);
- a base model name, no model, or a fleet whose lists the router does not know yet: every replica, as
  before (the engine decides);
- a name no ready replica lists, with every ready replica's list known and adapters in the fleet -> 404
  ``model_not_found`` (a fleet without adapters leaves model names to the engines, as before).

Why 404 and not 503 for an adapter the ModelDeployment names but no replica has loaded yet: the router
reads no ModelDeployment (no API access beyond its EndpointSlices), and the engine itself answers 404 for
a model it does not serve; the operator loads a new adapter on every ready replica within a reconcile
(operator/adapters.py), and the next poll makes it routable.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

MAX_MODELS = 4096  # entries read from one replica's /v1/models: a replica cannot grow the router unbounded

BASE = "base"
ADAPTER = "adapter"
NOT_LOADED = "not_loaded"  # an adapter no ready replica holds now
NOT_FOUND = "not_found"


@dataclass(frozen=True)
class ServedModels:
    """One replica's /v1/models: base names, adapter names, and the entries as listed."""

    bases: frozenset[str] = frozenset()
    adapters: frozenset[str] = frozenset()
    cards: tuple[dict[str, Any], ...] = ()


def parse_models(payload: Any) -> ServedModels | None:
    """A /v1/models body (decoded JSON) -> ServedModels; None when it is not an OpenAI model list."""
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        return None
    bases: set[str] = set()
    adapters: set[str] = set()
    cards: list[dict[str, Any]] = []
    for card in payload["data"][:MAX_MODELS]:
        if not isinstance(card, dict) or not isinstance(card.get("id"), str):
            continue
        (adapters if card.get("parent") else bases).add(card["id"])
        cards.append(card)
    return ServedModels(frozenset(bases), frozenset(adapters), tuple(cards))


def request_model(body: Any) -> str | None:
    """The ``model`` a decoded request body names, if it names one."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model else None


def body_model(raw: bytes) -> str | None:
    """``request_model`` of a raw JSON body (None when it is not JSON: the engine answers 400)."""
    try:
        return request_model(json.loads(raw))
    except (ValueError, RecursionError):
        return None


@dataclass(frozen=True)
class Route:
    """Where a request may go: ``kind`` (BASE, ADAPTER, NOT_LOADED, NOT_FOUND) and, for an adapter, the
    ready replicas that hold it."""

    kind: str
    holders: frozenset[str] = field(default_factory=frozenset)


def adapter_names(models: Iterable[ServedModels | None]) -> frozenset[str]:
    """Every adapter any replica lists."""
    return frozenset(name for m in models if m is not None for name in m.adapters)


def route_for(
    model: str | None, replicas: dict[str, tuple[bool, ServedModels | None]], base_name: str
) -> Route:
    """The route of a request naming ``model``. ``replicas``: {url: (ready, its models or None when
    unknown)}; ``base_name``: the router's --model-name (the served model name)."""
    if model is None or model == base_name:
        return Route(BASE)
    holders = {
        url for url, (_, models) in replicas.items() if models is not None and model in models.adapters
    }
    if holders:
        ready = frozenset(url for url in holders if replicas[url][0])
        return Route(ADAPTER, ready) if ready else Route(NOT_LOADED)
    ready_models = [models for ready, models in replicas.values() if ready]
    if any(models is None for models in ready_models) or not ready_models:
        return Route(BASE)  # some list is unknown: the engine decides
    if not any(models is not None and models.adapters for _, models in replicas.values()):
        return Route(BASE)  # no LoRA in the fleet: model names are the engines' business, as before
    if any(model in models.bases for models in ready_models if models is not None):
        return Route(BASE)
    return Route(NOT_FOUND)


def union_cards(models: Iterable[ServedModels | None]) -> list[dict[str, Any]]:
    """The router's own /v1/models: every replica's entries, each id once (the first listing wins)."""
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    for served in models:
        for card in served.cards if served is not None else ():
            if card["id"] not in seen:
                seen.add(card["id"])
                out.append(card)
    return out
