"""The one check that an engine holds nothing once its requests are done: no request in flight, in the
scheduler or the front end, and every KV block back in the pool (but a sliding window's null block, which
the KV manager holds for good)."""

from __future__ import annotations

from typing import Any


def assert_no_leak(engine: Any) -> None:
    """``engine``: an ``LLMEngine`` (``LLM(...).engine``) whose requests have all finished or been aborted."""
    core = engine.core
    assert core.in_flight is None, "a step is still in flight"
    assert not core.scheduler.has_unfinished() and not core.kv.req_blocks, "requests still scheduled"
    pool = core.kv.pool
    reserved = 1 if core.kv.null_block is not None else 0
    assert pool.num_free_blocks == pool.num_blocks - reserved, "blocks still referenced"
    assert not engine.output_processor.requests, "requests still in the front end"
