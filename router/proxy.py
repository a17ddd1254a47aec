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

While no replica is ready, requests can be held until one is (``--max-held-requests``; a full queue or a
timeout gets 503 with Retry-After), and the engines woken from zero (``--scale-from-zero``):
router/activator.py.

The router's own errors use the engine server's OpenAI error JSON (common/errors.py), so a client
sees one error shape whether the router or a replica refused it.
Other routes: ``/health`` (the router's liveness, 200), ``/ready`` (503 until a replica is ready, unless
the router can still hold requests),
``/metrics`` (``pagedserve_router_*``), ``/backends`` (JSON: each replica's state, for operators),
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
from pagedserve.router.activator import Activator, HeldRequestRefused
from pagedserve.router.adapters import (
    ADAPTER,
    NOT_FOUND,
    NOT_LOADED,
    Route,
    request_model,
    route_for,
    union_cards,
)
from pagedserve.router.balancer import Balancer
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
HASHED_STRATEGIES = ("prefix-hash", "kv-events")

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

    def _validate_scale_from_zero(self) -> None:
        if self.max_held_requests < 0:
            raise ValueError("--max-held-requests must be >= 0")
        if self.held_request_timeout <= 0:
            raise ValueError("--held-request-timeout must be positive")
        if self.activity_interval <= 0:
            raise ValueError("--activity-interval must be positive")
        if self.scale_from_zero and self.max_held_requests == 0:
            raise ValueError("--scale-from-zero needs --max-held-requests > 0 (requests wait for the wake)")


CLIENT_DISCONNECT = "client_disconnect"  # the status label of a request whose client went away


@dataclass
class PromptKey:
    """What routing reads from a request body: its model, and its prompt's block hashes (salted with its
    LoRA adapter) and kv-events matches when it has a prompt to hash."""

    model: str | None = None
    hashes: list[int] = field(default_factory=list)
    kv_matches: dict[str, int] | None = None


@dataclass
class Exchange:
    """A request being forwarded, as proxy() needs to see it whatever stage it ends at."""

    backend: str = "none"  # the replica tried last ("none": no replica was tried)
    outcome: str = "error"  # the status label of pagedserve_router_requests_total
    tried: set[str] = field(default_factory=set)


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
        self.balancer = Balancer(
            strategy=config.strategy,
            mean_load_factor=config.mean_load_factor,
            min_load_cap=config.min_load_cap,
            index_capacity=config.index_capacity,
            virtual_nodes=config.virtual_nodes,
            hash_key_blocks=config.hash_key_blocks,
        )
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
        self.monitor = HealthMonitor(
            self.balancer,
            self.client,
            interval=cfg.health_interval,
            timeout=cfg.health_timeout,
            unhealthy_after=cfg.unhealthy_after,
            on_change=self._on_membership_change,
            api_key=cfg.engine_api_key,
        )
        self._start_kv_events()
        self._discovery = self._discovery_factory(self.balancer, self._on_discovery_change)
        await self._discovery.start()
        # One round of checks before serving, so that dead static backends are not tried first.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.monitor.check_all(), cfg.health_timeout + 1)
        self.monitor.sync()
        self._on_membership_change()
        self.activator.start()

    def _default_discovery(self, balancer: Balancer, on_change: Callable[[], None]) -> Any:
        cfg = self.config
        if cfg.k8s_service:
            return EndpointSliceDiscovery(
                balancer, cfg.k8s_service, cfg.namespace, cfg.target_port, on_change
            )
        return StaticDiscovery(balancer, cfg.backends, on_change)

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
        if self._discovery is not None:
            await self._discovery.stop()
        if self.monitor is not None:
            await self.monitor.stop()
        if self.client is not None:
            await self.client.aclose()
        if self.upstream is not None:
            await self.upstream.aclose()

    def _on_discovery_change(self) -> None:
        if self.monitor is not None:
            with contextlib.suppress(RuntimeError):
                self.monitor.sync()  # checks of departed replicas stop, their state goes
        known = set(self.balancer.backends)
        for url in self._known_backends - known:
            self._forget_backend(url)
        self._known_backends = known
        if self.kv_events is not None:
            self.kv_events.sync(known)
        self._on_membership_change()

    def _forget_backend(self, url: str) -> None:
        """Drop what is kept per replica once it has left discovery: with pods coming and going under
        new addresses, anything kept would grow without bound."""
        self.metrics.forget_backend(url)
        if self.upstream is not None:
            self.upstream.forget(url)

    def _on_membership_change(self) -> None:
        ready = 0
        for url, state in self.balancer.backends.items():
            self.metrics.backend_ready.labels(url).set(1 if state.ready else 0)
            ready += state.ready
        self.metrics.ready_backends.set(ready)
        self.metrics.backends.set(len(self.balancer.backends))
        self.activator.on_ready(ready)

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
                body = json.dumps(
                    {
                        "status": "ok",
                        "ready_backends": len(self.balancer.ready_urls()),
                        "backends": len(self.balancer.backends),
                    }
                ).encode()
                await _send_simple(send, 200, body)
            elif path == "/ready":
                n = len(self.balancer.ready_urls())
                if n or self.activator.can_hold():  # holding: it must be reachable to wake the engines
                    await _send_simple(send, 200, json.dumps({"status": "ok", "ready_backends": n}).encode())
                else:
                    await _send_simple(send, 503, error_json("no ready backend", 503))
            elif path == "/metrics":
                for url, state in self.balancer.backends.items():
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
        return [
            {
                "url": url,
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
            for url, s in self.balancer.backends.items()
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
            return PromptKey(model)
        try:
            ids = self.hasher.token_ids_for(path, parsed)
            if not ids:
                return PromptKey(model)
            salt = parsed.get("cache_salt")
            return PromptKey(model, self.hasher.hashes_of(ids, salt, lora), self._kv_matches(ids, salt, lora))
        except Exception:  # never fail a request because the router could not hash it
            logger.debug("hashing failed", exc_info=True)
            return PromptKey(model)

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

    def _route(self, model: str | None) -> Route:
        replicas = {url: (s.ready, s.models) for url, s in self.balancer.backends.items()}
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
