"""The scheduler side of the KV connector (vLLM V1's ``KVConnectorBase_V1`` scheduler role): which blocks a
finished prefill keeps for its decode engine, and which blocks a decode request reads instead of computing.
The bytes move on the worker side (server/kv_transfer/mooncake_agent.py, driven by the executor), the
acquire/release messages over server/kv_transfer/side_channel.py; the settings and the params are
server/kv_transfer_config.py and server/kv_transfer_params.py.

Prefill engine: a request with ``do_remote_decode`` that ends (after its one token) keeps its blocks:
``hold`` takes them out of the KV manager's hands and returns the ``kv_transfer_params`` its response
carries. They go back to the pool when the decode engine says it read them (server/kv_transfer/
side_channel.py) or when ``hold_seconds`` pass, whichever comes first (``take_freeable``); a decode engine
acquires them before reading, so that blocks freed by their hold time are never read, and acquired ones
stay until released (or a second hold time passes: a reader that died).

Decode engine: a request with ``do_remote_prefill`` is admitted with blocks for its whole prompt; those past
its own prefix-cache hits are read from the prefill engine's blocks (``plan_load``) before the step that
computes its last prompt token, the only prompt token it computes (vLLM's P/D does the same: the decode
side needs that token's logits). The read is synchronous, before the step's forward pass; a read that
fails leaves the request to compute its prompt itself (a colocated run, counted in ``num_failed``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from pagedserve.server.core.block_pool import Block
from pagedserve.server.kv_transfer.side_channel import ReleaseListener, ReleaseSender
from pagedserve.server.kv_transfer_config import KVTransferConfig
from pagedserve.server.kv_transfer_params import KVLayout, RemotePrefill
from pagedserve.server.request import Request


@dataclass
class RemoteLoad:
    """One decode request's read: the prefill engine's ``remote_blocks`` into its ``local_blocks``."""

    request: Request
    source: RemotePrefill
    remote_blocks: list[int]
    local_blocks: list[int]
    num_local_tokens: int  # prompt tokens found in this engine's own prefix cache, before the read


@dataclass
class HeldBlocks:
    blocks: list[Block]
    deadline: float  # time.monotonic() past which they are freed unread
    acquired: bool = False  # a decode engine is reading them: the deadline was pushed back once


class KVConnector:
    def __init__(self, config: KVTransferConfig, layouts: tuple[KVLayout, ...], block_size: int) -> None:
        """``layouts``: each rank's registered cache, in rank order (server/executor/executor.py)."""
        self.config = config
        self.layouts = layouts
        self.block_size = block_size
        self.listener = ReleaseListener(config.kv_ip, config.kv_port, self._acquire) if config.produces \
            else None
        self.sender = ReleaseSender() if config.consumes else None
        self._lock = threading.Lock()  # ``held``: the scheduler's thread and the side channel's threads
        self.held: dict[str, HeldBlocks] = {}
        # For /metrics (server/engine/core_stats.py): prompt tokens of requests that came with a remote
        # prefill, and those read instead of computed (vLLM's external prefix cache); the reads; held
        # blocks freed because no decode engine read them in time (or made room for new requests).
        self.queries = self.hits = self.bytes_received = self.num_transfers = 0
        self.num_failed = self.num_expired = 0
        self.transfer_seconds = 0.0

    # ---- prefill engine -----------------------------------------------------------------------------

    def hold(self, request: Request, blocks: list[Block]) -> dict:
        """Keep a finished prefill's blocks for its decode engine; the params that say where they are."""
        with self._lock:
            self.held[request.request_id] = HeldBlocks(blocks, time.monotonic() + self.config.hold_seconds)
        assert self.listener is not None  # only a producing role holds
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

    def evict_oldest(self) -> list[Block] | None:
        """The blocks of the oldest hold no decode engine has acquired, given up to make room (its reader
        will be told they are gone, and compute the prompt); None when every hold is being read."""
        with self._lock:
            oldest = next((rid for rid, held in self.held.items() if not held.acquired), None)
            if oldest is None:
                return None
            self.num_expired += 1
            return self.held.pop(oldest).blocks

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

    def plan_load(self, request: Request, source: RemotePrefill, num_local_blocks: int,
                  block_ids: list[int]) -> RemoteLoad | None:
        """The read that gives ``request`` its prompt's KV up to its last token from ``source``, after its
        first ``num_local_blocks`` blocks (its own prefix-cache hits); None when the prefill engine's blocks
        do not fit this prompt (another prompt, or too few blocks): the request computes it here."""
        num_prompt = request.num_prompt_tokens
        num_needed = -(-(num_prompt - 1) // self.block_size)  # blocks holding tokens 0 .. prompt - 2
        if source.num_tokens != num_prompt or len(source.block_ids) < num_needed:
            return None
        return RemoteLoad(request, source, list(source.block_ids[num_local_blocks:num_needed]),
                          block_ids[num_local_blocks:num_needed], num_local_blocks * self.block_size)

    def acquire(self, load: RemoteLoad) -> bool:
        """Ask the prefill engine to keep the blocks until released; False: they are gone (do not read)."""
        assert self.sender is not None
        return self.sender.acquire(load.source.side_channel, load.source.request_id)

    def loaded(self, load: RemoteLoad, result: int | Exception, seconds: float) -> None:
        """Count a read (its bytes, or the error it failed with) and tell the prefill engine it is done."""
        self.transfer_seconds += seconds
        self.num_transfers += 1
        if isinstance(result, Exception):
            self.num_failed += 1
        else:
            self.bytes_received += result
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
