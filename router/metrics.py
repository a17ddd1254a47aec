"""The router's Prometheus metrics (`pagedserve_router_*`), in a registry of its own."""

from __future__ import annotations

import contextlib

from pagedserve.router.balancer import REASONS
from pagedserve.router.pd import FALLBACK_REASONS
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
WAKE_UP_BUCKETS = (1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "pagedserve_router_requests",
            "Requests the router finished, by backend and HTTP status (status 'error': the backend failed "
            "after the response started, or could not be reached; backend 'none': no backend answered).",
            ["backend", "status"],
            registry=r,
        )
        self.decisions = Counter(
            "pagedserve_router_routing_decisions",
            "Routing decisions by reason: prefix_hit, hash_ring, overload_fallback, least_load, round_robin, "
            "kv_event_hit (a match on the blocks an engine reported in its KV events).",
            ["reason"],
            registry=r,
        )
        self.retries = Counter(
            "pagedserve_router_retries",
            "Attempts retried on another backend, by the backend that failed and why "
            "(connect, disconnect, status_503).",
            ["backend", "reason"],
            registry=r,
        )
        self.matched_ratio = Histogram(
            "pagedserve_router_matched_prefix_ratio",
            "Fraction of a prompt's full blocks found in the chosen backend's index, or that its engine "
            "reports holding (prefix-hash, kv-events).",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "pagedserve_router_in_flight_requests",
            "Requests the router has in flight, by backend.",
            ["backend"],
            registry=r,
        )
        self.ready_backends = Gauge(
            "pagedserve_router_ready_backends",
            "Backends in the ring (discovered ready and healthy).",
            registry=r,
        )
        self.backends = Gauge(
            "pagedserve_router_backends", "Backends known to the router (ready or not).", registry=r
        )
        self.backend_ready = Gauge(
            "pagedserve_router_backend_ready",
            "1 if the backend is in the ring, else 0.",
            ["backend"],
            registry=r,
        )
        self.backend_load = Gauge(
            "pagedserve_router_backend_load",
            "The load score the balancer uses: in-flight + scraped waiting + scraped KV cache usage.",
            ["backend"],
            registry=r,
        )
        self.duration = Histogram(
            "pagedserve_router_request_duration_seconds",
            "Time from the request's arrival at the router to the end of its response.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._scale_from_zero_metrics(r)
        self._add_kv_event_metrics(r)
        self._add_adapter_metrics(r)
        self._add_pd_metrics(r)
        # Every reason from the start, so that the series exist (at 0) before the first decision.
        self._decision_children = {(reason,): self.decisions.labels(reason) for reason in REASONS}
        self._request_children: dict[tuple[str, ...], object] = {}
        self._retry_children: dict[tuple[str, ...], object] = {}
        self._in_flight_children: dict[tuple[str, ...], object] = {}

    def _scale_from_zero_metrics(self, r: CollectorRegistry) -> None:
        """Held requests while no engine replica is ready (router/activator.py)."""
        self.max_held = Gauge(
            "pagedserve_router_max_held_requests",
            "--max-held-requests: requests this router holds while no replica is ready (0: holding off). "
            "With holding on and nothing held, no ready replica is the idle state of scale from zero.",
            registry=r,
        )
        self.held = Gauge(
            "pagedserve_router_held_requests",
            "Requests held now, waiting for an engine replica to become ready.",
            registry=r,
        )
        self.held_total = Counter(
            "pagedserve_router_requests_held", "Requests that were held for a ready replica.", registry=r
        )
        self.held_timeouts = Counter(
            "pagedserve_router_held_request_timeouts",
            "Held requests answered 503 because no replica became ready within --held-request-timeout.",
            registry=r,
        )
        self.held_refused = Counter(
            "pagedserve_router_held_requests_refused",
            "Requests answered 503 at once: no ready replica and the hold queue full.",
            registry=r,
        )
        self.wake_ups = Counter(
            "pagedserve_router_wake_ups",
            "Times this router set the ModelDeployment's scale from 0 to 1.",
            registry=r,
        )
        self.wake_up_seconds = Histogram(
            "pagedserve_router_wake_up_seconds",
            "Time from the first held request to the first ready replica.",
            buckets=WAKE_UP_BUCKETS,
            registry=r,
        )

    def _add_kv_event_metrics(self, r: CollectorRegistry) -> None:
        """--strategy kv-events (router/kv_events.py, router/kv_index.py)."""
        self.kv_events = Counter(
            "pagedserve_router_kv_events",
            "KV events received from the engines' streams (snapshots included).",
            registry=r,
        )
        self.kv_resyncs = Counter(
            "pagedserve_router_kv_event_resyncs",
            "Replicas whose KV index was dropped to resynchronise, by reason: stream_end (engine restart, "
            "dropped as slow), gap (a lost batch), error (connection failed).",
            ["reason"],
            registry=r,
        )
        self.kv_index_blocks = Gauge(
            "pagedserve_router_kv_index_blocks",
            "Blocks in the KV-event index, over all replicas.",
            registry=r,
        )
        self.kv_synced_backends = Gauge(
            "pagedserve_router_kv_synced_backends",
            "Backends whose KV event stream is live and synchronised.",
            registry=r,
        )

    def _add_adapter_metrics(self, r: CollectorRegistry) -> None:
        """LoRA adapters (router/adapters.py): one series per adapter the replicas list, never per name a
        client sends (a name no replica lists is only counted)."""
        self.adapter_requests = Counter(
            "pagedserve_router_adapter_requests",
            "Requests for a LoRA adapter, by adapter and outcome: routed (to a replica that lists it), "
            "not_loaded (503: no ready replica lists it now).",
            ["lora_name", "outcome"],
            registry=r,
        )
        self.model_not_found = Counter(
            "pagedserve_router_model_not_found",
            "Requests answered 404 model_not_found: their model is neither the base nor an adapter of any "
            "ready replica.",
            registry=r,
        )
        self.adapter_replicas = Gauge(
            "pagedserve_router_adapter_replicas",
            "Ready replicas that list the LoRA adapter in their /v1/models.",
            ["lora_name"],
            registry=r,
        )
        self._adapter_children: dict[tuple[str, ...], object] = {}

    def _add_pd_metrics(self, r: CollectorRegistry) -> None:
        """--strategy pd (router/pd.py): the prefill step, and the requests that ran colocated instead."""
        self.pd_requests = Counter(
            "pagedserve_router_pd_requests",
            "Requests routed as prefill/decode (a prefill step tried, or no prefill replica ready); those "
            "that ran colocated on a decode engine are also counted in pagedserve_router_pd_fallbacks_total.",
            registry=r,
        )
        self.pd_fallbacks = Counter(
            "pagedserve_router_pd_fallbacks",
            "P/D requests run colocated on a decode engine, by reason: prefill_unreachable (refused or "
            "dropped), prefill_error (5xx, 408/429, timeout), no_kv_params (a 2xx without "
            "kv_transfer_params), no_prefill_backend (no ready prefill replica).",
            ["reason"],
            registry=r,
        )
        for reason in FALLBACK_REASONS:  # the series exist (at 0) before the first fallback
            self.pd_fallbacks.labels(reason)
        self.pd_prefill_seconds = Histogram(
            "pagedserve_router_pd_prefill_seconds",
            "Duration of the prefill step, from sending it to a prefill engine to its whole answer (or its "
            "failure).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ready_prefill_backends = Gauge(
            "pagedserve_router_ready_prefill_backends",
            "Prefill backends in their ring (--strategy pd; pagedserve_router_ready_backends: the decode "
            "backends).",
            registry=r,
        )

    def adapter_request(self, lora_name: str, outcome: str) -> None:
        self._child(self._adapter_children, self.adapter_requests, lora_name, outcome).inc()

    def set_adapter_replicas(self, counts: dict[str, int]) -> None:
        """Replace the per-adapter gauge: adapters no replica lists any more lose their series."""
        self.adapter_replicas.clear()
        for name, count in counts.items():
            self.adapter_replicas.labels(name).set(count)
        for key in [key for key in self._adapter_children if key[0] not in counts]:
            del self._adapter_children[key]
            with contextlib.suppress(KeyError):
                self.adapter_requests.remove(*key)

    # Cached label children: `labels()` costs a lock and a dict build per call.
    @staticmethod
    def _child(children: dict, metric, *labels: str):
        child = children.get(labels)
        if child is None:
            child = children[labels] = metric.labels(*labels)
        return child

    def decision(self, reason: str) -> None:
        self._child(self._decision_children, self.decisions, reason).inc()

    def request_done(self, backend: str, status: str) -> None:
        self._child(self._request_children, self.requests, backend, status).inc()

    def retry(self, backend: str, reason: str) -> None:
        self._child(self._retry_children, self.retries, backend, reason).inc()

    def in_flight_child(self, backend: str):
        return self._child(self._in_flight_children, self.in_flight, backend)

    def forget_backend(self, backend: str) -> None:
        """Drop every series of a backend that has left discovery: pods come and go with new addresses,
        and series kept for each would grow the exposition without bound."""
        for gauge in (self.in_flight, self.backend_ready, self.backend_load):
            with contextlib.suppress(KeyError):
                gauge.remove(backend)
        self._in_flight_children.pop((backend,), None)
        for counter, children in (
            (self.requests, self._request_children),
            (self.retries, self._retry_children),
        ):
            for key in [key for key in children if key[0] == backend]:
                del children[key]
                with contextlib.suppress(KeyError):
                    counter.remove(*key)

    def render(self) -> bytes:
        return generate_latest(self.registry)
