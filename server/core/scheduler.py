"""Continuous batching: each step takes running requests first, then waiting ones, within the token
and sequence budgets. Prompts are split into chunks that share a forward pass with decodes; when blocks
run out the newest running request is preempted (its blocks freed, recomputed later), FCFS otherwise.
A decode carrying draft tokens (speculative decoding) takes 1 + drafts tokens; drafts are cut to the
token budget and dropped, never the request, when their blocks do not fit. With LoRA, no more than
``max_loras`` distinct adapters run at once: a waiting request whose adapter would be one too many
waits (others may pass it), as in vLLM's scheduler. The step's host-tier copies (server/core/host_tier.py),
planned while allocating, travel with the batch as ``kv_transfers``. With a KV connector (prefill/decode
disaggregation, server/core/kv_connector.py) a request whose prompt was computed by a prefill engine is
admitted with blocks for all of it and a read of that engine's blocks in ``kv_loads``, made by
``load_remote_kv`` before the step runs; only its last prompt token is computed here. A finished prefill's
blocks are kept for its decode engine instead of freed, and freed once that engine read them.

After the step ran, ``update_from_output`` applies what it sampled (vLLM V1's Scheduler does both): each
request's tokens are appended through the stops (server/core/stops.py), a grammar takes each token first,
a pooling request whose prompt ended finishes with its vector, finished requests leave with their blocks,
and the token counters the metrics report advance.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.server.core.host_tier import KVTransfers
from pagedserve.server.core.kv_cache_manager import KVCacheManager
from pagedserve.server.core.kv_connector import KVConnector, RemoteLoad
from pagedserve.server.core.stops import append_token
from pagedserve.server.kv_transfer_params import RemoteDecode, RemotePrefill
from pagedserve.server.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedserve.server.outputs import SampledToken

logger = logging.getLogger("pagedserve.scheduler")

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
    # Block copies between the device and the host tier, applied before this step's forward pass
    kv_transfers: KVTransfers = field(default_factory=KVTransfers)
    # Prompts' KV read from prefill engines (server/core/kv_connector.py), before this step runs
    kv_loads: list[RemoteLoad] = field(default_factory=list)

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
        max_model_len: int = 0, connector: KVConnector | None = None,
    ) -> None:
        """``max_loras``: the most distinct LoRA adapters running at once (0: LoRA is off).
        ``max_model_len``: a sequence that reaches it stops ("length"). ``connector``: prefill/decode
        disaggregation's scheduler side (None: off)."""
        self.kv = kv
        self.connector = connector
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
        out.kv_transfers = self.kv.take_transfers()
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
            remote = self._remote_prefill(request)
            # A remote prefill gets blocks for its whole prompt at once: all but its last token are read.
            num_new = request.num_tokens - num_cached
            if not remote:
                num_new = min(num_new, budget)
            if not self.kv.allocate(request, num_new, cached, cache=not remote):
                if self._evict_held():
                    continue
                break  # FCFS: nobody overtakes the head of the queue (but requests for a LoRA slot)
            self.waiting.popleft()
            if lora_id:
                loras.add(lora_id)
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.time()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if remote:
                num_new = self._plan_remote_load(out, request, len(cached), budget)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    # ---- prefill/decode disaggregation (server/core/kv_connector.py) ---------------------------------

    def _remote_prefill(self, request: Request) -> bool:
        """Whether the request's prompt is to be read from a prefill engine (its first admission only). Not
        under a sliding window (its early blocks are never allocated here): the prefill engine is told at
        once that it may free them, and the prompt is computed here."""
        if self.connector is None or not isinstance(request.kv_transfer, RemotePrefill):
            return False
        if self.kv.sliding_window is None:
            return True
        self.connector.release(request.kv_transfer)
        request.kv_transfer = None
        return False

    def _plan_remote_load(self, out: SchedulerOutput, request: Request, num_local_blocks: int,
                          budget: int) -> int:
        """Plan the read of an admitted remote prefill; the tokens it computes this step: its last prompt
        token, or (when the prefill engine's blocks do not fit its prompt) a first chunk of its prompt."""
        assert self.connector is not None and isinstance(request.kv_transfer, RemotePrefill)
        source, request.kv_transfer = request.kv_transfer, None  # one try: a preempted request recomputes
        self.connector.queries += request.num_prompt_tokens
        block_ids = self.kv.block_ids(request.request_id)
        load = self.connector.plan_load(request, source, num_local_blocks, block_ids)
        if load is None:
            self.connector.release(source)
            return min(request.num_tokens - request.num_computed_tokens, budget)
        out.kv_loads.append(load)
        request.num_computed_tokens = request.num_tokens - 1
        return 1

    def load_remote_kv(self, plan: SchedulerOutput, read: Callable[[RemoteLoad], int]) -> None:
        """Make the plan's reads (``read``: the executor's, returning the bytes read) before it runs. A
        request whose read fails leaves this step and computes its prompt from its own cached prefix in the
        next ones (a colocated run); one whose read succeeds has its prompt's blocks findable as cached."""
        assert self.connector is not None
        for load in plan.kv_loads:
            request, start = load.request, time.perf_counter()
            try:
                if not self.connector.acquire(load):
                    raise RuntimeError("the prefill engine no longer holds the blocks")
                result: int | Exception = read(load)
            except Exception as exc:
                logger.warning("reading request %s's KV from %s failed (%s): computing its prompt here",
                               request.request_id, load.source.side_channel, exc)
                result = exc
            self.connector.loaded(load, result, time.perf_counter() - start)
            if isinstance(result, Exception):
                request.num_computed_tokens = load.num_local_tokens
                plan.scheduled = [item for item in plan.scheduled if item.request is not request]
            else:
                self.kv.cache_blocks(request)
        plan.kv_loads = []

    def free_released_kv(self) -> None:
        """Free the held blocks of finished prefills that their decode engines read (or never will)."""
        if self.connector is not None:
            for blocks in self.connector.take_freeable():
                self.kv.release(blocks)

    def _evict_held(self) -> bool:
        """Free the oldest finished prefill's held blocks that no decode engine is reading, for a request
        that does not fit; False when there are none."""
        blocks = self.connector.evict_oldest() if self.connector is not None else None
        if blocks is None:
            return False
        self.kv.release(blocks)
        return True

    def _hold_for_decode(self, request: Request, status: RequestStatus) -> bool:
        """Keep a finished prefill's blocks for its decode engine (``kv_transfer_params`` tells it where);
        False when they are freed as usual (no connector, not a prefill, aborted, or the window took some)."""
        if self.connector is None or not isinstance(request.kv_transfer, RemoteDecode):
            return False
        if status is RequestStatus.FINISHED_ABORTED or (blocks := self.kv.detach(request)) is None:
            return False
        request.kv_transfer_params = self.connector.hold(request, blocks)
        return True

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
        if not (known and self._hold_for_decode(request, status)):
            self.kv.free(request)

    def close(self) -> None:
        """Stop the connector's side channel (its port is free again)."""
        if self.connector is not None:
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
        out.kv_transfers = self.kv.take_transfers()
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
