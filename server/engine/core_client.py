"""The front end's handle on an engine core in another process (vLLM V1's background EngineCoreClient).

``CoreProcessClient`` starts server/engine/core_proc.py in a spawned process and offers the async engine
(server/engine/async_engine.py) the same methods as an in-process ``EngineCore``: requests, aborts and
adapters go out as messages (server/engine/core_messages.py); ``step()`` hands back the next step's
outputs as they arrive, raising the ``StepError`` of the requests that failed in it. A reader thread
takes every message off the pipe, so adapter replies and the statistics arrive while no step is awaited.

The core process dying (killed, out of memory, a rank lost) closes the pipe: the reader sees it at
once and calls ``on_death``, which fails every stream and stops the server, as a tensor-parallel rank's
death does; ``check_alive`` and ``step`` raise ``EngineDeadError`` from then on.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from pagedserve.server.config import EngineConfig
from pagedserve.server.engine.core_messages import (
    AbortRequests,
    AddLoRA,
    AddRequests,
    Fatal,
    Ready,
    RemoveLoRA,
    Reply,
    Shutdown,
    StartupFailed,
    StepOutputs,
)
from pagedserve.server.engine.core_output import EngineCoreOutput, EngineStats
from pagedserve.server.exceptions import EngineDeadError, StepError
from pagedserve.server.lora_request import LoRARequest
from pagedserve.server.request import Request

logger = logging.getLogger("pagedserve.engine")

STEP_WAIT_S = 0.05  # step() returns empty after this, so the engine thread takes new commands
STOP_WAIT_S = 10.0
_GONE = object()  # put in the outputs queue once the core process has ended


def make_core(config: EngineConfig, core_process: bool) -> Any:
    """The engine core both front ends drive: in a process of its own (``CoreProcessClient``) or here
    (server/engine/core.py's ``EngineCore``, imported only then: it loads torch and the model code)."""
    if core_process:
        return CoreProcessClient(config)
    from pagedserve.server.engine.core import EngineCore

    return EngineCore(config)


class CoreProcessClient:
    def __init__(self, config: EngineConfig) -> None:
        """Start the core process and wait until it has loaded the model; its start-up error, if any,
        is raised here. ``config`` takes the values the core resolved (as an in-process core writes)."""
        from pagedserve.server.engine.core_proc import run_core_process

        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        # Not a daemon: the core starts tensor-parallel ranks of its own.
        self.process = context.Process(target=run_core_process, name="engine-core",
                                       args=(config, child_conn, logging.getLogger().getEffectiveLevel()))
        self.process.start()
        child_conn.close()
        ready = self._await_ready()
        for item in dataclasses.fields(config):
            setattr(config, item.name, getattr(ready.config, item.name))
        self.config = config
        self.model_path = Path(ready.model_path)
        self.vocab_size = ready.vocab_size
        self.kv_root_hash = ready.kv_root_hash
        self._loras = {lora.lora_int_id: lora for lora in ready.loras}
        self._stats = ready.stats
        self.requests: dict[str, None] = {}  # sent and not yet finished, failed or aborted
        self._outputs: queue.SimpleQueue[StepOutputs | object] = queue.SimpleQueue()
        self._replies: dict[int, Future[None]] = {}
        self._call_ids = itertools.count()
        self._kv_events: list[Any] = []
        self._events_lock = threading.Lock()
        self._send_lock = threading.Lock()  # the event loop, the engine thread and adapter loads send
        self._stopping = False
        self._on_death: Callable[[EngineDeadError], None] | None = None
        self.dead: EngineDeadError | None = None
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()
        # Before multiprocessing's own exit handler, which would wait forever for a core still serving
        atexit.register(self.shutdown)

    def _await_ready(self) -> Ready:
        try:
            message = self._conn.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"the engine core process exited while starting (exit code "
                               f"{self.process.exitcode}); see its log above") from None
        if isinstance(message, StartupFailed):
            self.process.join()
            raise message.error
        assert isinstance(message, Ready), message
        return message

    # ---- the reader thread --------------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, StepOutputs):
                    with self._events_lock:
                        self._kv_events.extend(message.kv_events)
                    self._stats = message.stats
                    if message.outputs or message.failed_ids:  # not the idle reports: nobody awaits those
                        self._outputs.put(message)
                elif isinstance(message, Reply):
                    self._answer(message)
                elif isinstance(message, Fatal):
                    self._gone(EngineDeadError(message.message))
                    return
        except (EOFError, OSError):
            if self._stopping:
                return
            self.process.join(timeout=1.0)
            self._gone(EngineDeadError(
                f"the engine core process ended (exit code {self.process.exitcode})"))

    def _answer(self, reply: Reply) -> None:
        future = self._replies.pop(reply.call_id, None)
        if future is None:
            return
        if reply.error is not None:
            future.set_exception(reply.error)
        else:
            future.set_result(None)

    def _gone(self, error: EngineDeadError) -> None:
        if self.dead is not None:
            return
        self.dead = error
        self._outputs.put(_GONE)
        for future in list(self._replies.values()):
            future.set_exception(error)
        self._replies.clear()
        if self._on_death is not None:
            self._on_death(error)

    # ---- what the async engine calls ----------------------------------------------------------------

    def _send(self, message: Any) -> None:
        if self.dead is not None:
            raise self.dead
        with self._send_lock:
            self._conn.send(message)

    def on_death(self, callback: Callable[[EngineDeadError], None]) -> None:
        self._on_death = callback

    def check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = None
        # The matcher stays here (it does not pickle); the core makes its own from the params.
        self._send(AddRequests([dataclasses.replace(request, grammar=None)]))

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)
        self._send(AbortRequests(request_ids))

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[EngineCoreOutput]:
        """The next step's outputs ([] if none came within STEP_WAIT_S); StepError for its failures."""
        try:
            message = self._outputs.get(timeout=STEP_WAIT_S)
        except queue.Empty:
            return []
        if message is _GONE:
            assert self.dead is not None
            raise self.dead
        assert isinstance(message, StepOutputs)
        for output in message.outputs:
            if output.finish_reason is not None:
                self.requests.pop(output.request_id, None)
        if message.failed_ids:
            for request_id in message.failed_ids:
                self.requests.pop(request_id, None)
            assert message.error is not None
            raise StepError(message.failed_ids, message.error, message.outputs)
        return message.outputs

    def stats(self) -> EngineStats:
        return self._stats

    def take_kv_events(self) -> list[Any]:
        with self._events_lock:
            events, self._kv_events = self._kv_events, []
        return events

    def list_loras(self) -> list[LoRARequest]:
        return list(self._loras.values())

    def load_lora(self, lora: LoRARequest) -> None:
        """Have the core read and register the adapter; its LoRALoadError is raised here (any thread)."""
        future: Future[None] = Future()
        call_id = next(self._call_ids)
        self._replies[call_id] = future
        self._send(AddLoRA(call_id, lora))
        future.result()
        self._loras[lora.lora_int_id] = lora

    def add_lora(self, lora: LoRARequest, weights: Any = None) -> None:
        """Registered by ``load_lora`` already, in the core."""

    def remove_lora(self, lora_int_id: int) -> None:
        self._loras.pop(lora_int_id, None)
        self._send(RemoveLoRA(lora_int_id))

    def shutdown(self) -> None:
        """Ask the core to stop; it is killed if it has not within STOP_WAIT_S. Once is enough."""
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.shutdown)
        if self.process.is_alive():
            with contextlib.suppress(EngineDeadError, OSError):
                self._send(Shutdown())
            self.process.join(STOP_WAIT_S)
        if self.process.is_alive():
            logger.warning("the engine core process did not stop within %.0f s: killing it", STOP_WAIT_S)
            self.process.kill()
            self.process.join()
        self._conn.close()
