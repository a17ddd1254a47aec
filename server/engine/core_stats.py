"""The engine's statistics (server/engine/core_output.py ``EngineStats``), read off the scheduler, the KV
cache and the executor after a step: what /metrics and the periodic log report (server/api/metrics.py)."""

from __future__ import annotations

from collections.abc import Iterable

from pagedserve.server.core.mooncake_connector import MooncakeConnector
from pagedserve.server.core.offloading_connector import OffloadingConnector
from pagedserve.server.core.scheduler import Scheduler
from pagedserve.server.engine.core_output import EngineStats, KVOffloadStats, KVTransferStats, LoRAStats
from pagedserve.server.executor.executor import Executor
from pagedserve.server.request import Request
from pagedserve.server.spec_decode.metrics import SpecDecodingStats


def engine_stats(scheduler: Scheduler, executor: Executor, spec: SpecDecodingStats | None) -> EngineStats:
    kv = scheduler.kv
    mooncake = scheduler.connector.find(MooncakeConnector)
    offloading = scheduler.connector.find(OffloadingConnector)
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        kv_cache_usage=kv.usage(),
        prefix_cache_queries=kv.prefix_queries,
        prefix_cache_hits=kv.prefix_hits,
        kv_offload=_kv_offload_stats(offloading, executor.block_bytes) if offloading is not None else None,
        num_preemptions=scheduler.num_preemptions,
        prompt_tokens=scheduler.prompt_tokens,
        generation_tokens=scheduler.generation_tokens,
        num_gpu_blocks=executor.num_blocks,
        block_size=kv.block_size,
        spec_decoding=spec.snapshot() if spec is not None else None,
        lora=_lora_stats(scheduler, executor.config.max_loras) if executor.lora is not None else None,
        kv_transfer=_kv_transfer_stats(mooncake) if mooncake is not None else None,
    )


def _kv_transfer_stats(connector: MooncakeConnector) -> KVTransferStats:
    return KVTransferStats(
        queries=connector.queries, hits=connector.hits, bytes_received=connector.bytes_received,
        transfer_seconds=connector.transfer_seconds, num_transfers=connector.num_transfers,
        num_failed=connector.num_failed, num_held_requests=connector.num_held_requests,
        num_expired=connector.num_expired,
    )


def _lora_stats(scheduler: Scheduler, max_loras: int) -> LoRAStats:
    return LoRAStats(
        max_lora=max_loras,
        running=_adapter_names(scheduler.running),
        waiting=_adapter_names(scheduler.waiting),
        requests_finished=dict(scheduler.lora_requests_finished),
    )


def _kv_offload_stats(connector: OffloadingConnector, block_bytes: int) -> KVOffloadStats:
    tier = connector.tier
    return KVOffloadStats(
        num_cpu_blocks=tier.num_blocks,
        cpu_cache_usage=tier.usage(),
        queries=connector.queries,
        hits=connector.hits,
        store_bytes=tier.num_stored * block_bytes,
        load_bytes=tier.num_loaded * block_bytes,
    )


def _adapter_names(requests: Iterable[Request]) -> list[str]:
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
