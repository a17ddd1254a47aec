"""asyncio front of the engine: the step loop runs on its own thread so HTTP stays responsive.

Requests reach the thread through a command queue (the engine's state is only ever touched there);
outputs come back to each request's asyncio queue through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedserve.server.config import EngineConfig
from pagedserve.server.engine.llm_engine import (
    EngineStats,
    LLMEngine,
    ParentRequest,
    PromptInput,
    StepError,
)
from pagedserve.server.engine.output import RequestOutput
from pagedserve.server.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve.engine")

LOG_INTERVAL_S = 10.0


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._stats = self.engine.stats()
        self._last_log = (time.monotonic(), 0)

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    async def shutdown(self, grace_seconds: float = 30.0) -> None:
        deadline = time.monotonic() + grace_seconds
        while self._streams and time.monotonic() < deadline and self.is_healthy():
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            await self.abort(request_id)
        self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def stats(self) -> EngineStats:
        return self._stats

    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests -----------------------------------------------------------------------------------

    async def generate(self, prompt: PromptInput, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        if not self.is_healthy():
            raise EngineDeadError("the engine loop is not running")
        parent = self.engine.process_inputs(request_id, prompt, params)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._send("add", parent)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send("abort", request_id)

    async def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def _send(self, command: str, payload: object) -> None:
        self._commands.put((command, payload))
        self._wakeup.set()

    # ---- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            self._drain_commands()
            if not engine.has_unfinished():
                self._stats = engine.stats()
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                outputs = engine.step()
            except StepError as exc:
                for request_id in exc.request_ids:
                    self._fail(request_id, exc)
                continue
            except Exception as exc:  # a bug outside the forward pass: fail everything, keep serving
                logger.exception("engine step raised; aborting all requests")
                for request_id in list(engine.parents):
                    engine.abort_request(request_id)
                    self._fail(request_id, exc)
                continue
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.put(output)
            self._stats = engine.stats()
            self._maybe_log()

    def _drain_commands(self) -> None:
        while True:
            try:
                command, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                assert isinstance(payload, ParentRequest)
                try:
                    self.engine.add(payload)
                except ValueError as exc:
                    self._fail(payload.request_id, exc)
            elif command == "abort":
                assert isinstance(payload, str)
                self.engine.abort_request(payload)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(exc)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        last_time, last_tokens = self._last_log
        if now - last_time < LOG_INTERVAL_S:
            return
        stats = self._stats
        rate = (stats.generation_tokens - last_tokens) / (now - last_time)
        queries = stats.prefix_cache_queries
        hit_rate = stats.prefix_cache_hits / queries if queries else 0.0
        logger.info(
            "engine: generation %.1f tokens/s, running %d, waiting %d, KV usage %.1f%%, "
            "prefix hit rate %.1f%%",
            rate, stats.num_running, stats.num_waiting, 100 * stats.kv_cache_usage, 100 * hit_rate,
        )
        self._last_log = (now, stats.generation_tokens)
