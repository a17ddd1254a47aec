"""Continuous batching: each step takes running requests first, then waiting ones, within the token
and sequence budgets. Prompts are split into chunks that share a forward pass with decodes; when blocks
run out the newest running request is preempted (its blocks freed, recomputed later), FCFS otherwise.
A decode carrying draft tokens (speculative decoding) takes 1 + drafts tokens; drafts are cut to the
token budget and dropped, never the request, when their blocks do not fit. With LoRA, no more than
``max_loras`` distinct adapters run at once: a waiting request whose adapter would be one too many
waits (others may pass it), as in vLLM's scheduler.

KV from outside the device pool comes through the KV connector interface (server/core/kv_connector.py), as
in vLLM V1: a waiting request's prompt tokens past its own prefix-cache hits that a connector supplies (the
CPU KV tier's blocks, or a prefill engine's for a disaggregated decode) get blocks with the rest and count
as computed; the step's transfers travel with the batch as ``connector_meta`` and are made by the workers
before it runs (``load_kv``); a request whose load failed leaves the step and computes its prompt itself.
A finished request's blocks may be kept by a connector for a peer engine, and come back when it is done.

After the step ran, ``update_from_output`` applies what it sampled (vLLM V1's Scheduler does both): each
request's tokens are appended through the stops (server/core/stops.py), a grammar takes each token first,
a pooling request whose prompt ended finishes with its vector, finished requests leave with their blocks,
and the token counters the metrics report advance.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.server.core.kv_cache_manager import KVCacheManager
from pagedserve.server.core.kv_connector import ConnectorMetadata, ConnectorResults, MultiConnector
from pagedserve.server.core.stops import append_token
from pagedserve.server.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedserve.server.outputs import SampledToken


# What a step sampled, per request: its new tokens (one, or accepted drafts and one more), or the error
# its row alone raised (server/worker/model_runner.py StepResult)
Sampled = Sequence[tuple[Request, "list[SampledToken] | Exception"]]


@dataclass
class ScheduledRequest:
    request: Request
    # tokens computed this step, starting at request.num_computed_tokens, drafts included
    num_new_tokens: int
    # Draft tokens verified this step, after the last known token (server/spec_decode/rejection_sampler.py)
    spec_token_ids: list[int] = field(default_factory=list)
    # Async scheduling: tokens of this request the step in flight is computing still; this step's chunk
    # starts after them, its first token being the one that step samples (``schedule_ahead``)
    num_in_flight: int = 0

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the last known token, so the step samples a new one."""
        num_known = self.num_new_tokens - len(self.spec_token_ids)
        return self.request.num_computed_tokens + num_known == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # The KV connectors' transfers of this step, by connector name, made before its forward pass
    connector_meta: ConnectorMetadata = field(default_factory=dict)
    # Requests admitted with tokens a connector loads this step, and their own prefix hits' token count
    kv_loads: list[tuple[Request, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepUpdate:
    """What ``update_from_output`` made of a step: each request's appended tokens, and the requests whose
    row failed alone (already aborted), with their errors."""

    appended: list[tuple[Request, list[SampledToken]]] = field(default_factory=list)
    failed: dict[str, Exception] = field(default_factory=dict)


def _runs_ahead(item: ScheduledRequest) -> bool:
    request = item.request
    return (
        item.num_new_tokens == 1
        and not item.spec_token_ids
        and item.completes_sequence
        and request.grammar is None
        and request.prompt_logprobs is None
        and request.pooling is None
        and not request.params.reads_own_output
    )


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_loras: int = 0,
        max_model_len: int = 0, connector: MultiConnector | None = None,
    ) -> None:
        """``max_loras``: the most distinct LoRA adapters running at once (0: LoRA is off).
        ``max_model_len``: a sequence that reaches it stops ("length"). ``connector``: the KV connectors
        (server/core/kv_connector.py; None: none)."""
        self.kv = kv
        self.connector = connector if connector is not None else MultiConnector([])
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_steps_ahead = 0  # steps scheduled by schedule_ahead (async scheduling)
        self.prompt_tokens = 0  # of requests that got their first token
        self.generation_tokens = 0
        self.lora_requests_finished: dict[str, int] = {}  # adapter name -> requests finished

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.free_released_kv()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.connector_meta = self.connector.build_connector_meta()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._drafts_that_fit(request, num_new, budget)
            while not self.kv.allocate(request, num_new + len(drafts)):
                if drafts:  # drafts are dropped before anyone is preempted
                    drafts = []
                    continue
                if self._evict_held():  # a finished prefill's blocks go before a running request's
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new + len(drafts), drafts))
                budget -= num_new + len(drafts)
                index += 1
        return budget

    @staticmethod
    def _drafts_that_fit(request: Request, num_new: int, budget: int) -> list[int]:
        """A decode's drafts (server/spec_decode/proposer.py), cut to the token budget's room."""
        if num_new != 1 or not request.spec_token_ids:
            return []
        return request.spec_token_ids[: budget - 1]

    def active_loras(self) -> set[int]:
        """The adapters of the running requests: they keep their device slots (server/lora/manager.py)."""
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        loras = self.active_loras() if self.max_loras else set()
        skipped: list[Request] = []  # waiting for a LoRA slot: they keep their place in the queue
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            lora_id = request.lora_int_id
            if self.max_loras and lora_id and lora_id not in loras and len(loras) >= self.max_loras:
                skipped.append(self.waiting.popleft())  # vLLM's rule: at most max_loras adapters at once
                continue
            cached = self.kv.find_cached_prefix(request)
            num_cached = len(cached) * self.kv.block_size
            num_external = self.connector.get_num_new_matched_tokens(request, num_cached)
            num_computed = num_cached + num_external
            num_new = min(request.num_tokens - num_computed, budget)
            # Blocks a connector fills are not findable by others until the load is made (``load_kv``).
            if not self.kv.allocate(request, num_external + num_new, cached, cache=not num_external):
                if self._evict_held():
                    continue
                break  # FCFS: nobody overtakes the head of the queue (but requests for a LoRA slot)
            self.waiting.popleft()
            if lora_id:
                loras.add(lora_id)
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:  # as vLLM counts them: a connector's tokens too
                request.num_cached_tokens = num_computed
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.time()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if num_external:
                self.connector.update_state_after_alloc(request, self.kv.block_ids(request.request_id),
                                                        num_cached, num_external)
                out.kv_loads.append((request, num_cached))
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    # ---- the KV connectors (server/core/kv_connector.py) --------------------------------------------

    def load_kv(self, plan: SchedulerOutput, run: Callable[[ConnectorMetadata], ConnectorResults]) -> None:
        """Make the plan's connector transfers (``run``: the executor's, every rank's workers) before it
        runs. A request whose load failed leaves this step and computes its prompt from its own cached
        prefix in the next ones; one whose load was made has its blocks findable as cached."""
        results = run(plan.connector_meta) if plan.connector_meta else {}
        failed = self.connector.update_connector_output(results)
        for request, num_local_tokens in plan.kv_loads:
            if request.request_id in failed:
                request.num_computed_tokens = num_local_tokens
                request.num_cached_tokens = min(request.num_cached_tokens, num_local_tokens)
                plan.scheduled = [item for item in plan.scheduled if item.request is not request]
            else:
                self.kv.cache_blocks(request)
        plan.connector_meta, plan.kv_loads = {}, []

    def free_released_kv(self) -> None:
        """Free the blocks connectors kept for peers that are done with them (or never came)."""
        for blocks in self.connector.take_freeable():
            self.kv.release(blocks)

    def _evict_held(self) -> bool:
        """Free the oldest blocks a connector keeps that no peer is reading, for a request that does not
        fit; False when there are none."""
        blocks = self.connector.evict_held()
        if blocks is None:
            return False
        self.kv.release(blocks)
        return True

    def _free_or_keep(self, request: Request, status: RequestStatus) -> None:
        """Return a finished request's blocks, unless a connector keeps them for a peer engine (its
        response then carries the ``kv_transfer_params`` saying where they are). Not an aborted one's, nor
        blocks the sliding window already replaced."""
        if status is not RequestStatus.FINISHED_ABORTED and self.connector.connectors and (
            (blocks := self.kv.detach(request)) is not None
        ):
            request.kv_transfer_params = self.connector.request_finished(request, blocks)
            if request.kv_transfer_params is None:
                self.kv.release(blocks)
            return
        self.kv.free(request)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request wherever it is and return its blocks."""
        request.status = status
        known = self.requests.pop(request.request_id, None) is not None
        if known and request.lora_request is not None:
            name = request.lora_request.lora_name
            self.lora_requests_finished[name] = self.lora_requests_finished.get(name, 0) + 1
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if known:
            self._free_or_keep(request, status)
        else:
            self.kv.free(request)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block: the device pool's and those the connectors could load."""
        self.kv.reset_prefix_cache()
        self.connector.reset_cache()

    def close(self) -> None:
        """Stop what the connectors run beside the engine (a side channel's port is free again)."""
        self.connector.close()

    def abort(self, request_ids: list[str]) -> None:
        """Finish these requests (those still known) and return their blocks now."""
        now = time.time()
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self.finish(request, RequestStatus.FINISHED_ABORTED)
                request.metrics.finished_time = now

    def abort_unregistered(self, registered: Collection[int]) -> list[Request]:
        """Abort the waiting requests whose LoRA adapter is no longer ``registered``; returns them."""
        gone = [r for r in self.waiting if r.lora_int_id and r.lora_int_id not in registered]
        self.abort([r.request_id for r in gone])
        return gone

    # ---- async scheduling ---------------------------------------------------------------------------

    def can_run_ahead(self, plan: SchedulerOutput) -> bool:
        """Whether the step after ``plan`` can be scheduled before ``plan``'s tokens are known: nothing waits
        to be admitted, and every request of it decodes its last known token with logits that do not depend
        on what it generated before (no grammar, penalty, bad word, min_tokens, draft, prompt logprobs)."""
        return not self.waiting and bool(plan.scheduled) and all(
            _runs_ahead(item) for item in plan.scheduled
        )

    def schedule_ahead(self, in_flight: SchedulerOutput) -> SchedulerOutput | None:
        """The next step while ``in_flight`` still runs (vLLM's async scheduling), or None where it needs
        ``in_flight``'s tokens first (``can_run_ahead``, or the blocks do not fit: then the ordinary
        ``schedule`` decides, preemption included). Each request decodes the token ``in_flight`` samples
        for it, unless that token is its last by length; one that the token stops (EOS, a stop token, a
        stop string in the front end) gets one row computed in vain, whose token ``update_from_output``
        drops. The same requests in the same order as ``schedule`` would run them, so outputs are equal."""
        if not self.can_run_ahead(in_flight):
            return None
        out = SchedulerOutput()
        for item in in_flight.scheduled:
            request = item.request
            if request.finished:  # aborted since
                continue
            num_after = request.num_tokens + 1  # with the token in flight
            if request.num_output_tokens + 1 >= request.max_tokens or (
                self.max_model_len and num_after >= self.max_model_len
            ):
                continue
            if not self.kv.allocate(request, 2):  # the token in flight and the next one
                return None
            out.scheduled.append(ScheduledRequest(request, 1, num_in_flight=1))
        if not out.scheduled:
            return None
        # Nothing to transfer: only running requests decode, and the CPU KV tier (whose evictions store)
        # turns async scheduling off (server/executor/executor.py).
        out.connector_meta = self.connector.build_connector_meta()
        assert not out.connector_meta, "a step scheduled ahead cannot wait for KV transfers"
        self.num_steps_ahead += 1
        return out

    # ---- after the step -----------------------------------------------------------------------------

    def update_from_output(self, plan: SchedulerOutput, sampled: Sampled) -> StepUpdate:
        """Apply a step's sampled tokens; finished requests leave. A request whose row failed, or whose
        grammar refused its token, is aborted alone and named in ``failed``."""
        for item in plan.scheduled:
            # Drafts count as computed only once accepted, below: a rejected draft's KV slot is rewritten.
            item.request.num_computed_tokens += item.num_new_tokens - len(item.spec_token_ids)
            item.request.spec_token_ids = []
        now = time.time()
        update = StepUpdate()
        for request, tokens in sampled:
            if request.finished:  # under async scheduling: stopped or aborted while this step ran
                continue
            appended = tokens if isinstance(tokens, Exception) else self._append_tokens(request, tokens, now)
            if isinstance(appended, Exception):
                update.failed[request.request_id] = appended
                continue
            if request.finished:
                self.finish(request, request.status)
            update.appended.append((request, appended))
        if update.failed:
            self.abort(list(update.failed))
        return update

    def _append_tokens(self, request: Request, tokens: list[SampledToken],
                       now: float) -> list[SampledToken] | Exception:
        """Append a step's tokens in order until one of them finishes the request; those after it are
        dropped. Accepted drafts count as computed (their KV was written while verifying them)."""
        if not request.output_token_ids:
            self.prompt_tokens += len(request.prompt_token_ids)
        if request.pooling is not None:  # its vector is its output (server/worker/pooler.py): done
            request.metrics.first_token_time = request.metrics.last_token_time = now
            request.status = RequestStatus.FINISHED_STOPPED
            return []
        if len(tokens) == 1 and request.grammar is None:  # most rows: one token, no grammar to consult
            self.generation_tokens += 1
            append_token(request, tokens[0].token_id, now, self.max_model_len)
            return tokens
        appended: list[SampledToken] = []
        for token in tokens:
            if appended:
                request.num_computed_tokens += 1  # the previous token was an accepted draft
            if request.grammar is not None and not request.grammar.accept(token.token_id):
                if not request.output_token_ids:  # nothing appended: its prompt is not counted yet
                    self.prompt_tokens -= len(request.prompt_token_ids)
                return RuntimeError(f"the grammar refused token {token.token_id}: {request.grammar.error}")
            appended.append(token)
            self.generation_tokens += 1
            if append_token(request, token.token_id, now, self.max_model_len):
                break
        return appended
