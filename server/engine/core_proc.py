"""The engine core in its own process (vLLM V1's EngineCoreProc): the server's default.

``run_core_process`` is the child's whole life: load the core (server/engine/core.py), say ``Ready`` with
the resolved configuration, then loop: take every message waiting on the pipe (requests, aborts,
adapters), run one step if anything is unfinished, and send its outputs with the statistics and KV
events after it. While idle it blocks on the pipe and reports its statistics once a second. The API's
parsing, templating and streaming then run in the parent, beside the step instead of between steps.

A grammar matcher cannot be pickled, so requests arrive without one and the core compiles its own from
the request's ``structured_outputs`` (the front end's processor has already checked that it compiles).
The child ignores SIGINT and SIGTERM: the server drains on those and then stops the core itself; the
core ends when the parent's end of the pipe closes, whatever killed the parent.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from multiprocessing.connection import Connection
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
    portable,
)
from pagedserve.server.engine.gc_heap import freeze_startup_heap
from pagedserve.server.log import configure_logging

logger = logging.getLogger("pagedserve.engine")

IDLE_REPORT_S = 1.0  # statistics sent this often while nothing runs
STALLED_WAIT_S = 0.005  # a step that ran nothing waits this long for news before the next one


def run_core_process(config: EngineConfig, conn: Connection, log_level: int) -> None:
    """The child process's target (spawned: a fresh interpreter, no state shared with the parent)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(log_level)
    from pagedserve.server.engine.core import EngineCore  # here: torch and the model code

    try:
        core = EngineCore(config)
    except BaseException as exc:
        conn.send(StartupFailed(portable(exc)))
        return
    freeze_startup_heap()
    try:
        CoreLoop(core, conn).run()
    finally:
        core.shutdown()


class CoreLoop:
    def __init__(self, core: Any, conn: Connection) -> None:
        self.core = core
        self.conn = conn
        self._send_lock = threading.Lock()  # the loop and the ranks' watcher thread both send
        self.stopping = False
        self._grammars: Any = None  # the core's own Processor, for grammar matchers (made on first use)
        core.on_death(self._die)
        self.send(Ready(core.config, str(core.model_path), core.vocab_size, core.list_loras(),
                        core.kv.root_hash, core.stats()))

    def send(self, message: Any) -> None:
        with self._send_lock:
            self.conn.send(message)

    def run(self) -> None:
        last_report = time.monotonic()
        while not self.stopping:
            busy = self.core.has_unfinished()
            wait = (STALLED_WAIT_S if self.core.stalled else 0.0) if busy else IDLE_REPORT_S
            if not self._take_messages(timeout=wait):
                return  # the parent is gone
            if self.core.has_unfinished():
                self._step()
            elif time.monotonic() - last_report >= IDLE_REPORT_S:
                # Idle, a prefill engine still frees the blocks its decode engines have read since.
                self.core.scheduler.free_released_kv()
                self.send(StepOutputs([], self.core.stats(), self.core.take_kv_events()))
                last_report = time.monotonic()

    def _take_messages(self, timeout: float) -> bool:
        """Handle every waiting message (waiting up to ``timeout`` for the first); False once the pipe
        has closed."""
        try:
            ready = self.conn.poll(timeout)
            while ready:
                self._handle(self.conn.recv())
                ready = self.conn.poll()
        except (EOFError, OSError):
            return False
        return True

    def _handle(self, message: Any) -> None:
        core = self.core
        if isinstance(message, AddRequests):
            for request in message.requests:
                self._add(request)
        elif isinstance(message, AbortRequests):
            core.abort_requests(message.request_ids)
        elif isinstance(message, AddLoRA):
            try:
                core.add_lora(message.lora)
            except Exception as exc:
                self.send(Reply(message.call_id, portable(exc)))
            else:
                self.send(Reply(message.call_id))
        elif isinstance(message, RemoveLoRA):
            core.remove_lora(message.lora_int_id)
        elif isinstance(message, Shutdown):
            self.stopping = True

    def _add(self, request: Any) -> None:
        try:
            if request.params.structured_outputs is not None:
                constraint = request.params.structured_outputs
                compiled = self._grammar_processor().grammar_compiler.compile(constraint)
                request.grammar = compiled.new_state(constraint.think_gate)
            self.core.add_request(request)
        except Exception as exc:  # the front end checked it: fail the request, never the loop
            logger.exception("the engine core refused request %s", request.request_id)
            self.send(StepOutputs([], self.core.stats(), [], [request.request_id], portable(exc)))

    def _grammar_processor(self) -> Any:
        if self._grammars is None:
            from pagedserve.server.engine.processor import load_tokenizer, make_processor

            self._grammars = make_processor(self.core, load_tokenizer(self.core.config, self.core))
        return self._grammars

    def _step(self) -> None:
        from pagedserve.server.exceptions import EngineDeadError, StepError

        core = self.core
        failed_ids: list[str] = []
        error: BaseException | None = None
        try:
            outputs = core.step()
        except EngineDeadError as exc:
            self._die(exc)
            return
        except StepError as exc:
            outputs, failed_ids, error = exc.outputs, exc.request_ids, exc.__cause__ or exc
        except Exception as exc:  # a bug outside the forward pass: fail everything, keep serving
            logger.exception("engine step raised; aborting all requests")
            outputs, failed_ids, error = [], list(core.requests), exc
            core.abort_requests(failed_ids)
        self.send(StepOutputs(outputs, core.stats(), core.take_kv_events(), failed_ids,
                              portable(error) if error is not None else None))

    def _die(self, error: BaseException) -> None:
        """Tell the parent, then stop (from the loop, or from the ranks' watcher thread)."""
        with contextlib.suppress(OSError):  # the parent may be gone too
            self.send(Fatal(str(error)))
        self.stopping = True
