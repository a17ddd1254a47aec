"""Prometheus metrics with vLLM's names, buckets and labels, one CollectorRegistry per app.

Engine state (running/waiting requests, KV usage, prefix-cache and token counters) is read from
``engine.stats()`` at scrape time by a custom collector, so the engine step pays nothing for it.
Per-request histograms are observed by the serving layer as each request's DELTA outputs arrive
(``RequestTracker``). The periodic engine log line is the engine's own (AsyncEngine's step thread).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from pagedserve.server.engine.core_output import EngineStats, KVOffloadStats, KVTransferStats, LoRAStats
    from pagedserve.server.engine.protocol import EngineClient
    from pagedserve.server.outputs import RequestOutput
    from pagedserve.server.spec_decode.metrics import SpecDecodingStats

LABELS = ["model_name", "engine"]
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
REQUEST_LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
FINISH_REASONS = ("stop", "length", "abort")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class EngineStatsCollector:
    """Gauges and counters of the engine, read from one ``engine.stats()`` snapshot per scrape."""

    def __init__(self, engine: EngineClient, label_values: list[str], cache_info: dict[str, str]) -> None:
        self.engine = engine
        self.label_values = label_values
        self.cache_info = cache_info

    def _family(self, kind: type, name: str, doc: str, value: float) -> Metric:
        family = kind(name, doc, labels=LABELS)
        family.add_metric(self.label_values, value)
        return family

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._family(
            g, "vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running
        )
        yield self._family(
            g, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting
        )
        yield self._family(
            g, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage
        )
        yield self._family(
            g,
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: use vllm:kv_cache_usage_perc.",
            s.kv_cache_usage,
        )
        yield self._family(
            c,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        )
        yield self._family(
            c,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        )
        yield self._family(
            c, "vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions
        )
        yield self._family(c, "vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield self._family(
            c, "vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens
        )
        if s.spec_decoding is not None:
            yield from self._spec_decoding(s.spec_decoding)
        if s.lora is not None:
            yield from self._lora(s.lora)
        if s.kv_offload is not None or s.kv_transfer is not None:
            yield from self._external_prefix_cache(s)
        if s.kv_offload is not None:
            yield from self._kv_offload(s.kv_offload)
        if s.kv_transfer is not None:
            yield from self._kv_transfer(s.kv_transfer)
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(self.cache_info)
        )
        info.add_metric(list(self.cache_info.values()), 1.0)
        yield info


    def _external_prefix_cache(self, s: EngineStats) -> Iterator[Metric]:
        """vLLM's external (KV connector) prefix cache: the CPU KV tier's hits and the prompt tokens read
        from prefill engines, in tokens."""
        sources = [stats for stats in (s.kv_offload, s.kv_transfer) if stats is not None]
        yield self._family(
            CounterMetricFamily,
            "vllm:external_prefix_cache_queries",
            "External prefix cache (the CPU KV tier, KV read from prefill engines) queries, in terms of "
            "number of queried tokens.",
            sum(stats.queries for stats in sources),
        )
        yield self._family(
            CounterMetricFamily,
            "vllm:external_prefix_cache_hits",
            "External prefix cache (the CPU KV tier, KV read from prefill engines) hits, in terms of number "
            "of cached tokens.",
            sum(stats.hits for stats in sources),
        )

    def _kv_transfer(self, transfer: KVTransferStats) -> Iterator[Metric]:
        """Prefill/decode disaggregation's reads (vLLM's names are its NIXL connector's own, vllm:nixl_*;
        these are the connector-neutral ones) and the prefill side's held blocks."""
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._family(c, "vllm:kv_transfer_bytes", "KV bytes read from prefill engines.",
                           transfer.bytes_received)
        yield self._family(c, "vllm:kv_transfer_seconds", "Time spent reading KV from prefill engines.",
                           transfer.transfer_seconds)
        yield self._family(c, "vllm:kv_transfers", "Reads of a request's KV from a prefill engine.",
                           transfer.num_transfers)
        yield self._family(c, "vllm:kv_transfer_failures",
                           "Reads that failed: those requests computed their prompts here instead.",
                           transfer.num_failed)
        yield self._family(g, "vllm:kv_transfer_held_requests",
                           "Finished prefills whose KV blocks wait for their decode engine.",
                           transfer.num_held_requests)
        yield self._family(c, "vllm:kv_transfer_expired",
                           "Finished prefills whose held KV blocks no decode engine read in time (or that "
                           "were freed unread to make room for new requests).",
                           transfer.num_expired)

    def _kv_offload(self, tier: KVOffloadStats) -> Iterator[Metric]:
        """The CPU KV tier as vLLM's native offloading reports it: the bytes it moved (vLLM's flat
        store/load counters) and how full it is (its hits are the external prefix cache's)."""
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._family(
            c, "vllm:kv_offload_store_bytes", "Total bytes stored from GPU to offload storage.",
            tier.store_bytes,
        )  # fmt: skip
        yield self._family(
            c, "vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage to GPU.",
            tier.load_bytes,
        )  # fmt: skip
        yield self._family(
            g, "vllm:kv_offload_cpu_cache_usage_perc",
            "CPU KV offload cache usage. 1 means 100 percent usage.", tier.cpu_cache_usage,
        )  # fmt: skip

    def _lora(self, lora: LoRAStats) -> Iterator[Metric]:
        """vLLM's vllm:lora_requests_info (the adapters running and waiting, in labels; the value is the
        time of the snapshot, as vLLM's) and the finished requests of each adapter."""
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        info.add_metric([",".join(lora.running), ",".join(lora.waiting), str(lora.max_lora)], time.time())
        yield info
        per_adapter = CounterMetricFamily(
            "pagedserve:lora_requests",
            "Finished requests (stopped, cut at length or aborted) per LoRA adapter.",
            labels=[*LABELS, "lora_name"],
        )
        for name, count in sorted(lora.requests_finished.items()):
            per_adapter.add_metric([*self.label_values, name], count)
        yield per_adapter

    def _spec_decoding(self, spec: SpecDecodingStats) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters (vllm/v1/spec_decode/metrics.py SpecDecodingProm)."""
        c = CounterMetricFamily
        yield self._family(
            c, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts
        )
        yield self._family(
            c, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens
        )
        yield self._family(
            c, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens
        )
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*LABELS, "position"],
        )
        for position, count in enumerate(spec.num_accepted_tokens_per_pos):
            per_pos.add_metric([*self.label_values, str(position)], count)
        yield per_pos


def cache_config_info(engine: EngineClient) -> dict[str, str]:
    """vllm:cache_config_info's labels, from the resolved engine config and the KV pool's size."""
    cfg = engine.config
    stats = engine.stats()
    return {
        "block_size": str(stats.block_size),
        "cache_dtype": str(getattr(cfg, "kv_cache_dtype", "auto")),
        "enable_prefix_caching": str(bool(getattr(cfg, "enable_prefix_caching", True))),
        "gpu_memory_utilization": str(getattr(cfg, "gpu_memory_utilization", None)),
        "kv_cache_memory_bytes": str(getattr(cfg, "kv_cache_memory_bytes", None)),
        "num_cpu_blocks": str(stats.kv_offload.num_cpu_blocks if stats.kv_offload is not None else None),
        "num_gpu_blocks": str(stats.num_gpu_blocks),
        "num_gpu_blocks_override": str(getattr(cfg, "num_gpu_blocks_override", None)),
        "engine": "0",
    }


class ServerMetrics:
    """The app's registry: the engine collector plus the per-request histograms and counters."""

    def __init__(self, engine: EngineClient, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = [model_name, "0"]
        self.registry.register(EngineStatsCollector(engine, labels, cache_config_info(engine)))

        def histogram(name: str, doc: str, buckets: list[float] | list[int]) -> Any:
            return Histogram(name, doc, LABELS, registry=self.registry, buckets=buckets).labels(*labels)

        token_buckets = build_1_2_5_buckets(max_model_len)
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        self.params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20]
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        self.success = {reason: success.labels(*labels, reason) for reason in FINISH_REASONS}
        # vLLM has no count of images; ours, beside its names: images of chat requests, each loaded,
        # decoded and handed to the engine.
        self.image_inputs = Counter(
            "pagedserve:image_inputs",
            "Count of images in requests handed to the engine (image_url content parts, each decoded).",
            LABELS,
            registry=self.registry,
        ).labels(*labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, num_prompt_tokens: int, max_tokens: int, n: int) -> RequestTracker:
        return RequestTracker(self, num_prompt_tokens, max_tokens, n)


class RequestTracker:
    """Observes one engine request's outputs as they arrive; records its histograms when it finishes."""

    __slots__ = (
        "arrival",
        "done",
        "last_token",
        "max_tokens",
        "metrics",
        "n",
        "num_finished",
        "num_tokens",
        "prompt_tokens",
    )

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, max_tokens: int, n: int) -> None:
        self.metrics = metrics
        self.prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.n = n
        self.arrival = time.time()
        self.last_token: float | None = None
        self.num_tokens = 0
        self.num_finished = 0  # samples counted in vllm:request_success
        self.done = False

    def observe(self, output: RequestOutput) -> None:
        """One DELTA output: its new tokens, the inter-token latencies the engine timed (whatever outputs
        were folded into this one) and finished samples (success counts)."""
        num_new = 0
        for completion in output.outputs:
            num_new += len(completion.token_ids)
            if completion.finish_reason is not None:
                self.num_finished += 1
                counter = self.metrics.success.get(completion.finish_reason)
                if counter is not None:
                    counter.inc()
        for latency in output.inter_token_latencies:
            self.metrics.itl.observe(latency)
        if num_new:
            self.last_token = time.time()
            self.num_tokens += num_new
        if output.finished:
            self.finish(output)

    def finish(self, output: RequestOutput) -> None:
        if self.done:
            return
        self.done = True
        m, now = self.metrics, time.time()
        rm = output.metrics
        arrival = _attr(rm, "arrival_time") or self.arrival
        scheduled = _attr(rm, "first_scheduled_time")
        first = _attr(rm, "first_token_time")
        last = _attr(rm, "last_token_time") or self.last_token
        finished = _attr(rm, "finished_time") or now
        m.e2e.observe(max(0.0, finished - arrival))
        if first is not None:
            m.ttft.observe(max(0.0, first - arrival))
        if scheduled is not None:
            m.queue.observe(max(0.0, scheduled - arrival))
            if first is not None:
                m.prefill.observe(max(0.0, first - scheduled))
            if last is not None:
                m.inference.observe(max(0.0, last - scheduled))
        if first is not None and last is not None:
            m.decode.observe(max(0.0, last - first))
        m.prompt_tokens.observe(self.prompt_tokens)
        m.generation_tokens.observe(self.num_tokens)
        m.max_tokens.observe(self.max_tokens)
        m.params_n.observe(self.n)

    def abort(self) -> None:
        """The client went away before the request finished."""
        if not self.done:
            self.done = True
            self.metrics.success["abort"].inc(self.n - self.num_finished)


def _attr(obj: Any, name: str) -> float | None:
    return getattr(obj, name, None) if obj is not None else None
