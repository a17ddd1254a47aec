"""The engine core: schedule, execute, update from the output. Token ids in, token ids out; no tokenizer.

One ``step()`` asks the scheduler for a batch (server/core/scheduler.py), has the executor run it
(server/executor/executor.py: model, KV cache, LoRA slots, drafter, tensor-parallel ranks) and hands what
it sampled back to the scheduler, which appends the tokens through the stops on token ids and frees
finished requests' blocks; with ``speculative_config`` the proposer then drafts for the next step
(server/spec_decode/). With async scheduling the next step is launched before a step's tokens are read
back. Each request's gain comes back as an ``EngineCoreOutput``, made into text by
server/engine/output_processor.py in the front end (server/engine/core_proc.py: in another process).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pagedserve.server.config import EngineConfig
from pagedserve.server.core.kv_cache_manager import KVCacheManager, uniform_sliding_window
from pagedserve.server.core.kv_connector import KVConnector, MultiConnector
from pagedserve.server.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.server.engine.core_output import EngineCoreOutput, EngineStats, core_output
from pagedserve.server.engine.core_stats import engine_stats
from pagedserve.server.exceptions import EngineDeadError, RankDiedError, StepError
from pagedserve.server.executor.executor import Executor
from pagedserve.server.lora_request import LoRALoadError, LoRARequest
from pagedserve.server.request import Request
from pagedserve.server.spec_decode.proposer import DraftProposer
from pagedserve.server.worker.model_runner import LaunchedStep

if TYPE_CHECKING:
    from pagedserve.server.core.kv_events import KVEvent
    from pagedserve.server.lora.peft import AdapterWeights

logger = logging.getLogger("pagedserve.engine")

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        if config.served_model_name is None:
            config.served_model_name = config.model or DEFAULT_SERVED_NAME
        self.executor = executor = Executor(config)
        connector = MultiConnector([])
        self.kv = KVCacheManager(
            executor.num_blocks, config.block_size, config.enable_prefix_caching,
            hash_seed=f"{executor.model_path}:{executor.dtype}",
            sliding_window=uniform_sliding_window(executor.model.sliding_windows()),
            enable_kv_events=config.enable_kv_events, on_evict=connector.on_block_evicted,
        )
        connector.connectors = self._kv_connectors()
        max_loras = config.max_loras if executor.lora is not None else 0
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.batched_tokens, max_loras,
                                   config.max_model_len or 0, connector)
        self._check_unloaded = False  # an adapter was unloaded: fail the requests still waiting for it
        spec = config.speculative_config
        self.proposer = DraftProposer(spec, config.max_model_len or 0) if spec is not None else None
        self.async_scheduling = executor.async_scheduling
        self.in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None  # launched, not yet read back
        self.stalled = False  # the last step ran nothing: every request waits (for blocks held for peers)

    def _kv_connectors(self) -> list[KVConnector]:
        """The scheduler's side of each KV connector the config asks for (server/core/kv_connector.py), in
        the order they are asked for a request's tokens; their workers are the executor's, by name."""
        from pagedserve.server.core.mooncake_connector import MooncakeConnector
        from pagedserve.server.core.offloading_connector import OffloadingConnector

        config, connectors = self.config, list[KVConnector]()
        if config.kv_transfer_config is not None:  # prefill/decode disaggregation
            connectors.append(MooncakeConnector(config.kv_transfer_config, self.executor.kv_layouts,
                                                config.block_size, self.kv.sliding_window))
        if self.executor.num_host_blocks:  # the CPU KV tier (the executor sized it: 0 without caching)
            connectors.append(OffloadingConnector(self.executor.num_host_blocks, config.block_size,
                                                  self.kv.full_block_hashes))
        return connectors

    @property
    def model_path(self) -> Path:
        return self.executor.model_path

    @property
    def vocab_size(self) -> int:
        return self.executor.vocab_size

    @property
    def kv_root_hash(self) -> bytes:
        return self.kv.root_hash

    def check_alive(self) -> None:
        """RankDiedError (an EngineDeadError) once a tensor-parallel rank has died."""
        self.executor.check_alive()

    def on_death(self, callback: Callable[[EngineDeadError], None]) -> None:
        """``callback(error)`` from the ranks' watcher when one dies (never called on one rank)."""
        self.executor.on_death(lambda message: callback(RankDiedError(message)))

    def shutdown(self) -> None:
        self.scheduler.close()
        self.executor.shutdown()

    def take_kv_events(self) -> list[KVEvent]:
        """The KV events recorded since the last call (enable_kv_events; else none)."""
        return self.kv.pool.take_events()

    def load_lora(self, lora: LoRARequest) -> AdapterWeights:
        """Read and check an adapter's files (any thread; LoRALoadError with the reason)."""
        return self.executor.load_lora(lora)

    def add_lora(self, lora: LoRARequest, weights: AdapterWeights | None = None) -> None:
        """Register an adapter (``weights`` read already by ``executor.load_lora``, else read here)."""
        self.executor.add_lora(lora, weights)

    def list_loras(self) -> list[LoRARequest]:
        return list(self.executor.registered_loras().values())

    def remove_lora(self, lora_int_id: int) -> None:
        """New requests cannot use it; running ones finish with it, waiting ones fail at the next step."""
        self.executor.remove_lora(lora_int_id)
        self._check_unloaded = True

    def _fail_unloaded(self) -> None:
        """Waiting requests whose adapter was unloaded fail, each alone, with the reason."""
        self._check_unloaded = False
        if gone := self.scheduler.abort_unregistered(self.executor.registered_loras()):
            names = sorted({r.lora_request.lora_name for r in gone if r.lora_request is not None})
            reason = f"LoRA adapter {', '.join(names)} was unloaded before the request ran"
            raise StepError([r.request_id for r in gone], LoRALoadError(reason))

    @property
    def requests(self) -> dict[str, Request]:
        return self.scheduler.requests

    def add_request(self, request: Request) -> None:
        """Queue a request made by server/engine/processor.py (already validated)."""
        if request.seed is not None and not request.params.greedy:
            request.generator = torch.Generator(device=self.executor.device)
            request.generator.manual_seed(request.seed)
        self.scheduler.add(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish these requests (those still known) and return their blocks now."""
        self.scheduler.abort(request_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def step(self) -> list[EngineCoreOutput]:
        if self._check_unloaded:
            self._fail_unloaded()
        if self.in_flight is not None:  # async scheduling: launch the next step, then read this one back
            plan, launched = self.in_flight
            ahead = self.scheduler.schedule_ahead(plan) if launched.device_token_ids is not None else None
            self.in_flight = None
            try:
                self.in_flight = (ahead, self._launch(ahead, launched)) if ahead is not None else None
            except StepError as error:  # the step ahead failed, its requests aborted: the others gain
                error.outputs = self._finish(plan, launched)
                raise
            return self._finish(plan, launched)  # the device runs the step ahead meanwhile
        plan = self.scheduler.schedule()
        self.stalled = plan.empty and not plan.kv_loads
        if plan.connector_meta or plan.kv_loads:  # KV loaded (and stored) by the connectors' workers first
            self._guarded(plan, lambda: self.scheduler.load_kv(plan, self.executor.run_kv_connectors))
        if plan.empty:
            return []
        launched = self._launch(plan, None)
        if self.async_scheduling and self.scheduler.can_run_ahead(plan):
            self.in_flight = (plan, launched)  # read back once the next step is launched
            return []
        return self._finish(plan, launched)

    def _launch(self, plan: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        active_loras = self.scheduler.active_loras() if self.scheduler.max_loras else None
        # Every request's block table as the KV manager keeps it: read there, never copied per step
        return self._guarded(plan, lambda: self.executor.launch(plan, self.kv.req_block_ids, active_loras,
                                                                previous))

    def _guarded(self, plan: SchedulerOutput, run: Callable[[], Any]) -> Any:
        try:
            return run()
        except EngineDeadError:
            raise  # a tensor-parallel rank died: no step can run again
        except Exception as exc:
            self.executor.check_alive()  # a collective failed because a rank died: that is the error
            raise self._fail_step([s.request for s in plan.scheduled], exc) from exc

    def _finish(self, plan: SchedulerOutput, launched: LaunchedStep) -> list[EngineCoreOutput]:
        """Read a launched step's tokens back and hand them to the scheduler."""
        sampled = self._guarded(plan, launched.result)
        if self.proposer is not None:
            self.proposer.record(plan.scheduled, sampled)
        update = self.scheduler.update_from_output(plan, sampled)
        outputs = [core_output(request, tokens) for request, tokens in update.appended]
        if update.failed:
            # Only these fail: the forward pass went well, so the cached prefixes stay (unlike _fail_step),
            # and the other requests' outputs of this step travel with the error to the front end.
            cause = next(iter(update.failed.values()))
            raise StepError(list(update.failed), cause, outputs) from cause
        if self.proposer is not None:
            self.proposer.propose([r for r, _ in sampled if r.request_id in self.requests],
                                  len(self.scheduler.running))
        return outputs

    def _fail_step(self, requests: list[Request], exc: BaseException) -> StepError:
        logger.exception("engine step failed; aborting %d requests", len(requests))
        request_ids = [r.request_id for r in requests]
        self.abort_requests(request_ids)
        # Blocks registered for this step may hold half-written K/V (and host blocks half-copied ones):
        # forget every cached prefix, the connectors' too.
        self.scheduler.reset_prefix_cache()
        return StepError(request_ids, exc)

    def stats(self) -> EngineStats:
        spec = self.proposer.stats if self.proposer is not None else None
        return engine_stats(self.scheduler, self.executor, spec)
