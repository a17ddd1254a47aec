"""The KV connector interface, scheduler role (vLLM V1's ``KVConnectorBase_V1``): KV that lives outside this
engine's device pool, found for new requests, loaded into their blocks before the step that needs it, and
kept past a request's end when someone else will read it. The scheduler (server/core/scheduler.py) talks
to connectors through this class only; the bytes move on the worker side (server/worker/kv_connector_
workers.py), one worker per connector, driven by the executor with the metadata built here.

Two connectors implement it:
- the CPU KV tier (server/core/offloading_connector.py, vLLM's OffloadingConnector, ``--kv-offloading-size``):
  blocks the device pool evicts are stored in host memory and loaded back for a later prefix hit;
- prefill/decode disaggregation (server/core/mooncake_connector.py, ``--kv-transfer-config``): a prefill
  engine keeps a finished prompt's blocks, a decode engine reads them instead of computing the prompt.
Both on at once run as one ``MultiConnector`` (vLLM's name), each asked in turn.

A step's life, as in vLLM: for a waiting request the scheduler asks ``get_num_new_matched_tokens`` (prompt
tokens a connector supplies after the device's own prefix hits), allocates blocks for them too, and tells
the connector which blocks they got (``update_state_after_alloc``). ``build_connector_meta`` then hands
the step's transfers to the workers, which make them before the step's forward pass; their results come
back to ``update_connector_output``, which names the requests whose loads failed (they compute their
prompt instead). When a request finishes, ``request_finished`` may keep its blocks (returning the
``kv_transfer_params`` its response carries); kept blocks come back by ``take_freeable`` or, when the pool
runs short, ``evict_held``. ``on_block_evicted`` sees every cached block the pool is about to reuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from pagedserve.server.core.block_pool import Block
from pagedserve.server.request import Request

# One step's worker-side work, by connector name (server/worker/kv_connector_workers.py has a worker of
# each name); plain data, so it travels whole to every tensor- and pipeline-parallel rank.
ConnectorMetadata = dict[str, Any]
# Each worker's result for that step, by connector name: one entry per rank, in rank order.
ConnectorResults = dict[str, list[Any]]
C = TypeVar("C", bound="KVConnector")


class KVConnector:
    """The scheduler role. Every method has a do-nothing default, so a connector states only what it does."""

    name = ""
    # Tokens as vLLM's external prefix cache counts them (vllm:external_prefix_cache_queries/hits): prompt
    # tokens of requests this connector was asked about, and those it supplied instead of their compute.
    queries = 0
    hits = 0

    def get_num_new_matched_tokens(self, request: Request, num_local_tokens: int) -> int:
        """Prompt tokens after the first ``num_local_tokens`` (the device's hits) this connector can load
        for ``request``, never its last prompt token (whose logits are needed). Asked again each step the
        request waits, so it changes nothing but what ``update_state_after_alloc`` then plans."""
        return 0

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None:
        """``request`` was admitted: its blocks after its ``num_local_tokens`` hold the
        ``num_external_tokens`` this connector said it would load (plan that load for this step)."""

    def on_block_evicted(self, block_hash: bytes, block_id: int) -> None:
        """A cached device block is about to be reused (its K/V is whole until this step's forward)."""

    def build_connector_meta(self) -> Any:
        """This step's work for the connector's worker (None: nothing this step)."""
        return None

    def update_connector_output(self, results: list[Any]) -> set[str]:
        """The worker's results of this step's metadata, one per rank; the ids of requests whose load
        failed (they compute their prompt themselves from their own prefix hits)."""
        return set()

    def request_finished(self, request: Request, blocks: list[Block]) -> dict | None:
        """A request ended normally: the ``kv_transfer_params`` of its response when the connector keeps
        ``blocks`` (then they are the connector's until ``take_freeable`` or ``evict_held`` return them),
        None when they are freed as usual."""
        return None

    def take_freeable(self) -> list[list[Block]]:
        """Kept blocks whose readers are done (or never came): the caller frees them."""
        return []

    def evict_held(self) -> list[Block] | None:
        """Kept blocks given up to make room for a request that does not fit; None when none can be."""
        return None

    @property
    def num_held_requests(self) -> int:
        return 0

    def reset_cache(self) -> None:
        """Forget every block this connector could load (with the device pool's ``reset_prefix_cache``)."""

    def close(self) -> None:
        """Stop what runs beside the engine (a side channel's threads and port)."""


class MultiConnector(KVConnector):
    """Several connectors at once (vLLM's MultiConnector): a request's external tokens come from the first
    that has any; everything else goes to each."""

    name = "multi"

    def __init__(self, connectors: Sequence[KVConnector]) -> None:
        self.connectors = list(connectors)
        self._chosen: dict[str, KVConnector] = {}  # request id -> the connector that matched it this step

    def get_num_new_matched_tokens(self, request: Request, num_local_tokens: int) -> int:
        self._chosen.pop(request.request_id, None)
        for connector in self.connectors:
            if num := connector.get_num_new_matched_tokens(request, num_local_tokens):
                self._chosen[request.request_id] = connector
                return num
        return 0

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None:
        chosen = self._chosen.pop(request.request_id, None)
        for connector in self.connectors:
            connector.update_state_after_alloc(request, block_ids, num_local_tokens,
                                               num_external_tokens if connector is chosen else 0)

    def on_block_evicted(self, block_hash: bytes, block_id: int) -> None:
        for connector in self.connectors:
            connector.on_block_evicted(block_hash, block_id)

    def build_connector_meta(self) -> ConnectorMetadata:
        self._chosen.clear()  # matched but not admitted: nothing planned for them
        metadata = {c.name: c.build_connector_meta() for c in self.connectors}
        return {name: meta for name, meta in metadata.items() if meta is not None}

    def update_connector_output(self, results: ConnectorResults) -> set[str]:  # type: ignore[override]
        failed: set[str] = set()
        for connector in self.connectors:
            # Called even without results: a connector may know of failures before any transfer ran.
            failed |= connector.update_connector_output(results.get(connector.name, []))
        return failed

    def request_finished(self, request: Request, blocks: list[Block]) -> dict | None:
        for connector in self.connectors:
            if (params := connector.request_finished(request, blocks)) is not None:
                return params
        return None

    def take_freeable(self) -> list[list[Block]]:
        return [blocks for connector in self.connectors for blocks in connector.take_freeable()]

    def evict_held(self) -> list[Block] | None:
        return next((blocks for c in self.connectors if (blocks := c.evict_held()) is not None), None)

    @property
    def num_held_requests(self) -> int:
        return sum(connector.num_held_requests for connector in self.connectors)

    def reset_cache(self) -> None:
        for connector in self.connectors:
            connector.reset_cache()

    def close(self) -> None:
        for connector in self.connectors:
            connector.close()

    def find(self, kind: type[C]) -> C | None:
        """The connector of that class, if it is one of these (for its own statistics)."""
        return next((c for c in self.connectors if isinstance(c, kind)), None)
