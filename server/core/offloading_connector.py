"""The CPU KV tier as a KV connector (vLLM's OffloadingConnector, ``--kv-offloading-size``), scheduler role:
blocks the device pool evicts are stored in host memory, and a prompt whose prefix continues past the
device's hits into blocks the host holds gets them loaded back instead of recomputed.

The host tier's bookkeeping (which hash sits in which host block, least recently used first out, and the
step's copies) is server/core/host_tier.py; the bytes move in server/worker/kv_connector_workers.py
``OffloadingWorker``. Storing at eviction (``on_block_evicted``), not when a block is computed or freed,
copies only the blocks the device really loses: a block freed and hit again on the device costs nothing.

Host hits are found while the request waits (``get_num_new_matched_tokens``) and their host blocks pinned
at once, so the stores that the same admission's allocation plans cannot take them; the loads are planned
into the fresh device blocks the scheduler then gives the request (``update_state_after_alloc``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedserve.server.core.host_tier import HostTier, KVTransfers
from pagedserve.server.core.kv_connector import KVConnector
from pagedserve.server.request import Request


class OffloadingConnector(KVConnector):
    name = "offloading"

    def __init__(self, num_host_blocks: int, block_size: int,
                 block_hashes: Callable[[Request], list[bytes]]) -> None:
        """``block_hashes``: the request's full blocks' chained hashes, the device pool's keys
        (server/core/kv_cache_manager.py ``full_block_hashes``), so both tiers name a block alike."""
        self.tier = HostTier(num_host_blocks)
        self.block_size = block_size
        self.block_hashes = block_hashes
        self.queries = 0  # prompt tokens looked up while the tier is on
        self.hits = 0  # ... loaded from it (counted as the loads are planned)
        self._matched: dict[str, list[bytes]] = {}  # request id -> its host hits' hashes, this step

    def get_num_new_matched_tokens(self, request: Request, num_local_tokens: int) -> int:
        self.queries += request.num_tokens
        if request.skips_prefix_cache:
            return 0
        first = num_local_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size  # the last token is always computed
        matched: list[bytes] = []
        for block_hash in self.block_hashes(request)[first:last]:
            if not self.tier.pin(block_hash):
                break
            matched.append(block_hash)
        if matched:
            self._matched[request.request_id] = matched
        return len(matched) * self.block_size

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, [])
        if not num_external_tokens:
            return
        first = num_local_tokens // self.block_size
        for block_hash, block_id in zip(matched, block_ids[first:], strict=False):
            self.tier.load(block_hash, block_id)
        self.hits += num_external_tokens

    def on_block_evicted(self, block_hash: bytes, block_id: int) -> None:
        self.tier.store(block_hash, block_id)

    def build_connector_meta(self) -> KVTransfers | None:
        self._matched.clear()
        transfers = self.tier.take_transfers()
        return transfers if transfers else None

    def reset_cache(self) -> None:
        self.tier.reset()
