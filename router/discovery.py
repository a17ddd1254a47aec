"""Where the replicas are and whether they are fit to serve.

* ``StaticDiscovery``: a fixed list of URLs (``--backend``, repeatable).
* ``EndpointSliceDiscovery``: the EndpointSlices of a Kubernetes Service (``--k8s-service``,
  ``--namespace``), listed then watched with the kubernetes client (in-cluster config, else kubeconfig)
  in a thread; each endpoint's ``conditions.ready`` decides its discovered readiness. Endpoints come and
  go without a restart; the watch re-lists after errors and expired resource versions.
* ``HealthMonitor``: one task per replica that every ``interval`` seconds GETs ``/health`` and scrapes
  ``/metrics`` (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``) for the load score, and
  ``/v1/models`` for the LoRA adapters it serves (router/adapters.py; at most ``MAX_MODELS_BYTES``). A
  replica that refuses connections leaves the ring at once; one that times out leaves after
  ``unhealthy_after`` failed checks in a row; any replica rejoins on its first good check.

The balancer is only touched from the event loop (the watch thread hands its events over with
``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx
from pagedserve.common.routing import INSTANCE_HEADER
from pagedserve.router.adapters import parse_models
from pagedserve.router.balancer import Balancer

logger = logging.getLogger(__name__)

WAITING_METRICS = ("vllm:num_requests_waiting",)
KV_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
MAX_MODELS_BYTES = 1 << 20  # a /v1/models body larger than this is ignored (the replica's list stays unknown)


def normalize_url(url: str) -> str:
    """'host:port' or 'http://host:port/' -> 'http://host:port'."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


def host_port_url(address: str, port: int, scheme: str = "http") -> str:
    if ":" in address and not address.startswith("["):  # IPv6 literal
        address = f"[{address}]"
    return f"{scheme}://{address}:{port}"


def parse_engine_metrics(text: str) -> tuple[float, float]:
    """(requests waiting, KV cache usage 0..1) from a Prometheus text exposition. Waiting is summed over
    label sets (models), KV usage is the maximum. Missing metrics count as 0."""
    waiting = 0.0
    kv = 0.0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        if 0 <= brace < space:
            name = line[:brace]
            close = line.rfind("}")
            rest = line[close + 1 :].split()
        else:
            name = line[:space]
            rest = line[space + 1 :].split()
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if value != value:  # NaN
            continue
        if name in WAITING_METRICS:
            waiting += value
        elif name in KV_USAGE_METRICS:
            kv = max(kv, value)
    return waiting, kv


# --- Kubernetes EndpointSlices -------------------------------------------------------------------------
# When a pod has addresses of several families (a dual-stack Service has one EndpointSlice per family),
# the router uses one of them, the first family in this order. The choice must not depend on the order in
# which slices arrive: every router replica names the pod by the same URL, or their hash rings differ and
# prefix affinity across router replicas is lost. IPv4 first because a dual-stack pod always has an IPv4
# address, whichever family the Service lists first.
FAMILY_PREFERENCE = ("IPv4", "IPv6", "FQDN")


@dataclass(frozen=True)
class SliceEndpoint:
    """One endpoint of one EndpointSlice."""

    pod: str  # who it is: its targetRef (the pod's uid, else kind/namespace/name), else its address
    url: str
    ready: bool
    family: str  # the slice's addressType


def endpoints_from_slice(slice_obj: dict[str, Any], port: int) -> list[SliceEndpoint]:
    """The endpoints of one EndpointSlice (a dict with the API's camelCase keys).

    ``conditions.ready`` unset means ready (the API's convention); each endpoint uses its first address.
    """
    family = slice_obj.get("addressType") or "IPv4"  # FQDN: host names, fine for URLs as they are
    out: list[SliceEndpoint] = []
    for ep in slice_obj.get("endpoints") or []:
        addresses = ep.get("addresses") or []
        if not addresses:
            continue
        conditions = ep.get("conditions") or {}
        ready = conditions.get("ready")
        ready = True if ready is None else bool(ready)
        if conditions.get("terminating"):
            ready = False
        out.append(
            SliceEndpoint(_pod_of(ep) or addresses[0], host_port_url(addresses[0], port), ready, family)
        )
    return out


def _pod_of(endpoint: dict[str, Any]) -> str:
    """The identity of the pod behind an endpoint, the same in every slice ("" when the slice has none)."""
    ref = endpoint.get("targetRef") or {}
    if ref.get("uid"):
        return str(ref["uid"])
    if ref.get("name"):
        return "/".join((ref.get("kind") or "", ref.get("namespace") or "", ref["name"]))
    return ""


def merge_endpoints(endpoints: Iterable[SliceEndpoint]) -> dict[str, bool]:
    """{url: ready}, one URL per pod (its address of the preferred family, see FAMILY_PREFERENCE).

    The same URL in several slices (an endpoint moving between slices) is ready if any says so.
    """
    by_pod: dict[str, list[SliceEndpoint]] = {}
    for ep in endpoints:
        by_pod.setdefault(ep.pod, []).append(ep)
    merged: dict[str, bool] = {}
    for eps in by_pod.values():
        chosen = min(eps, key=_preference)
        ready = any(ep.ready for ep in eps if ep.url == chosen.url)
        merged[chosen.url] = merged.get(chosen.url, False) or ready
    return merged


def _preference(ep: SliceEndpoint) -> tuple[int, str]:
    rank = FAMILY_PREFERENCE.index(ep.family) if ep.family in FAMILY_PREFERENCE else len(FAMILY_PREFERENCE)
    return rank, ep.url


class StaticDiscovery:
    def __init__(self, balancer: Balancer, urls: Iterable[str], on_change: Callable[[], None]) -> None:
        self.balancer = balancer
        self.urls = [normalize_url(u) for u in urls]
        self.on_change = on_change

    async def start(self) -> None:
        self.balancer.set_backends(self.urls)
        self.on_change()

    async def stop(self) -> None:
        pass


class EndpointSliceDiscovery:
    """Watches ``discovery.k8s.io/v1`` EndpointSlices labelled ``kubernetes.io/service-name=<service>``."""

    def __init__(
        self,
        balancer: Balancer,
        service: str,
        namespace: str,
        target_port: int,
        on_change: Callable[[], None],
        api: Any = None,
        watch_factory: Callable[[], Any] | None = None,
        retry_delay: float = 2.0,
        watch_timeout_s: int = 300,
    ) -> None:
        self.balancer = balancer
        self.service = service
        self.namespace = namespace
        self.target_port = target_port
        self.on_change = on_change
        self.api = api
        self.watch_factory = watch_factory
        self.retry_delay = retry_delay
        self.watch_timeout_s = watch_timeout_s
        self.slices: dict[str, list[SliceEndpoint]] = {}
        self.synced = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Any = None

    @property
    def label_selector(self) -> str:
        return f"kubernetes.io/service-name={self.service}"

    def _make_api(self) -> Any:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return client.DiscoveryV1Api()

    async def start(self, wait_s: float = 10.0) -> None:
        self._loop = asyncio.get_running_loop()
        if self.api is None:
            self.api = self._make_api()
        if self.watch_factory is None:
            from kubernetes import watch

            self.watch_factory = watch.Watch
        self._thread = threading.Thread(target=self._run, name="endpointslice-watch", daemon=True)
        self._thread.start()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.synced.wait(), wait_s)

    async def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            with contextlib.suppress(Exception):
                self._watch.stop()

    # --- the watch thread ------------------------------------------------------------------------
    def _to_dict(self, obj: Any) -> dict[str, Any]:
        if isinstance(obj, dict):
            return obj
        api_client = getattr(self.api, "api_client", None)
        if api_client is not None:
            return api_client.sanitize_for_serialization(obj)
        return obj.to_dict()  # pragma: no cover

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                listed = self.api.list_namespaced_endpoint_slice(
                    self.namespace, label_selector=self.label_selector
                )
                listed = self._to_dict(listed)
                slices = {
                    (item.get("metadata") or {}).get("name", ""): endpoints_from_slice(item, self.target_port)
                    for item in listed.get("items") or []
                }
                self._post(self._replace_all, slices)
                rv = (listed.get("metadata") or {}).get("resourceVersion")
                self._watch = self.watch_factory()
                kwargs: dict[str, Any] = {
                    "label_selector": self.label_selector,
                    "timeout_seconds": self.watch_timeout_s,
                }
                if rv:
                    kwargs["resource_version"] = rv
                for event in self._watch.stream(
                    self.api.list_namespaced_endpoint_slice, self.namespace, **kwargs
                ):
                    if self._stop.is_set():
                        return
                    etype = event.get("type")
                    obj = self._to_dict(event.get("object") or {})
                    if etype == "ERROR":
                        logger.info(
                            "EndpointSlice watch error event: %s; re-listing", obj.get("message", obj)
                        )
                        break
                    if etype == "BOOKMARK":
                        continue
                    name = (obj.get("metadata") or {}).get("name", "")
                    if etype == "DELETED":
                        self._post(self._set_slice, name, None)
                    else:
                        self._post(self._set_slice, name, endpoints_from_slice(obj, self.target_port))
            except Exception as exc:
                if self._stop.is_set():
                    return
                logger.warning(
                    "EndpointSlice list/watch failed (%s); retrying in %.1fs", exc, self.retry_delay
                )
                self._stop.wait(self.retry_delay)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(fn, *args)

    # --- applied on the event loop ---------------------------------------------------------------
    def _replace_all(self, slices: dict[str, list[SliceEndpoint]]) -> None:
        self.slices = dict(slices)
        self._apply()
        self.synced.set()

    def _set_slice(self, name: str, endpoints: list[SliceEndpoint] | None) -> None:
        if endpoints is None:
            self.slices.pop(name, None)
        else:
            self.slices[name] = endpoints
        self._apply()

    def endpoints(self) -> dict[str, bool]:
        """{url: ready} over all slices, one URL per pod."""
        return merge_endpoints(ep for eps in self.slices.values() for ep in eps)

    def _apply(self) -> None:
        merged = self.endpoints()
        for url in list(self.balancer.backends):
            if url not in merged:
                self.balancer.remove_backend(url)
        for url, ready in merged.items():
            if url in self.balancer.backends:
                self.balancer.set_discovered(url, ready)
            else:
                self.balancer.add_backend(url, discovered=ready)
        self.on_change()


# --- health checks and load scraping -------------------------------------------------------------------
class HealthMonitor:
    def __init__(
        self,
        balancer: Balancer,
        client: httpx.AsyncClient,
        interval: float = 1.0,
        timeout: float = 5.0,
        unhealthy_after: int = 3,
        on_change: Callable[[], None] | None = None,
        api_key: str | None = None,
    ) -> None:
        self.balancer = balancer
        self.client = client
        # The engines' --api-key guards /v1/models (not /health or /metrics).
        self.models_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.interval = interval
        self.timeout = timeout
        self.unhealthy_after = max(1, unhealthy_after)
        self.on_change = on_change or (lambda: None)
        self._tasks: dict[str, asyncio.Task] = {}
        self._failures: dict[str, int] = {}
        self.last_check: dict[str, float] = {}

    def sync(self) -> None:
        """Start a checking task for every known replica; stop those of replicas that are gone."""
        urls = set(self.balancer.backends)
        for url in list(self._tasks):
            if url not in urls:
                self._tasks.pop(url).cancel()
        for state in (self._failures, self.last_check):
            for url in [url for url in state if url not in urls]:
                del state[url]
        for url in urls:
            if url not in self._tasks:
                self._tasks[url] = asyncio.get_running_loop().create_task(self._loop(url))

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(url) for url in list(self.balancer.backends)))

    async def _loop(self, url: str) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.check(url)
            except asyncio.CancelledError:
                raise
            except Exception:  # pragma: no cover - check() handles its own errors
                logger.exception("health check of %s failed", url)
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    async def check(self, url: str) -> bool:
        healthy, refused = await self._probe(url)
        if healthy:
            self._failures[url] = 0
        else:
            self._failures[url] = self._failures.get(url, 0) + 1
        self.last_check[url] = time.time()
        state = self.balancer.backends.get(url)
        if state is None:
            return healthy
        if healthy:
            new = True
        elif refused or self._failures[url] >= self.unhealthy_after:
            new = False
        else:
            new = state.healthy
        if self.balancer.set_healthy(url, new):
            logger.info("backend %s %s the ring", url, "joined" if new else "left")
            self.on_change()
        return healthy

    async def _probe(self, url: str) -> tuple[bool, bool]:
        """(healthy, connection refused)."""
        try:
            health, metrics, models = await asyncio.gather(
                self.client.get(url + "/health", timeout=self.timeout),
                self.client.get(url + "/metrics", timeout=self.timeout),
                self.client.get(url + "/v1/models", timeout=self.timeout, headers=self.models_headers),
                return_exceptions=True,
            )
        except Exception:  # pragma: no cover
            return False, False
        if isinstance(metrics, httpx.Response) and metrics.status_code == 200:
            waiting, kv = parse_engine_metrics(metrics.text)
            self.balancer.set_scraped(url, waiting, kv)
        if isinstance(models, httpx.Response):  # a failed fetch keeps the list of the last good poll
            self.balancer.set_models(url, _models_of(models))
        if isinstance(health, httpx.Response):
            self.balancer.set_instance(url, health.headers.get(INSTANCE_HEADER))
            return health.status_code == 200, False
        refused = isinstance(health, httpx.ConnectError)
        if not refused:
            logger.debug("health check of %s: %r", url, health)
        return False, refused


def _models_of(response: httpx.Response) -> Any:
    """The replica's ServedModels from its /v1/models answer; None (unknown) for anything else."""
    if response.status_code != 200 or len(response.content) > MAX_MODELS_BYTES:
        return None
    try:
        return parse_models(response.json())
    except (ValueError, RecursionError):
        return None
