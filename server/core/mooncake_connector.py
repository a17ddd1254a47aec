"""Prefill/decode disaggregation's KV connector (server/core/kv_connector.py), scheduler role: which blocks a
finished prefill keeps for its decode engine, and which blocks a decode request reads instead of computing.
The bytes move on the worker side (server/worker/kv_connector_workers.py ``MooncakeWorker``, over
server/kv_transfer/mooncake_agent.py), the acquire/release messages over server/kv_transfer/side_channel.py;
the settings and the params are server/kv_transfer_config.py and server/kv_transfer_params.py.

Prefill engine: a request with ``do_remote_decode`` that ends (after its one token) keeps its blocks:
``hold`` takes them out of the KV manager's hands and returns the ``kv_transfer_params`` its response
carries. They go back to the pool when the decode engine says it read them (server/kv_transfer/
side_channel.py) or when ``hold_seconds`` pass, whichever comes first (``take_freeable``); a decode engine
acquires them before reading, so that blocks freed by their hold time are never read, and acquired ones
stay until released (or a second hold time passes: a reader that died).

Decode engine: a request with ``do_remote_prefill`` is admitted with blocks for its whole prompt; those past
its own prefix-cache hits are read from the prefill engine's blocks (``plan_load``) before the step that
computes its last prompt token, the only prompt token it computes (vLLM's P/D does the same: the decode
side needs that token's logits). The blocks are acquired when the step's metadata is built, read by every
rank's worker before the step's forward pass, and released once read; a read that fails leaves the request
to compute its prompt itself (a colocated run, counted in ``num_failed``). Not under a sliding window: the
decode engine never allocates the blocks behind it, so the prompt is computed here and the prefill engine
told at once that it may free its blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.server.core.block_pool import Block
from pagedserve.server.core.kv_connector import KVConnector
from pagedserve.server.kv_transfer.mooncake_agent import RemoteRead
from pagedserve.server.kv_transfer.side_channel import ReleaseListener, ReleaseSender
from pagedserve.server.kv_transfer_config import KVTransferConfig
from pagedserve.server.kv_transfer_params import KVLayout, RemoteDecode, RemotePrefill
from pagedserve.server.request import Request

logger = logging.getLogger("pagedserve.kv_connector")


@dataclass
class RemoteLoad:
    """One decode request's read: the prefill engine's ``remote_blocks`` into its ``local_blocks``."""

    request: Request
    source: RemotePrefill
    remote_blocks: list[int]
    local_blocks: list[int]
    num_local_tokens: int  # prompt tokens found in this engine's own prefix cache, before the read
    started: float = 0.0  # time.perf_counter() when the blocks were acquired


@dataclass
class HeldBlocks:
    blocks: list[Block]
    deadline: float  # time.monotonic() past which they are freed unread
    acquired: bool = False  # a decode engine is reading them: the deadline was pushed back once




class MooncakeConnector(KVConnector):
    name = "mooncake"

    def __init__(self, config: KVTransferConfig, layouts: tuple[KVLayout, ...], block_size: int,
                 sliding_window: int | None = None) -> None:
        """``layouts``: each rank's registered cache, in rank order (server/executor/executor.py)."""
        self.config = config
        self.layouts = layouts
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.listener = ReleaseListener(config.kv_ip, config.kv_port, self._acquire) if config.produces \
            else None
        self.sender = ReleaseSender() if config.consumes else None
        self._lock = threading.Lock()  # ``held``: the scheduler's thread and the side channel's threads
        self.held: dict[str, HeldBlocks] = {}
        self._planned: list[RemoteLoad] = []  # admitted this step, not yet acquired
        self._reading: list[RemoteLoad] = []  # acquired: the step's reads, in its metadata's order
        self._failed: list[RemoteLoad] = []  # not acquired (the prefill engine no longer holds them)
        # For /metrics (server/engine/core_stats.py): prompt tokens of requests that came with a remote
        # prefill, and those read instead of computed (vLLM's external prefix cache); the reads; held
        # blocks freed because no decode engine read them in time (or made room for new requests).
        self.queries = self.hits = self.bytes_received = self.num_transfers = 0
        self.num_failed = self.num_expired = 0
        self.transfer_seconds = 0.0

    # ---- prefill engine -----------------------------------------------------------------------------

    def request_finished(self, request: Request, blocks: list[Block]) -> dict | None:
        """Keep a finished prefill's blocks for its decode engine; the params that say where they are."""
        if self.listener is None or not isinstance(request.kv_transfer, RemoteDecode):
            return None
        with self._lock:
            self.held[request.request_id] = HeldBlocks(blocks, time.monotonic() + self.config.hold_seconds)
        return RemotePrefill(
            request_id=request.request_id,
            block_ids=tuple(b.block_id for b in blocks),
            num_tokens=request.num_prompt_tokens,
            layouts=self.layouts,
            side_channel=self.listener.address,
        ).as_params()

    def take_freeable(self) -> list[list[Block]]:
        """Held blocks released by their readers, or past their deadline: the caller frees them."""
        if self.listener is None:
            return []
        released = self.listener.take()
        now = time.monotonic()
        with self._lock:
            freeable = [held.blocks for rid in released if (held := self.held.pop(rid, None))]
            for request_id in [rid for rid, held in self.held.items() if held.deadline < now]:
                freeable.append(self.held.pop(request_id).blocks)
                self.num_expired += 1
        return freeable

    def evict_held(self) -> list[Block] | None:
        """The blocks of the oldest hold no decode engine has acquired, given up to make room (its reader
        will be told they are gone, and compute the prompt); None when every hold is being read."""
        with self._lock:
            oldest = next((rid for rid, held in self.held.items() if not held.acquired), None)
            if oldest is None:
                return None
            self.num_expired += 1
            return self.held.pop(oldest).blocks

    @property
    def num_held_requests(self) -> int:
        return len(self.held)

    def _acquire(self, request_id: str) -> bool:
        """A decode engine is about to read: True if the blocks are still held (kept until released)."""
        with self._lock:
            held = self.held.get(request_id)
            if held is None or held.deadline < time.monotonic():
                return False
            if not held.acquired:
                held.acquired, held.deadline = True, held.deadline + self.config.hold_seconds
            return True

    # ---- decode engine ------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_local_tokens: int) -> int:
        """Every prompt token but the last, after the local hits, when the request's prompt was computed by a
        prefill engine whose blocks fit it; else 0 (the prefill engine is told it may free them)."""
        source = request.kv_transfer
        if self.sender is None or not isinstance(source, RemotePrefill):
            return 0
        num_prompt = request.num_prompt_tokens
        fits = self.sliding_window is None and source.num_tokens == num_prompt and (
            len(source.block_ids) * self.block_size >= num_prompt - 1
        )
        if fits and num_local_tokens < num_prompt - 1:
            return num_prompt - 1 - num_local_tokens
        if self.sliding_window is None:
            self.queries += num_prompt
        self.release(source)
        request.kv_transfer = None  # one try: computed here from now on
        return 0

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        source = request.kv_transfer
        assert isinstance(source, RemotePrefill)
        request.kv_transfer = None  # one try: a preempted request recomputes
        self.queries += request.num_prompt_tokens
        first = num_local_tokens // self.block_size
        last = -(-(num_local_tokens + num_external_tokens) // self.block_size)
        self._planned.append(RemoteLoad(request, source, list(source.block_ids[first:last]),
                                        list(block_ids[first:last]), num_local_tokens))

    def build_connector_meta(self) -> list[RemoteRead] | None:
        """The step's reads, each of blocks the prefill engine agreed to keep until released."""
        planned, self._planned = self._planned, []
        for load in planned:
            load.started = time.perf_counter()
            try:
                acquired = self.sender is not None and self.sender.acquire(load.source.side_channel,
                                                                           load.source.request_id)
            except Exception as exc:  # the side channel is down: as good as gone
                logger.warning("acquiring request %s's KV from %s failed: %s", load.request.request_id,
                               load.source.side_channel, exc)
                acquired = False
            (self._reading if acquired else self._failed).append(load)
        if not self._reading:
            return None
        return [RemoteRead(load.source.layouts, load.remote_blocks, load.local_blocks)
                for load in self._reading]

    def update_connector_output(self, results: list[Any]) -> set[str]:
        """``results``: each rank's list of (bytes | error) per read. A read fails where any rank's did, or
        where the engines split the model differently."""
        reading, self._reading = self._reading, []
        failed, self._failed = self._failed, []
        for index, load in enumerate(reading):
            answers = [rank[index] for rank in results]
            errors = [a for a in answers if isinstance(a, str)]
            if len(load.source.layouts) != len(self.layouts):
                errors.append(f"the prefill engine has {len(load.source.layouts)} ranks, this one "
                              f"{len(self.layouts)}: both must split the model alike")
            if errors:
                logger.warning("reading request %s's KV from %s failed (%s): computing its prompt here",
                               load.request.request_id, load.source.side_channel, "; ".join(errors))
                failed.append(load)
                continue
            self._count(load, sum(answers))
        for load in failed:
            self._count(load, None)
        return {load.request.request_id for load in failed}

    def _count(self, load: RemoteLoad, num_bytes: int | None) -> None:
        """Count a read (its bytes, or None when it failed) and tell the prefill engine it is done."""
        self.transfer_seconds += time.perf_counter() - load.started
        self.num_transfers += 1
        if num_bytes is None:
            self.num_failed += 1
        else:
            self.bytes_received += num_bytes
            self.hits += load.request.num_prompt_tokens - 1 - load.num_local_tokens
        self.release(load.source)

    def release(self, source: RemotePrefill) -> None:
        """The prefill engine may free these blocks: read, failed, or not needed."""
        if self.sender is not None:
            self.sender.send(source.side_channel, [source.request_id])

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        if self.sender is not None:
            self.sender.close()
