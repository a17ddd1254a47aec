"""The CPU KV tier's bookkeeping (vLLM's native CPU offloading, ``--kv-offloading-size``): a bounded pool
of host blocks keyed by the same block hashes as the device pool, least recently used first out.

A cached device block that the pool evicts to reuse it (server/core/block_pool.py) is first copied here
(a store), unless its hash is here already; a prefix that continues past the device's hits into blocks
found here is copied back into fresh device blocks (a load) instead of being recomputed. The tier meets
the scheduler as a KV connector (server/core/offloading_connector.py), which drives this bookkeeping.

Only the decisions live here, torch-free: which hash sits in which host block, and the step's copies as
plain ints (``KVTransfers``). The bytes move in the connector's worker on every rank
(server/worker/kv_connector_workers.py ``OffloadingWorker``), which owns the host tensors: pinned CPU
memory beside a GPU cache, plain CPU tensors beside a CPU one (a second pool).

Within one step the copies are planned while scheduling, before the forward pass writes anything, and
the worker applies all stores, then all loads, before the forward runs. So a store reads a reused device
block before anyone overwrites it, and a load may read a host block stored in the same step. A host block
read or written by the step being planned is ``busy``: no other store of that step may take it, so each
host block is the target of one copy per step and a planned load is never overwritten.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class KVTransfers:
    """One step's block copies, applied to every layer's K and V before its forward pass: ``stores``
    first, then ``loads``. Plain ints, so the step's inputs can go to every tensor-parallel rank, each
    copying its own shard of the blocks."""

    stores: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)


@dataclass(frozen=True)
class HostHit:
    """A prefix block found in the host tier only: allocation gives it a fresh device block and a load."""

    block_hash: bytes


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # hash -> host block, least recently used first
        self.free: list[int] = list(reversed(range(num_blocks)))
        self.busy: set[int] = set()  # host blocks the step being planned copies to or from
        self.transfers = KVTransfers()
        self.num_stored = 0  # blocks copied device -> host, ever
        self.num_loaded = 0  # blocks copied host -> device, ever

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.slots

    def usage(self) -> float:
        return len(self.slots) / self.num_blocks

    def store(self, block_hash: bytes, device_block: int) -> bool:
        """Plan the copy of an evicted device block. False when the hash is here already (it only
        becomes the most recently used) or every host block is busy this step (the block is dropped)."""
        if block_hash in self.slots:
            self.slots.move_to_end(block_hash)
            return False
        slot = self._take_slot()
        if slot is None:
            return False
        self.slots[block_hash] = slot
        self.busy.add(slot)
        self.transfers.stores.append((device_block, slot))
        self.num_stored += 1
        return True

    def pin(self, block_hash: bytes) -> bool:
        """Keep a hit's host block out of this step's stores until its load is planned; False if gone."""
        slot = self.slots.get(block_hash)
        if slot is None:
            return False
        self.busy.add(slot)
        return True

    def load(self, block_hash: bytes, device_block: int) -> None:
        """Plan the copy of a (pinned) hit into a fresh device block."""
        slot = self.slots[block_hash]
        self.slots.move_to_end(block_hash)
        self.busy.add(slot)
        self.transfers.loads.append((slot, device_block))
        self.num_loaded += 1

    def take_transfers(self) -> KVTransfers:
        """The planned step's copies; every host block is free to reuse again after them."""
        transfers, self.transfers = self.transfers, KVTransfers()
        self.busy.clear()
        return transfers

    def reset(self) -> None:
        """Forget every block (between steps: with the device pool's reset_prefix_cache)."""
        self.slots.clear()
        self.free = list(reversed(range(self.num_blocks)))
        self.busy.clear()
        self.transfers = KVTransfers()

    def _take_slot(self) -> int | None:
        if self.free:
            return self.free.pop()
        for block_hash, slot in self.slots.items():  # least recently used first
            if slot not in self.busy:
                del self.slots[block_hash]
                return slot
        return None
