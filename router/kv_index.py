"""Which replica holds which KV blocks, as its engine reports them in KV events (router/kv_events.py,
server/core/kv_events.py). Pure: no I/O, no clocks; fed batch by batch and queried by the proxy.

A replica is *synchronised* from its snapshot (the first batch of every subscription: its block size,
its hash root and every cached hash) until its stream ends or a batch's ``seq`` is not the next one;
then its entries are dropped, and it counts as unknown (the balancer falls back to prefix-hash for it)
until a new snapshot arrives. A replica that reports more blocks than ``max_blocks`` is dropped too:
an index must stay bounded whatever an engine sends.

Matching hashes the request's token ids with the engine's function and root (common/block_hash.py),
once per distinct (root, block size) among the replicas: a fleet of one model shares one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.common.block_hash import chain_hashes
from pagedserve.router.hashing import hash_int, salted_seed

DEFAULT_MAX_BLOCKS = 1 << 21  # per replica: far above any engine's pool of blocks


class GapError(ValueError):
    """A batch that cannot be applied: a sequence gap, no snapshot yet, or a malformed batch."""


@dataclass
class ReplicaBlocks:
    hash_root: bytes
    block_size: int
    seq: int
    hashes: set[int] = field(default_factory=set)


class KVIndex:
    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self.replicas: dict[str, ReplicaBlocks] = {}

    def synced(self, url: str) -> bool:
        return url in self.replicas

    def size(self) -> int:
        """Blocks indexed over all replicas."""
        return sum(len(r.hashes) for r in self.replicas.values())

    def blocks_of(self, url: str) -> int:
        replica = self.replicas.get(url)
        return len(replica.hashes) if replica is not None else 0

    def drop(self, url: str) -> None:
        self.replicas.pop(url, None)

    def apply(self, url: str, batch: dict[str, Any]) -> int:
        """Apply one batch of ``url``'s stream; returns its number of events. Raises GapError (after
        dropping the replica's entries) when the batch does not follow: the caller resubscribes."""
        try:
            if batch.get("snapshot"):
                replica = ReplicaBlocks(
                    bytes.fromhex(batch["hash_root"]), int(batch["block_size"]), int(batch["seq"])
                )
                if replica.block_size <= 0:
                    raise ValueError(f"block_size {replica.block_size}")
            else:
                replica = self.replicas.get(url)
                if replica is None:
                    raise GapError("no snapshot yet")
                seq = int(batch["seq"])
                if seq != replica.seq + 1:
                    raise GapError(f"sequence gap: {replica.seq} then {seq}")
                replica.seq = seq
            events = batch["events"]
            for event in events:
                _apply_event(replica.hashes, event)
            if len(replica.hashes) > self.max_blocks:
                raise GapError(f"more than {self.max_blocks} blocks")
        except GapError:
            self.drop(url)
            raise
        except (KeyError, TypeError, ValueError) as exc:
            self.drop(url)
            raise GapError(f"malformed batch: {exc!r}") from exc
        self.replicas[url] = replica
        return len(events)

    def matches(
        self, token_ids: Sequence[int], cache_salt: Any, urls: Iterable[str], lora_name: str | None = None
    ) -> dict[str, int]:
        """{url: leading blocks of the prompt that replica holds}, for the synchronised ``urls``; the
        chain is rooted as the engine roots it for this adapter and salt (router/hashing.py)."""
        chains: dict[tuple[bytes, int], list[int]] = {}
        out: dict[str, int] = {}
        for url in urls:
            replica = self.replicas.get(url)
            if replica is None:
                continue
            key = (replica.hash_root, replica.block_size)
            chain = chains.get(key)
            if chain is None:
                root = salted_seed(replica.hash_root, cache_salt, lora_name)
                chain = chains[key] = [hash_int(d) for d in chain_hashes(token_ids, replica.block_size, root)]
            out[url] = _leading(chain, replica.hashes)
        return out


def _apply_event(hashes: set[int], event: dict[str, Any]) -> None:
    kind = event["type"]
    if kind == "BlockStored":
        hashes.update(hash_int(bytes.fromhex(h)) for h in event["block_hashes"])
    elif kind == "BlockRemoved":
        for h in event["block_hashes"]:
            hashes.discard(hash_int(bytes.fromhex(h)))
    elif kind == "AllBlocksCleared":
        hashes.clear()
    # Other kinds (vLLM has more) carry nothing this index needs.


def _leading(chain: Sequence[int], held: set[int]) -> int:
    n = 0
    for h in chain:
        if h not in held:
            break
        n += 1
    return n
