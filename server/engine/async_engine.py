"""asyncio front of the engine (vLLM's AsyncLLM): the core steps on its own thread, everything that
needs the tokenizer runs on the event loop.

Requests are checked on the loop (server/engine/processor.py) and reach the thread through a command
queue; the core's state is only ever touched there. After each step the thread hands the whole batch of
core outputs back with one ``call_soon_threadsafe``; the output processor turns it into RequestOutputs
on the loop and puts each into its request's asyncio queue. A stream that is closed before its request
finished aborts it, so its KV blocks return within one step.

With ``enable_kv_events`` the thread takes the KV events each step recorded (a list swap) and hands them
over the same way, to the publisher that serves GET /v1/kv_events (server/core/kv_events.py).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from pagedserve.server.core.kv_events import KVEventPublisher
from pagedserve.server.engine.core_output import EngineCoreOutput, EngineStats
from pagedserve.server.engine.output_processor import OutputProcessor
from pagedserve.server.engine.processor import (
    ProcessedRequest,
    Processor,
    PromptInput,
    load_tokenizer,
    make_processor,
)
from pagedserve.server.exceptions import EngineDeadError, StepError
from pagedserve.server.lora_request import LoRARequest
from pagedserve.server.outputs import RequestOutput
from pagedserve.server.pooling_params import PoolingParams
from pagedserve.server.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedserve.server.config import EngineConfig
    from pagedserve.server.engine.core import EngineCore

logger = logging.getLogger("pagedserve.engine")

LOG_INTERVAL_S = 10.0
_END = None  # put in a request's queue: the stream ends without a final output (aborted)


class RequestStream:
    """One request's outputs; ``aclose`` before the last one aborts the request.

    A consumer that falls behind gets what piled up as one output, as vLLM V1's RequestOutputCollector
    gives it: deltas folded together (``RequestOutput.add``), a cumulative output replaced by the latest.
    Under load a stream then costs the API one chunk per wake-up, not one per token."""

    def __init__(self, engine: AsyncEngine, request: ProcessedRequest) -> None:
        self.request_id = request.request_id
        self.prompt_token_ids = request.prompt_token_ids
        self.max_tokens = request.max_tokens
        self.queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()
        self._delta = request.params.output_kind == RequestOutputKind.DELTA
        self._held: list[RequestOutput | BaseException | None] = []  # taken from the queue, not yet given
        self._engine = engine
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = self._held.pop() if self._held else await self.queue.get()
        if isinstance(item, RequestOutput):
            item = self._fold_waiting(item)
        if item is _END:
            self._finish(abort=False)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._finish(abort=False)
            raise item
        if item.finished:
            self._finish(abort=False)
        return item

    def _fold_waiting(self, output: RequestOutput) -> RequestOutput:
        """``output`` with the outputs queued behind it folded in; an end or an error stays held."""
        while not output.finished and not self.queue.empty():
            later = self.queue.get_nowait()
            if not isinstance(later, RequestOutput):
                self._held.append(later)
                break
            if self._delta:
                output.add(later)
            else:
                output = later
        return output

    async def aclose(self) -> None:
        self._finish(abort=True)

    def _finish(self, abort: bool) -> None:
        if not self._done:
            self._done = True
            self._engine._release(self.request_id, abort)


class AsyncEngine:
    """The real ``EngineClient`` (server/engine/protocol.py)."""

    def __init__(
        self,
        core: EngineCore,
        tokenizer: Any,
        processor: Processor,
        kv_events: KVEventPublisher | None = None,
    ) -> None:
        self.core = core
        self.kv_events = kv_events  # None: KV events are off
        self._tokenizer = tokenizer
        self.processor = processor
        self.output_processor = OutputProcessor(tokenizer)
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._stats = core.stats()
        self._last_log = (time.monotonic(), 0)
        # Set once the engine cannot go on (a tensor-parallel rank died); on_fatal(error) is then called
        # once, from whichever thread noticed: the server uses it to exit (server/api/cli.py).
        self.fatal_error: EngineDeadError | None = None
        self.on_fatal: Callable[[EngineDeadError], None] | None = None
        self._fatal_lock = threading.Lock()  # the watcher and the engine thread may both notice
        core.on_death(self._die)

    @classmethod
    def from_config(cls, config: EngineConfig, core_process: bool = False) -> AsyncEngine:
        """Load the model and its tokenizer: in a process of its own (server/engine/core_client.py) or
        here, stepped on this engine's thread (server/engine/core.py)."""
        from pagedserve.server.engine.core_client import make_core

        core = make_core(config, core_process)
        tokenizer = load_tokenizer(config, core)
        kv_events = None
        if config.enable_kv_events:
            kv_events = KVEventPublisher(config.block_size, core.kv_root_hash)
        return cls(core, tokenizer, make_processor(core, tokenizer), kv_events)

    # ---- facts --------------------------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model_path(self) -> str:
        return str(self.core.model_path)

    @property
    def served_model_name(self) -> str:
        return str(self.core.config.served_model_name)

    @property
    def max_model_len(self) -> int:
        return self.processor.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.processor.max_num_seqs

    @property
    def vocab_size(self) -> int:
        return self.processor.vocab_size

    def sampling_params(self, **fields: Any) -> SamplingParams:
        return self.processor.sampling_params(**fields)

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    async def shutdown(self, grace_seconds: float = 30.0) -> None:
        deadline = time.monotonic() + grace_seconds
        while self._streams and time.monotonic() < deadline and self.is_healthy():
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            await self.abort(request_id)
        if self.kv_events is not None:
            self.kv_events.close()
        self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
        await asyncio.to_thread(self.core.shutdown)  # the other tensor-parallel ranks

    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def stats(self) -> EngineStats:
        return self._stats

    # ---- requests -----------------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | PoolingParams,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        if not self.is_healthy():
            raise EngineDeadError("the engine loop is not running")
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:  # image decoding and resizing: CPU work
            prompt = await asyncio.to_thread(self.processor.process_images, prompt)
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            # A first compile may take up to its deadline (server/structured_output/compiler.py): done off
            # the loop, so other streams keep flowing; process() below then finds it in the cache. Only the
            # compile moves: tokenizing stays on the loop, the one thread that uses the HF tokenizer.
            await asyncio.to_thread(self.processor.grammar_compiler.compile, params.structured_outputs)
        request = self.processor.process(request_id, prompt, params, lora_request=lora_request)
        self.output_processor.add_request(request)  # refuses a request_id in use
        stream = self._streams[request_id] = RequestStream(self, request)
        self._send("add", request.children)
        return stream

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params, lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    # ---- LoRA adapters (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter) ------------------

    def list_loras(self) -> list[LoRARequest]:
        return list(self.processor.lora_requests.values())

    def lora_named(self, name: str) -> LoRARequest:
        return self.processor.lora_named(name)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check the adapter off the loop (LoRALoadError with the reason), then hand it to the
        core; requests may name it as soon as this returns (the core gets it before their "add")."""
        # A taken name or id is refused before any reading.
        with self.processor.registering_lora(lora_request):
            weights = await asyncio.to_thread(self.core.load_lora, lora_request)
        self._send("add_lora", (lora_request, weights))

    async def remove_lora(self, lora_name: str) -> LoRARequest:
        """KeyError for an unknown name. Running requests finish with the adapter; waiting ones fail."""
        lora_request = self.processor.unregister_lora(lora_name)
        self._send("remove_lora", lora_request.lora_int_id)
        return lora_request

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        self._release(request_id, abort=True)
        if stream is not None:
            stream.queue.put_nowait(_END)

    def _release(self, request_id: str, abort: bool) -> None:
        """Forget a request's stream; ``abort``: stop it in the front end and the core too."""
        self._streams.pop(request_id, None)
        if abort:
            core_ids = self.output_processor.abort_request(request_id)
            if core_ids:
                self._send("abort", core_ids)

    def _send(self, command: str, payload: Any) -> None:
        self._commands.put((command, payload))
        self._wakeup.set()

    # ---- on the event loop: one call per engine step ------------------------------------------------

    def _on_step(self, core_outputs: list[EngineCoreOutput]) -> None:
        try:
            processed = self.output_processor.process_outputs(core_outputs)
        except Exception as exc:  # a bug in the front end: fail the requests, never leave a stream waiting
            logger.exception("processing the engine's outputs failed; failing all requests")
            for stream in list(self._streams.values()):
                self._release(stream.request_id, abort=True)
                stream.queue.put_nowait(exc)
            return
        if processed.to_abort:
            self._send("abort", processed.to_abort)
        for output in processed.request_outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.queue.put_nowait(output)

    def _on_step_failed(self, core_ids: list[str], exc: BaseException) -> None:
        """The core aborted these samples; fail their whole requests (and only theirs)."""
        for request_id in self.output_processor.requests_of(core_ids):
            stream = self._streams.get(request_id)
            self._release(request_id, abort=True)  # the request's other samples too
            if stream is not None:
                stream.queue.put_nowait(exc)

    # ---- the engine thread --------------------------------------------------------------------------

    def _die(self, error: EngineDeadError) -> None:
        """The engine cannot go on: fail every stream, stop the loop, tell the server (any thread)."""
        with self._fatal_lock:
            if self.fatal_error is not None:
                return
            self.fatal_error = error
        logger.error("the engine cannot go on: %s", error)
        self._stopping.set()
        self._wakeup.set()
        if self._loop is not None:
            self._to_loop(self._fail_all_streams, error)
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _fail_all_streams(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            self._release(stream.request_id, abort=False)
            stream.queue.put_nowait(error)

    def _run(self) -> None:
        try:
            self._loop_steps()
        except EngineDeadError as exc:
            self._die(exc)

    def _loop_steps(self) -> None:
        core = self.core
        while not self._stopping.is_set():
            core.check_alive()
            self._drain_commands()
            self._hand_over_kv_events()
            if not core.has_unfinished():
                self._stats = core.stats()
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                core_outputs = core.step()
            except EngineDeadError:
                raise
            except StepError as exc:
                if exc.outputs:  # the step's requests that did not fail
                    self._to_loop(self._on_step, exc.outputs)
                self._to_loop(self._on_step_failed, exc.request_ids, exc)
                continue
            except Exception as exc:  # a bug outside the forward pass: fail everything, keep serving
                logger.exception("engine step raised; aborting all requests")
                request_ids = list(core.requests)
                core.abort_requests(request_ids)
                self._to_loop(self._on_step_failed, request_ids, exc)
                continue
            self._stats = core.stats()
            if core_outputs:
                self._to_loop(self._on_step, core_outputs)
            self._maybe_log()

    def _hand_over_kv_events(self) -> None:
        """The events of the last step (or of a reset), in one batch to the publisher on the loop."""
        if self.kv_events is not None:
            events = self.core.take_kv_events()
            if events:
                self._to_loop(self.kv_events.publish, events)

    def _to_loop(self, callback: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop has closed: nobody is left to tell
            self._stopping.set()

    def _drain_commands(self) -> None:
        while True:
            try:
                command, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                for request in payload:
                    try:
                        self.core.add_request(request)
                    except Exception as exc:  # the front end checked it; fail the request, never the loop
                        logger.exception("the engine core refused request %s", request.request_id)
                        self._to_loop(self._on_step_failed, [request.request_id], exc)
            elif command == "abort":
                self.core.abort_requests(payload)
            elif command == "add_lora":
                self.core.add_lora(*payload)
            elif command == "remove_lora":
                self.core.remove_lora(payload)

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
            rate,
            stats.num_running,
            stats.num_waiting,
            100 * stats.kv_cache_usage,
            100 * hit_rate,
        )
        self._last_log = (now, stats.generation_tokens)
