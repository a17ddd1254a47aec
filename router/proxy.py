"""The router's HTTP front: a lean ASGI app (served by uvicorn) that proxies every ``/v1/*`` route (and
vLLM's pooling routes outside it: common/routing.py ``POOLING_PATHS``).

Per request: read the body; for ``/v1/chat/completions`` and ``/v1/completions`` under ``prefix-hash``
or ``kv-events``, hash the prompt's blocks (and, under ``kv-events``, match its token ids against the
blocks each engine reports holding: router/kv_events.py, router/kv_index.py); pick a replica
(``Balancer.choose``); forward method, path, query, body and headers (Authorization included;
hop-by-hop headers dropped) over a keep-alive pool per replica (``upstream.py``); pass the response
through chunk by chunk as it arrives (no buffering, no re-encoding).

Retries: until the first byte of a response body has been sent to the client, a replica that refuses the
connection, drops it, or answers 503 is replaced by the next choice (at most ``max_retries`` times, never
the same replica twice). The response is committed (status and headers sent) only once the first body
chunk has arrived, so a replica that dies during prefill is retried too. After that, a failing replica
ends the stream: with an OpenAI-style error event for ``text/event-stream``, else by closing the
connection.

A client that goes away, at any stage after its body arrived, cancels the forwarding, which closes the
upstream connection: the replica aborts the request (``RouterApp.proxy``). A client that leaves while
sending its body is never forwarded. A replica's answer is remembered for prefix affinity only when it is a
success (2xx): a refused or failed request cached nothing there.

LoRA adapters (router/adapters.py): each replica's /v1/models, read in its health poll, says which
adapters it serves. A request whose ``model`` is an adapter goes only to the ready replicas that list it
(the same balancer, its load bound taken among them), its prefix hashes rooted at the adapter as the
engine roots them; no ready holder is a 503 with Retry-After, a model no replica serves a 404
``model_not_found``. ``GET /v1/models`` answers the union of the replicas' lists.

Prefill/decode disaggregation (``--strategy pd``, router/pd.py): two pools of replicas, each discovered and
health-checked as above: the prefill engines (``--prefill-backend`` / ``--prefill-k8s-service``, a
prefix-hash balancer of their own, ``PrefillPool``) and the decode engines (``--backend`` /
``--k8s-service``, least load). A completion P/D fits is first sent, cut to one unstreamed token, to a
prefill engine (``RouterApp._prefill``: no retry, a timeout of its own); the ``kv_transfer_params`` of its
answer are spliced into the client's body, which then takes the path above to a decode engine, retries,
streaming and cancellation included. A prefill step that fails sends the body as it came (a colocated
run on a decode engine, counted by reason); a prefill 4xx is the client's answer. Everything else goes to
the decode pool as it would to any pool.

While no replica is ready, requests can be held until one is (``--max-held-requests``; a full queue or a
timeout gets 503 with Retry-After), and the engines woken from zero (``--scale-from-zero``):
router/activator.py.

The router's own errors use the engine server's OpenAI error JSON (common/errors.py), so a client
sees one error shape whether the router or a replica refused it.
Other routes: ``/health`` (the router's liveness, 200), ``/ready`` (503 until a replica is ready, unless
the router can still hold requests),
``/metrics`` (``pagedserve_router_*``), ``/backends`` (JSON: each replica's state and role, for operators),
``/openapi.json`` (router/openapi.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from pagedserve.common.disconnect import ClientDisconnected, run_unless_disconnected
from pagedserve.common.errors import error_json_bytes as error_json
from pagedserve.common.routing import POOLING_PATHS, instance_of_response
from pagedserve.router import pd
from pagedserve.router.activator import Activator, HeldRequestRefused
from pagedserve.router.adapters import (
    ADAPTER,
    BASE,
    NOT_FOUND,
    NOT_LOADED,
    Route,
    request_model,
    route_for,
    union_cards,
)
from pagedserve.router.balancer import Balancer, Decision
from pagedserve.router.discovery import EndpointSliceDiscovery, HealthMonitor, StaticDiscovery
from pagedserve.router.hashing import DEFAULT_SEGMENT_CACHE_BYTES, PromptHasher
from pagedserve.router.kv_events import KVEventSubscriptions
from pagedserve.router.kv_index import KVIndex
from pagedserve.router.metrics import RouterMetrics
from pagedserve.router.openapi import openapi_json
from pagedserve.router.upstream import (
    UpstreamConnectError,
    UpstreamDisconnect,
    UpstreamError,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeout,
)

logger = logging.getLogger(__name__)

HASHED_PATHS = ("/v1/chat/completions", "/v1/completions")
HASHED_STRATEGIES = ("prefix-hash", "kv-events", pd.PD)  # pd: the prefill engine's choice
PD_PREFILL_STRATEGY = "prefix-hash"  # shared prefixes meet the same prefill engine's cache
PD_DECODE_STRATEGY = "least-load"  # the decode engine holds no prefix of its own worth chasing

_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_DROP_REQUEST = _HOP_BY_HOP | {b"host", b"content-length", b"expect"}
_DROP_RESPONSE = _HOP_BY_HOP

_TOKENIZE_INLINE_MAX = 64 * 1024  # request bodies above this are tokenized in a worker thread
ADAPTER_RETRY_AFTER_S = 5  # an adapter no ready replica holds: about a health poll or two, or a pod start

# (balancer, on_change) -> an object with `async start()` and `async stop()` that keeps the balancer's
# replicas up to date and calls on_change after each change (router/discovery.py).
DiscoveryFactory = Callable[[Balancer, Callable[[], None]], Any]


@dataclass
class RouterConfig:
    backends: list[str] = field(default_factory=list)
    k8s_service: str | None = None
    namespace: str = "default"
    target_port: int = 8000
    tokenizer: str | None = None
    model_name: str = ""
    trust_request_chat_template: bool = False
    block_size: int = 16
    segment_cache_bytes: int = DEFAULT_SEGMENT_CACHE_BYTES
    strategy: str = "prefix-hash"
    mean_load_factor: float = 1.25
    min_load_cap: float = 4.0
    index_capacity: int = 100_000
    virtual_nodes: int = 160
    hash_key_blocks: int = 4
    max_retries: int = 3
    api_key: str | None = None
    health_interval: float = 1.0
    health_timeout: float = 5.0
    unhealthy_after: int = 3
    connect_timeout: float = 5.0
    read_timeout: float | None = None
    max_keepalive_connections: int = 200
    keepalive_expiry: float = 4.0  # below uvicorn's default keep-alive (5 s) of the engines
    # Scale from zero (router/activator.py): hold requests while no replica is ready (0: answer 503 at
    # once), and wake this ModelDeployment (in `namespace`) through its scale subresource.
    max_held_requests: int = 0
    held_request_timeout: float = 300.0
    scale_from_zero: str | None = None
    activity_interval: float = 10.0
    engine_api_key: str | None = None  # the engines' --api-key, for their KV event streams
    # --strategy pd (router/pd.py): the prefill engines, found as the others are; backends / k8s_service
    # are then the decode engines. prefill_timeout: seconds the prefill step waits for its engine's bytes.
    prefill_backends: list[str] = field(default_factory=list)
    prefill_k8s_service: str | None = None
    prefill_timeout: float = 120.0

    def validate(self) -> None:
        if not self.backends and not self.k8s_service:
            raise ValueError("give at least one --backend, or --k8s-service")
        if self.backends and self.k8s_service:
            raise ValueError("--backend and --k8s-service are exclusive")
        if self.block_size <= 0:
            raise ValueError("--block-size must be positive")
        if self.segment_cache_bytes < 0:
            raise ValueError("--tokenizer-cache-mib must be >= 0")
        if self.mean_load_factor < 1.0:
            raise ValueError("--mean-load-factor must be >= 1.0")
        if self.min_load_cap < 0:
            raise ValueError("--min-load-cap must be >= 0")
        if self.max_retries < 0:
            raise ValueError("--max-retries must be >= 0")
        if self.index_capacity <= 0:
            raise ValueError("--index-capacity must be positive")
        if self.hash_key_blocks < 1:
            raise ValueError("--hash-key-blocks must be >= 1")
        self._validate_scale_from_zero()
        self._validate_pd()

    def _validate_scale_from_zero(self) -> None:
        if self.max_held_requests < 0:
            raise ValueError("--max-held-requests must be >= 0")
        if self.held_request_timeout <= 0:
            raise ValueError("--held-request-timeout must be positive")
        if self.activity_interval <= 0:
            raise ValueError("--activity-interval must be positive")
        if self.scale_from_zero and self.max_held_requests == 0:
            raise ValueError("--scale-from-zero needs --max-held-requests > 0 (requests wait for the wake)")

    def _validate_pd(self) -> None:
        has_prefill = bool(self.prefill_backends or self.prefill_k8s_service)
        if self.strategy == pd.PD and not has_prefill:
            raise ValueError(
                "--strategy pd needs the prefill engines: --prefill-backend URL or --prefill-k8s-service "
                "NAME (--backend / --k8s-service name the decode engines)"
            )
        if has_prefill and self.strategy != pd.PD:
            raise ValueError("--prefill-backend and --prefill-k8s-service need --strategy pd")
        if self.prefill_backends and self.prefill_k8s_service:
            raise ValueError("--prefill-backend and --prefill-k8s-service are exclusive")
        if self.prefill_timeout <= 0:
            raise ValueError("--prefill-timeout must be positive")


CLIENT_DISCONNECT = "client_disconnect"  # the status label of a request whose client went away


@dataclass
class PromptKey:
    """What routing reads from a request body: its model, and its prompt's block hashes (salted with its
    LoRA adapter) and kv-events matches when it has a prompt to hash."""

    model: str | None = None
    hashes: list[int] = field(default_factory=list)
    kv_matches: dict[str, int] | None = None
    request: Any = None  # the parsed body (None: not JSON), for --strategy pd


@dataclass
class PrefillPool:
    """--strategy pd's prefill engines: a balancer of their own, found (router/discovery.py) and checked
    as the decode engines are."""

    balancer: Balancer
    monitor: HealthMonitor | None = None
    discovery: Any = None
    known: set[str] = field(default_factory=set)  # as of the last discovery change


@dataclass
class PrefillResult:
    """How the prefill step of a P/D request ended (RouterApp._prefill)."""

    params: dict[str, Any] | None = None  # the decode step's kv_transfer_params
    fallback: str | None = None  # why the request runs colocated instead (router/pd.py FALLBACK_REASONS)
    answered: bool = False  # the prefill engine's 4xx went to the client as it was


@dataclass
class Exchange:
    """A request being forwarded, as proxy() needs to see it whatever stage it ends at."""

    backend: str = "none"  # the replica tried last ("none": no replica was tried)
    outcome: str = "error"  # the status label of pagedserve_router_requests_total
    tried: set[str] = field(default_factory=set)
    prefill: str | None = None  # --strategy pd: the prefill replica tried


async def _read_body(receive) -> bytes | None:
    """The whole request body; None if the client disconnected before sending all of it."""
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


async def _send_simple(
    send,
    status: int,
    body: bytes,
    content_type: bytes = b"application/json",
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _send_held_refusal(send, refusal: HeldRequestRefused) -> None:
    """503 with Retry-After: no replica is ready and the request cannot wait (any longer) for one."""
    retry_after = ((b"retry-after", str(refusal.retry_after).encode()),)
    await _send_simple(send, 503, error_json(str(refusal), 503), headers=retry_after)


class RouterApp:
    """The ASGI application. ``balancer``, ``metrics`` and ``monitor`` are exposed for tests."""

    def __init__(
        self,
        config: RouterConfig,
        hasher: PromptHasher | None = None,
        discovery: DiscoveryFactory | None = None,
    ) -> None:
        """``discovery``: builds the discovery from the balancer and the change callback (default: from
        the config, static backends or EndpointSlices)."""
        config.validate()
        self.config = config
        disaggregated = config.strategy == pd.PD
        # Under --strategy pd: the decode engines; the prefill engines have a pool of their own.
        self.balancer = self._make_balancer(PD_DECODE_STRATEGY if disaggregated else config.strategy)
        self.prefill = PrefillPool(self._make_balancer(PD_PREFILL_STRATEGY)) if disaggregated else None
        self.metrics = RouterMetrics()
        self.activator = self._make_activator()
        if hasher is None and config.strategy in HASHED_STRATEGIES:
            try:
                hasher = PromptHasher(
                    config.tokenizer,
                    config.model_name,
                    config.block_size,
                    config.segment_cache_bytes,
                    trust_request_chat_template=config.trust_request_chat_template,
                )
            except Exception as exc:
                # Routing must go on: prompt bytes stand in for tokens (prefix affinity still works).
                logger.error(
                    "could not load tokenizer %r (%s); hashing prompt bytes instead of tokens",
                    config.tokenizer,
                    exc,
                )
                hasher = PromptHasher(None, config.model_name, config.block_size)
        self.hasher = hasher
        self.client: httpx.AsyncClient | None = None  # health checks and scrapes
        self._known_backends: set[str] = set()  # as of the last discovery change
        self.upstream: UpstreamPool | None = None  # proxied requests
        self.monitor: HealthMonitor | None = None
        self._discovery_factory = discovery or self._default_discovery
        self._discovery: Any = None
        self._auth = f"Bearer {config.api_key}".encode() if config.api_key else None
        self._started = False
        self.kv_index = KVIndex() if config.strategy == "kv-events" else None
        self.kv_events: KVEventSubscriptions | None = None
        self._kv_client: httpx.AsyncClient | None = None

    def _make_balancer(self, strategy: str) -> Balancer:
        cfg = self.config
        return Balancer(
            strategy=strategy,
            mean_load_factor=cfg.mean_load_factor,
            min_load_cap=cfg.min_load_cap,
            index_capacity=cfg.index_capacity,
            virtual_nodes=cfg.virtual_nodes,
            hash_key_blocks=cfg.hash_key_blocks,
        )

    def _make_activator(self) -> Activator:
        cfg = self.config
        scaler = None
        if cfg.scale_from_zero:
            from pagedserve.router.scaler import ModelDeploymentScaler

            scaler = ModelDeploymentScaler(cfg.scale_from_zero, cfg.namespace)
        return Activator(
            self.metrics,
            max_held=cfg.max_held_requests,
            held_timeout=cfg.held_request_timeout,
            scaler=scaler,
            activity_interval=cfg.activity_interval,
        )

    # --- lifecycle -------------------------------------------------------------------------------
    async def startup(self) -> None:
        if self._started:
            return
        self._started = True
        cfg = self.config
        self.upstream = UpstreamPool(
            connect_timeout=cfg.connect_timeout,
            read_timeout=cfg.read_timeout,
            max_idle_per_host=cfg.max_keepalive_connections,
            keepalive_expiry=cfg.keepalive_expiry,
        )
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.health_timeout, connect=cfg.connect_timeout),
            limits=httpx.Limits(max_keepalive_connections=8, keepalive_expiry=cfg.keepalive_expiry),
            follow_redirects=False,
            trust_env=False,
        )
        self.monitor = self._make_monitor(self.balancer)
        self._start_kv_events()
        self._discovery = self._discovery_factory(self.balancer, self._on_discovery_change)
        await self._discovery.start()
        monitors = [self.monitor]
        if self.prefill is not None:
            monitors.append(await self._start_prefill_pool(self.prefill))
        # One round of checks before serving, so that dead static backends are not tried first.
        with contextlib.suppress(Exception):
            checks = asyncio.gather(*(monitor.check_all() for monitor in monitors))
            await asyncio.wait_for(checks, cfg.health_timeout + 1)
        for monitor in monitors:
            monitor.sync()
        self._on_membership_change()
        self.activator.start()

    def _make_monitor(self, balancer: Balancer) -> HealthMonitor:
        cfg = self.config
        assert self.client is not None
        return HealthMonitor(
            balancer,
            self.client,
            interval=cfg.health_interval,
            timeout=cfg.health_timeout,
            unhealthy_after=cfg.unhealthy_after,
            on_change=self._on_membership_change,
            api_key=cfg.engine_api_key,
        )

    async def _start_prefill_pool(self, pool: PrefillPool) -> HealthMonitor:
        """--strategy pd: discovery and health checks of the prefill engines, as of the decode engines."""
        cfg = self.config
        pool.monitor = self._make_monitor(pool.balancer)
        pool.discovery = self._pool_discovery(
            pool.balancer, self._on_prefill_discovery_change, cfg.prefill_backends, cfg.prefill_k8s_service
        )
        await pool.discovery.start()
        return pool.monitor

    def _default_discovery(self, balancer: Balancer, on_change: Callable[[], None]) -> Any:
        return self._pool_discovery(balancer, on_change, self.config.backends, self.config.k8s_service)

    def _pool_discovery(
        self, balancer: Balancer, on_change: Callable[[], None], backends: list[str], service: str | None
    ) -> Any:
        cfg = self.config
        if service:
            return EndpointSliceDiscovery(balancer, service, cfg.namespace, cfg.target_port, on_change)
        return StaticDiscovery(balancer, backends, on_change)

    def _start_kv_events(self) -> None:
        """--strategy kv-events: a KV event subscription per replica (kept in step with discovery)."""
        if self.kv_index is None:
            return
        if self.hasher is None or self.hasher.tokenizer is None:
            logger.warning("--strategy kv-events without the engines' tokenizer: routing by prefix-hash only")
        # Streams of their own: long-lived, without the health checks' timeouts or pool limits.
        self._kv_client = httpx.AsyncClient(
            timeout=None, trust_env=False, limits=httpx.Limits(max_connections=None)
        )
        metrics = self.metrics
        self.kv_events = KVEventSubscriptions(
            self.kv_index,
            self._kv_client,
            api_key=self.config.engine_api_key,
            on_batch=lambda url, n: metrics.kv_events.inc(n),
            on_resync=lambda url, reason: metrics.kv_resyncs.labels(reason).inc(),
        )

    def _kv_matches(self, token_ids: list[int], cache_salt: Any, lora: str | None) -> dict[str, int] | None:
        if self.kv_index is None or self.hasher is None or self.hasher.tokenizer is None:
            return None  # without the engines' tokenizer, no hash can match theirs
        return self.kv_index.matches(token_ids, cache_salt, list(self.balancer.backends), lora)

    async def _stop_kv_events(self) -> None:
        if self.kv_events is not None:
            await self.kv_events.stop()
        if self._kv_client is not None:
            await self._kv_client.aclose()

    async def shutdown(self) -> None:
        await self.activator.stop()
        await self._stop_kv_events()
        pools = [(self._discovery, self.monitor)]
        if self.prefill is not None:
            pools.append((self.prefill.discovery, self.prefill.monitor))
        for discovery, monitor in pools:
            if discovery is not None:
                await discovery.stop()
            if monitor is not None:
                await monitor.stop()
        if self.client is not None:
            await self.client.aclose()
        if self.upstream is not None:
            await self.upstream.aclose()

    def _on_discovery_change(self) -> None:
        self._known_backends = known = self._sync_pool(self.balancer, self.monitor, self._known_backends)
        if self.kv_events is not None:
            self.kv_events.sync(known)
        self._on_membership_change()

    def _on_prefill_discovery_change(self) -> None:
        pool = self.prefill
        assert pool is not None
        pool.known = self._sync_pool(pool.balancer, pool.monitor, pool.known)
        self._on_membership_change()

    def _sync_pool(self, balancer: Balancer, monitor: HealthMonitor | None, known: set[str]) -> set[str]:
        """After a discovery change: health checks for the pool's replicas as they are now, and what was
        kept for the departed ones dropped. Returns the pool's replicas."""
        if monitor is not None:
            with contextlib.suppress(RuntimeError):
                monitor.sync()  # checks of departed replicas stop, their state goes
        now = set(balancer.backends)
        for url in known - now:
            self._forget_backend(url)
        return now

    def _forget_backend(self, url: str) -> None:
        """Drop what is kept per replica once it has left discovery: with pods coming and going under
        new addresses, anything kept would grow without bound."""
        self.metrics.forget_backend(url)
        if self.upstream is not None:
            self.upstream.forget(url)

    def _on_membership_change(self) -> None:
        for _, balancer in self._pools():
            for url, state in balancer.backends.items():
                self.metrics.backend_ready.labels(url).set(1 if state.ready else 0)
        ready = len(self.balancer.ready_urls())
        self.metrics.ready_backends.set(ready)
        self.metrics.backends.set(len(self.balancer.backends))
        if self.prefill is not None:
            self.metrics.ready_prefill_backends.set(len(self.prefill.balancer.ready_urls()))
        self.activator.on_ready(ready)  # the decode engines: a request can always run colocated there

    def _pools(self) -> list[tuple[str, Balancer]]:
        """(role, balancer) of every pool of replicas: one, or under --strategy pd decode and prefill."""
        if self.prefill is None:
            return [("colocated", self.balancer)]
        return [("decode", self.balancer), ("prefill", self.prefill.balancer)]

    # --- ASGI ------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            if path == "/v1/models" and scope["method"] == "GET" and self._models_known():
                await self.list_models(scope, receive, send)
            elif path.startswith("/v1/") or path in POOLING_PATHS:
                await self.proxy(scope, receive, send)
            elif path == "/health":
                await _send_simple(send, 200, json.dumps(self._health()).encode())
            elif path == "/ready":
                n = len(self.balancer.ready_urls())
                if n or self.activator.can_hold():  # holding: it must be reachable to wake the engines
                    await _send_simple(send, 200, json.dumps({"status": "ok", "ready_backends": n}).encode())
                else:
                    await _send_simple(send, 503, error_json("no ready backend", 503))
            elif path == "/metrics":
                for _, balancer in self._pools():
                    for url, state in balancer.backends.items():
                        self.metrics.backend_load.labels(url).set(state.load)
                self.metrics.set_adapter_replicas(self._adapter_replicas())
                if self.kv_index is not None:
                    self.metrics.kv_index_blocks.set(self.kv_index.size())
                    self.metrics.kv_synced_backends.set(len(self.kv_index.replicas))
                await _send_simple(send, 200, self.metrics.render(), self.metrics.content_type.encode())
            elif path == "/backends":
                await _send_simple(send, 200, json.dumps(self.backends_snapshot()).encode())
            elif path == "/openapi.json":
                await _send_simple(send, 200, openapi_json())
            else:
                await _send_simple(send, 404, error_json(f"route {path} not found", 404))
        elif kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    try:
                        await self.startup()
                    except Exception as exc:
                        logger.exception("router startup failed")
                        await send({"type": "lifespan.startup.failed", "message": str(exc)})
                        return
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.shutdown()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    def _health(self) -> dict[str, Any]:
        health: dict[str, Any] = {
            "status": "ok",
            "ready_backends": len(self.balancer.ready_urls()),
            "backends": len(self.balancer.backends),
        }
        if self.prefill is not None:
            health["ready_prefill_backends"] = len(self.prefill.balancer.ready_urls())
            health["prefill_backends"] = len(self.prefill.balancer.backends)
        return health

    def _adapter_replicas(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.balancer.backends.values():
            for name in s.models.adapters if s.models is not None else ():
                counts[name] = counts.get(name, 0) + s.ready
        return counts

    def _models_known(self) -> bool:
        return any(s.models is not None for s in self.balancer.backends.values())

    async def list_models(self, scope, receive, send) -> None:
        """GET /v1/models: the union of what the replicas list (bases and adapters), from the last poll.
        Authenticated as every /v1 route; with no list read yet, proxy() passes it to a replica."""
        if not self._authorized(scope):
            await _send_simple(
                send, 401, error_json("invalid or missing API key", 401, code="invalid_api_key")
            )
            self.metrics.request_done("none", "401")
            return
        states = sorted(self.balancer.backends.values(), key=lambda s: (not s.ready, s.url))
        body = json.dumps({"object": "list", "data": union_cards(s.models for s in states)}).encode()
        await _send_simple(send, 200, body)

    def _authorized(self, scope) -> bool:
        if self._auth is None:
            return True
        auth = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        return auth is not None and hmac.compare_digest(auth, self._auth)

    def backends_snapshot(self) -> list[dict[str, Any]]:
        """Each replica's state; ``role``: decode or prefill under --strategy pd, else colocated."""
        return [
            {
                "url": url,
                "role": role,
                "ready": s.ready,
                "discovered_ready": s.discovered,
                "healthy": s.healthy,
                "in_flight": s.in_flight,
                "waiting": s.waiting,
                "kv_cache_usage": s.kv_usage,
                "load": s.load,
                "indexed_blocks": len(s.index),
                "adapters": sorted(s.models.adapters) if s.models is not None else None,
                "kv_events_synced": self.kv_index is not None and self.kv_index.synced(url),
                "kv_indexed_blocks": self.kv_index.blocks_of(url) if self.kv_index is not None else 0,
                "idle_connections": self.upstream.idle_connections(url) if self.upstream else 0,
            }
            for role, balancer in self._pools()
            for url, s in balancer.backends.items()
        ]

    # --- the proxy -------------------------------------------------------------------------------
    def _prompt_key(self, path: str, body: bytes, adapters: frozenset[str]) -> PromptKey:
        """The request's model and, for a prompt under prefix-hash or kv-events, its block hashes (rooted
        at its LoRA adapter when ``model`` is one of ``adapters``) and each synchronised replica's match
        under kv-events. One JSON parse for all of it."""
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
            return PromptKey()  # the engine will answer 400
        model = request_model(parsed)
        lora = model if model in adapters else None
        if self.hasher is None or path not in HASHED_PATHS:
            return PromptKey(model, request=parsed)
        try:
            ids = self.hasher.token_ids_for(path, parsed)
            if not ids:
                return PromptKey(model, request=parsed)
            salt = parsed.get("cache_salt")
            hashes = self.hasher.hashes_of(ids, salt, lora)
            return PromptKey(model, hashes, self._kv_matches(ids, salt, lora), parsed)
        except Exception:  # never fail a request because the router could not hash it
            logger.debug("hashing failed", exc_info=True)
            return PromptKey(model, request=parsed)

    def _response_holder(self, path: str, body: bytes) -> str | None:
        """For the Responses API: the replica storing the response a request names (by
        ``previous_response_id``, or in its path), from the instance in the id (common/routing.py)."""
        if not path.startswith("/v1/responses"):
            return None
        response_id = path.split("/")[3] if path.count("/") >= 3 else None
        if response_id is None and b"previous_response_id" in body:
            try:
                response_id = json.loads(body).get("previous_response_id")
            except (ValueError, AttributeError):
                return None
        instance = instance_of_response(response_id) if isinstance(response_id, str) else None
        return self.balancer.url_of_instance(instance) if instance is not None else None

    def _route(self, model: str | None, balancer: Balancer | None = None) -> Route:
        """The route of ``model`` over a pool's replicas (default: the decode pool, the only one unless
        --strategy pd)."""
        replicas = {url: (s.ready, s.models) for url, s in (balancer or self.balancer).backends.items()}
        return route_for(model, replicas, self.config.model_name)

    async def proxy(self, scope, receive, send) -> None:
        """One ``/v1/*`` request. After the body is read, the forwarding runs while another task waits for
        the client to go away; if it does first, at whatever stage (hashing, connecting, waiting for the
        response's head or first chunk, which is the whole generation of a non-streamed request, or
        mid-stream), the forwarding is cancelled. Cancelling closes the upstream connection, so the engine
        aborts the request and frees its KV blocks at once instead of generating for nobody."""
        started = time.perf_counter()
        if not self._authorized(scope):
            body = error_json("invalid or missing API key", 401, code="invalid_api_key")
            await _send_simple(send, 401, body)
            self.metrics.request_done("none", "401")
            return
        body = await _read_body(receive)
        if body is None:  # the client left while sending its request: nothing to forward
            self.metrics.request_done("none", CLIENT_DISCONNECT)
            return
        exchange = Exchange()
        try:
            # A replica that fails mid-body raises out of here: uvicorn closes the client connection.
            with self.activator.track():
                await run_unless_disconnected(receive, self._forward(scope, send, body, exchange))
        except ClientDisconnected:
            exchange.outcome = CLIENT_DISCONNECT
        finally:
            self.metrics.request_done(exchange.backend, exchange.outcome)
            self.metrics.duration.observe(time.perf_counter() - started)
            for url in exchange.tried:
                if url not in self.balancer.backends:  # it left discovery while this request was in flight
                    self._forget_backend(url)
            prefill = exchange.prefill  # set under --strategy pd only
            if prefill is not None and self.prefill and prefill not in self.prefill.balancer.backends:
                self._forget_backend(prefill)

    def _upstream_request(self, scope) -> tuple[str, list[tuple[bytes, bytes]]]:
        """The request target (raw path and query) and headers to send to a replica."""
        req_headers = [(k, v) for k, v in scope["headers"] if k not in _DROP_REQUEST]
        client = scope.get("client")
        if client:
            forwarded = next((v for k, v in req_headers if k == b"x-forwarded-for"), None)
            req_headers = [(k, v) for k, v in req_headers if k != b"x-forwarded-for"]
            ip = client[0].encode()
            req_headers.append((b"x-forwarded-for", forwarded + b", " + ip if forwarded else ip))
        target = scope.get("raw_path") or scope["path"].encode()
        if isinstance(target, bytes):
            target = target.decode("latin-1")
        if scope.get("query_string"):
            target = target + "?" + scope["query_string"].decode("latin-1")
        return target, req_headers

    async def _forward(self, scope, send, body: bytes, exchange: Exchange) -> None:
        """Pick a replica, send the request, retry before the first body byte, stream the answer."""
        metrics = self.metrics
        balancer = self.balancer
        path = scope["path"]
        method = scope["method"]
        key = PromptKey()
        if method == "POST" and body:
            adapters = balancer.adapter_names()
            # A long prompt, or a request's own template (up to its render bound): keep the loop serving.
            if self.hasher is not None and (len(body) > _TOKENIZE_INLINE_MAX or b"chat_template" in body):
                key = await asyncio.to_thread(self._prompt_key, path, body, adapters)
            else:
                key = self._prompt_key(path, body, adapters)
        hashes, kv_matches = key.hashes, key.kv_matches
        target, req_headers = self._upstream_request(scope)

        pool = self.upstream
        assert pool is not None, "router not started"
        if not await self._hold_until_ready(send, exchange):
            return
        route = self._route(key.model)
        if not await self._admit_route(send, route, key.model, exchange):
            return
        if self.prefill is not None:  # --strategy pd
            if pd.applies(method, path, key.request):
                body = await self._disaggregate(send, path, body, key, target, req_headers, exchange)
                if body is None:
                    return  # the prefill engine's 4xx was the answer
            hashes, kv_matches = [], None  # decode engines are chosen by load alone
        only = route.holders if route.kind == ADAPTER else None
        if (holder := self._response_holder(path, body)) is not None:
            only = {holder}  # it alone stores the response this request continues (or reads)
        tried = exchange.tried
        last_error = "no ready backend"
        decision = balancer.choose(hashes, tried, kv_matches, only)
        while True:
            if decision is None:
                exchange.backend, exchange.outcome = "none", "503"
                await _send_simple(
                    send, 503, error_json(f"no backend could serve the request: {last_error}", 503)
                )
                return
            url = decision.url
            tried.add(url)
            exchange.backend = url
            can_retry = len(tried) <= self.config.max_retries
            balancer.acquire(url)
            gauge = metrics.in_flight_child(url)
            gauge.inc()
            response: UpstreamResponse | None = None
            try:
                try:
                    response = await pool.request(url, method, target, req_headers, body)
                    if response.status == 503 and can_retry:
                        nxt = balancer.choose(hashes, tried, kv_matches, only)
                        if nxt is not None:
                            last_error = f"{url}: 503"
                            metrics.retry(url, "status_503")
                            decision = nxt
                            continue
                    # Commit only once the first body chunk is here: a replica that dies before it (during
                    # prefill, say) can still be replaced.
                    first = await response.next_chunk()
                except UpstreamConnectError as exc:
                    last_error = f"{url}: {exc}"
                    metrics.retry(url, "connect")
                    if balancer.set_healthy(url, False):
                        logger.warning("backend %s refused the connection: it leaves the ring", url)
                        self._on_membership_change()
                    decision = balancer.choose(hashes, tried, kv_matches, only) if can_retry else None
                    continue
                except (UpstreamDisconnect, UpstreamProtocolError) as exc:
                    last_error = f"{url}: {exc}"
                    metrics.retry(url, "disconnect")
                    decision = balancer.choose(hashes, tried, kv_matches, only) if can_retry else None
                    continue
                except UpstreamTimeout as exc:
                    exchange.outcome = "504"
                    await _send_simple(send, 504, error_json(f"backend {url}: {exc}", 504))
                    return

                # The replica is computing this prompt's blocks: remember them for the next requests. Not
                # after an error: a refused request (4xx) or a failed one (5xx) left nothing in its cache.
                if 200 <= response.status < 300:
                    balancer.record(url, hashes)
                metrics.decision(decision.reason)
                if only is not None:
                    metrics.adapter_request(key.model or "", "routed")
                if hashes:
                    metrics.matched_ratio.observe(decision.matched_blocks / len(hashes))
                await self._stream(send, response, first, url, exchange)
                return
            finally:
                if response is not None:
                    response.close()
                balancer.release(url)
                gauge.dec()

    async def _disaggregate(
        self,
        send,
        path: str,
        body: bytes,
        key: PromptKey,
        target: str,
        req_headers: list[tuple[bytes, bytes]],
        exchange: Exchange,
    ) -> bytes | None:
        """--strategy pd: the prefill step, then the decode step's body: the client's with the prefill's
        kv_transfer_params, or as it came when the step failed (a colocated run, its reason counted). None:
        the prefill engine refused the request (4xx) and that answer has been sent."""
        self.metrics.pd_requests.inc()
        result = await self._prefill(send, path, key, target, req_headers, exchange)
        if result.answered:
            return None
        if result.params is not None:
            return pd.decode_body(body, result.params)
        reason = result.fallback or pd.PREFILL_ERROR
        self.metrics.pd_fallbacks.labels(reason).inc()
        logger.debug("P/D request runs colocated on a decode engine: %s", reason)
        return body

    def _choose_prefill(self, key: PromptKey) -> Decision | None:
        """The prefill engine for a request, by prefix hash over the prefill pool (among the replicas that
        list its LoRA adapter, if it names one); None when no ready one can take it."""
        assert self.prefill is not None
        balancer = self.prefill.balancer
        route = self._route(key.model, balancer)
        if route.kind not in (BASE, ADAPTER):
            return None
        decision = balancer.choose(key.hashes, (), None, route.holders if route.kind == ADAPTER else None)
        if decision is not None:
            self.metrics.decision(decision.reason)
            if key.hashes:
                self.metrics.matched_ratio.observe(decision.matched_blocks / len(key.hashes))
        return decision

    async def _prefill(
        self,
        send,
        path: str,
        key: PromptKey,
        target: str,
        req_headers: list[tuple[bytes, bytes]],
        exchange: Exchange,
    ) -> PrefillResult:
        """Send the prefill step (router/pd.py) to its engine. Never retried on another prefill engine: a
        decode engine can always run the request itself."""
        assert self.prefill is not None and self.upstream is not None
        decision = self._choose_prefill(key)
        if decision is None:
            return PrefillResult(fallback=pd.NO_PREFILL_BACKEND)
        balancer = self.prefill.balancer
        url = exchange.prefill = decision.url
        payload = pd.prefill_body(path, key.request)
        balancer.acquire(url)
        gauge = self.metrics.in_flight_child(url)
        gauge.inc()
        started = time.perf_counter()
        response: UpstreamResponse | None = None
        try:
            try:
                # Its read timeout bounds the step: a prefill engine sends nothing until its one token.
                response = await self.upstream.request(
                    url, "POST", target, req_headers, payload, read_timeout=self.config.prefill_timeout
                )
                client_error = pd.is_client_error(response.status)
                answer = await (response.next_chunk() if client_error else response.read())
            except UpstreamError as exc:
                return PrefillResult(fallback=self._prefill_failed(url, exc))
            finally:
                self.metrics.pd_prefill_seconds.observe(time.perf_counter() - started)
            if client_error:  # the request is bad: a decode engine would refuse it too
                exchange.backend = url
                await self._stream(send, response, answer, url, exchange)
                return PrefillResult(answered=True)
            if not 200 <= response.status < 300:
                logger.warning("prefill backend %s answered %d", url, response.status)
                return PrefillResult(fallback=pd.PREFILL_ERROR)
            balancer.record(url, key.hashes)  # its cache holds the prompt's blocks now
            params = pd.kv_params_of(answer)
            return PrefillResult(params) if params is not None else PrefillResult(fallback=pd.NO_KV_PARAMS)
        finally:
            if response is not None:
                response.close()
            balancer.release(url)
            gauge.dec()

    def _prefill_failed(self, url: str, exc: Exception) -> str:
        """The fallback reason of a prefill step that got no answer; a refused connection takes the prefill
        replica out of its ring, as in the decode pool."""
        if isinstance(exc, UpstreamConnectError):
            assert self.prefill is not None
            if self.prefill.balancer.set_healthy(url, False):
                logger.warning("prefill backend %s refused the connection: it leaves the ring", url)
                self._on_membership_change()
            return pd.PREFILL_UNREACHABLE
        if isinstance(exc, UpstreamDisconnect):
            return pd.PREFILL_UNREACHABLE
        logger.warning("prefill backend %s failed: %s", url, exc)
        return pd.PREFILL_ERROR

    async def _admit_route(self, send, route: Route, model: str | None, exchange: Exchange) -> bool:
        """Answer a request no replica can serve: False once answered (see router/adapters.py)."""
        if route.kind == NOT_FOUND:
            exchange.backend, exchange.outcome = "none", "404"
            self.metrics.model_not_found.inc()
            message = f"The model `{model}` does not exist."
            await _send_simple(send, 404, error_json(message, 404, param="model", code="model_not_found"))
            return False
        if route.kind == NOT_LOADED:
            exchange.backend, exchange.outcome = "none", "503"
            self.metrics.adapter_request(model or "", NOT_LOADED)
            retry_after = ((b"retry-after", str(ADAPTER_RETRY_AFTER_S).encode()),)
            message = f"no ready replica serves the adapter `{model}` now"
            await _send_simple(send, 503, error_json(message, 503), headers=retry_after)
            return False
        return True

    async def _hold_until_ready(self, send, exchange: Exchange) -> bool:
        """With holding on and no ready replica: wait for one (router/activator.py). False: answered 503."""
        while self.activator.holding and not self.balancer.ready_urls():
            try:
                await self.activator.wait_for_ready()
            except HeldRequestRefused as refusal:
                exchange.backend, exchange.outcome = "none", "503"
                await _send_held_refusal(send, refusal)
                return False
        return True

    async def _stream(
        self, send, response: UpstreamResponse, first: bytes, url: str, exchange: Exchange
    ) -> None:
        status = response.status
        headers = [(k, v) for k, v in response.headers if k.lower() not in _DROP_RESPONSE]
        exchange.outcome = str(status)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        if not first:
            await send({"type": "http.response.body", "body": b""})
            return
        if response.at_end():  # the whole body came in one piece
            await send({"type": "http.response.body", "body": first})
            return
        await send({"type": "http.response.body", "body": first, "more_body": True})
        while True:
            try:
                chunk = await response.next_chunk()
            except UpstreamError as exc:
                exchange.outcome = "error"
                logger.warning("backend %s failed mid-response: %s", url, exc)
                ctype = response.header(b"content-type") or b""
                if ctype.startswith(b"text/event-stream"):
                    err = error_json(f"backend {url} failed mid-stream: {exc}", 502)
                    await send({"type": "http.response.body", "body": b"data: " + err + b"\n\n"})
                    return
                raise
            if not chunk:
                await send({"type": "http.response.body", "body": b""})
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})


def create_app(
    config: RouterConfig, hasher: PromptHasher | None = None, discovery: DiscoveryFactory | None = None
) -> RouterApp:
    return RouterApp(config, hasher=hasher, discovery=discovery)
