"""KV cache events (vLLM's model: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) and their
publisher, for routers that route on what each engine really holds (router/kv_events.py).

Where they come from: the block pool records them as blocks become findable, are evicted and are all
forgotten (server/core/block_pool.py); the KV manager stores a request's new blocks as one
``BlockStored`` (server/core/kv_cache_manager.py). The engine thread only appends to a list; after each
step the async engine takes that step's list (bounded by the blocks one step can touch) and hands it to
the publisher on the event loop (server/engine/async_engine.py). Nothing here ever blocks the step.

The publisher numbers each batch (``seq``), keeps a mirror of the cached block hashes built from the
events themselves (so a snapshot is consistent with the numbering without reading the engine thread's
state), and fans batches out to subscribers through bounded queues. A subscriber whose queue is full is
dropped: its stream ends, and it resynchronises by subscribing again, which starts with a snapshot.

Wire format (``GET /v1/kv_events``, server/api/kv_events.py): newline-delimited JSON, one batch a line::

    {"seq": 7, "events": [{"type": "BlockStored", "block_hashes": ["<hex>", ...],
      "parent_block_hash": "<hex>" | null, "token_ids": [...], "block_size": 16}, ...]}

The first line is the snapshot: ``"snapshot": true``, the engine's ``block_size`` and ``hash_root``
(common/block_hash.py), and ``AllBlocksCleared`` then one ``BlockStored`` listing every cached hash
(parents first; no token ids). An empty line is a heartbeat.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # of the first block; None: the first is a request's first block
    token_ids: list[int]  # of all the stored blocks, in order
    block_size: int

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "BlockStored",
            "block_hashes": [h.hex() for h in self.block_hashes],
            "parent_block_hash": self.parent_block_hash.hex() if self.parent_block_hash else None,
            "token_ids": self.token_ids,
            "block_size": self.block_size,
        }


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]

    def to_json(self) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": [h.hex() for h in self.block_hashes]}


@dataclass
class AllBlocksCleared:
    def to_json(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

DEFAULT_MAX_QUEUED_BATCHES = 1024  # per subscriber: beyond, it is dropped and resynchronises
DEFAULT_MAX_SUBSCRIBERS = 64
HEARTBEAT_S = 5.0  # an idle stream still shows life, so a half-open connection is found


@dataclass(eq=False)
class KVEventSubscription:
    queue: asyncio.Queue[bytes | None]
    dropped: bool = False


@dataclass
class KVEventPublisher:
    """Lives on the event loop: ``publish`` (from the async engine) and ``subscribe`` (from the route)."""

    block_size: int
    hash_root: bytes
    max_queued_batches: int = DEFAULT_MAX_QUEUED_BATCHES
    max_subscribers: int = DEFAULT_MAX_SUBSCRIBERS
    seq: int = 0
    cached: dict[bytes, None] = field(default_factory=dict)  # insertion order: parents before children
    subscribers: set[KVEventSubscription] = field(default_factory=set)
    dropped_subscribers: int = 0

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        self.seq += 1
        self._apply(events)
        if not self.subscribers:
            return
        line = _line({"seq": self.seq, "ts": time.time(), "events": [e.to_json() for e in events]})
        for sub in list(self.subscribers):
            try:
                sub.queue.put_nowait(line)
            except asyncio.QueueFull:  # too slow: never let it hold the engine back; it resyncs
                self._drop(sub)

    def _apply(self, events: list[KVEvent]) -> None:
        cached = self.cached
        for event in events:
            if isinstance(event, BlockStored):
                cached.update(dict.fromkeys(event.block_hashes))
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    cached.pop(h, None)
            else:
                cached.clear()

    def subscribe(self) -> KVEventSubscription:
        """A new subscriber; its first line is the snapshot of the cache as of ``seq``."""
        if len(self.subscribers) >= self.max_subscribers:
            raise RuntimeError(f"too many KV event subscribers (at most {self.max_subscribers})")
        sub = KVEventSubscription(asyncio.Queue(max(self.max_queued_batches, 1)))
        sub.queue.put_nowait(_line(self.snapshot()))
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: KVEventSubscription) -> None:
        self.subscribers.discard(sub)

    def snapshot(self) -> dict[str, Any]:
        stored = BlockStored(list(self.cached), None, [], self.block_size)
        return {
            "seq": self.seq,
            "ts": time.time(),
            "snapshot": True,
            "block_size": self.block_size,
            "hash_root": self.hash_root.hex(),
            "events": [AllBlocksCleared().to_json(), stored.to_json()],
        }

    def close(self) -> None:
        """End every stream after what it was sent already (the engine is stopping)."""
        for sub in list(self.subscribers):
            self._end(sub)

    def _drop(self, sub: KVEventSubscription) -> None:
        self.dropped_subscribers += 1
        sub.dropped = True
        self._end(sub)

    def _end(self, sub: KVEventSubscription) -> None:
        self.subscribers.discard(sub)
        if sub.queue.full():  # a dropped subscriber resyncs anyway: what it has not read is moot
            while not sub.queue.empty():
                sub.queue.get_nowait()
        sub.queue.put_nowait(None)

    async def lines(self, sub: KVEventSubscription, heartbeat_s: float = HEARTBEAT_S) -> AsyncIterator[bytes]:
        """The subscriber's stream: batches as they come, a heartbeat when idle; ends when dropped."""
        try:
            while True:
                try:
                    line = await asyncio.wait_for(sub.queue.get(), heartbeat_s)
                except asyncio.TimeoutError:
                    yield b"\n"
                    continue
                if line is None:
                    return
                yield line
        finally:
            self.unsubscribe(sub)


def _line(batch: dict[str, Any]) -> bytes:
    return json.dumps(batch, separators=(",", ":")).encode() + b"\n"
