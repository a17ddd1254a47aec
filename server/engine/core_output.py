"""What the engine core (server/engine/core.py) hands its front end: per-step outputs and its statistics.

Plain data, no torch: the API and the in-process tests import these without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.server.outputs import RequestMetrics
from pagedserve.server.spec_decode.metrics import SpecDecodingStats

if TYPE_CHECKING:
    from pagedserve.server.outputs import SampledToken
    from pagedserve.server.request import Request


@dataclass
class LoRAStats:
    """vllm:lora_requests_info and pagedserve:lora_requests_total (server/api/metrics.py)."""

    max_lora: int
    running: list[str]  # names of the adapters of running requests
    waiting: list[str]  # ... of waiting ones
    requests_finished: dict[str, int]  # adapter name -> requests finished (stopped, cut or aborted)


@dataclass
class KVOffloadStats:
    """The CPU KV tier's (server/core/offloading_connector.py), for vLLM's external prefix cache and KV
    offload metrics (server/api/metrics.py)."""

    num_cpu_blocks: int
    cpu_cache_usage: float  # host blocks holding a block hash, of all
    queries: int  # prompt tokens looked up while the tier is on
    hits: int  # prompt tokens loaded from the tier instead of computed
    store_bytes: int  # device -> host, ever
    load_bytes: int  # host -> device, ever


@dataclass
class KVTransferStats:
    """Prefill/decode disaggregation's (server/core/mooncake_connector.py), for /metrics."""

    queries: int  # prompt tokens of requests that came with a remote prefill
    hits: int  # prompt tokens read from a prefill engine instead of computed
    bytes_received: int
    transfer_seconds: float  # spent reading, in all
    num_transfers: int
    num_failed: int  # reads that failed: those requests computed their prompts here
    num_held_requests: int  # finished prefills whose blocks wait for their decode engine
    num_expired: int  # held blocks freed unread: their hold time ended, or new requests needed the room


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_gpu_blocks: int
    block_size: int
    spec_decoding: SpecDecodingStats | None = None  # None: speculative decoding is off
    lora: LoRAStats | None = None  # None: LoRA is off
    kv_offload: KVOffloadStats | None = None  # None: no host KV tier
    kv_transfer: KVTransferStats | None = None  # None: no KV connector


@dataclass
class EngineCoreOutput:
    """What one core request gained in one step: raw ids and numbers, no strings."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampledToken] | None  # one per new token when the request asked for logprobs
    finish_reason: str | None  # "stop" (EOS or a stop_token_id), "length"
    stop_reason: int | None  # the stop_token_id that finished it
    num_cached_tokens: int
    metrics: RequestMetrics
    # With the first new token of a request that asked for them: the logprobs of prompt tokens 1..
    prompt_logprobs: list[SampledToken] | None = None
    # When the step gave these tokens (``metrics`` is the request's own object in-process, which a core
    # on a thread may have moved on by the time the front end reads it)
    token_time: float | None = None
    pooled: list[float] | None = None  # a pooling request's vector, with its finish (server/worker/pooler.py)
    # A finished prefill's, for its decode engine (server/core/mooncake_connector.py), with its finish
    kv_transfer_params: dict | None = None


def core_output(request: Request, appended: list[SampledToken]) -> EngineCoreOutput:
    """What a step gave ``request``: its ``appended`` tokens and, once, what it finished with."""
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=[token.token_id for token in appended],
        new_logprobs=appended if request.params.logprobs is not None else None,
        finish_reason=request.finish_reason,
        stop_reason=request.stop_reason,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        metrics=request.metrics,
        # Complete once the first token is sampled, and sent with it, once.
        prompt_logprobs=request.prompt_logprobs if request.num_output_tokens == len(appended) else None,
        token_time=request.metrics.last_token_time,
        pooled=request.pooled,
        kv_transfer_params=request.kv_transfer_params,
    )
