"""Fixed-size KV blocks with reference counts, and the prefix cache's hash -> block map.

A block whose ref count drops to zero joins the free queue but keeps its hash, so a later request with
the same prefix can take it back; blocks are reused from the front of the queue (least recently freed),
which is what makes eviction LRU. ``on_evict`` hears of each cached block about to be reused: the CPU KV
tier (server/core/offloading_connector.py) copies it to host memory then, so a later hit can load it back
instead of recomputing it.

With ``enable_kv_events`` the pool records what routers need to know of its hash map as KV events
(server/core/kv_events.py): a block evicted from it, or the whole map forgotten. The KV manager records
the stores, which need the token ids the pool does not hold. Recording is a list append on the engine
thread; the async engine takes the list after each step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.server.core.kv_events import AllBlocksCleared, BlockRemoved, KVEvent


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_kv_events: bool = False,
                 on_evict: Callable[[bytes, int], None] | None = None) -> None:
        self.num_blocks = num_blocks
        self.on_evict = on_evict
        self.events: list[KVEvent] | None = [] if enable_kv_events else None
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references: truly empty ones and evictable cached ones."""
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, count: int) -> list[Block]:
        if count > len(self.free_queue):
            raise RuntimeError(f"asked for {count} blocks, {len(self.free_queue)} free")
        taken = []
        for _ in range(count):
            _, block = self.free_queue.popitem(last=False)
            if self.on_evict is not None and block.block_hash is not None:
                # Its K/V is whole (written by an earlier step); this step's copies run before its forward.
                self.on_evict(block.block_hash, block.block_id)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference from each; callers pass tail blocks first so they are evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache(self, block: Block, block_hash: bytes) -> bool:
        """Make the block findable by its hash; False if it was, or an identical block already is (the
        first is kept)."""
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> None:
        events, self.events = self.events, None  # one AllBlocksCleared instead of a removal per block
        for block in self.blocks:
            self._evict(block)
        self.events = events
        if events is not None:
            events.append(AllBlocksCleared())

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call (none without ``enable_kv_events``)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.append(BlockRemoved([block.block_hash]))
            block.block_hash = None
