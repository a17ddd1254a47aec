"""The KV connector interface, worker role (vLLM V1's ``KVConnectorBase_V1`` worker side): each rank's
workers move the bytes that the scheduler's connectors (server/core/kv_connector.py) planned for a step,
before that step's forward pass. Every rank holds a worker of each connector, over its own shard of the
cache (its KV heads under tensor parallelism, its stage's layers under pipeline parallelism); the
executor (server/executor/executor.py) hands each the step's metadata under its connector's name and
gathers their results, rank by rank, back to the scheduler.

- ``OffloadingWorker``: the CPU KV tier's host blocks (each layer's K and V, pinned beside a GPU) and the
  step's copies between them and the device cache (server/core/offloading_connector.py decides them).
- ``MooncakeWorker``: this rank's cache registered with Mooncake's transfer engine
  (server/kv_transfer/mooncake_agent.py), and the step's reads of prefill engines' blocks into it
  (server/core/mooncake_connector.py decides them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from pagedserve.server.core.host_tier import KVTransfers
from pagedserve.server.kv_transfer.mooncake_agent import KVTransferAgent, RemoteRead, kv_caches
from pagedserve.server.kv_transfer_params import KVLayout
from torch import nn


class KVConnectorWorker(Protocol):
    name: str

    def start_load_kv(self, metadata: Any) -> Any:
        """Make this step's transfers on this rank; the result its scheduler-side connector reads."""
        ...


class OffloadingWorker:
    name = "offloading"

    def __init__(self, model: nn.Module, num_host_blocks: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """``num_host_blocks``: this rank's host blocks, each the device cache's per-rank block shape and
        dtype (an FP8 cache's bytes are kept as they are)."""
        self.layers = model.attention_layers()
        self.device = device
        pin = device.type == "cuda"  # so copies run at DMA speed
        shape = (num_host_blocks, *self.layers[0].k_cache.shape[1:])
        self.host_caches = [
            (torch.zeros(shape, dtype=dtype, pin_memory=pin), torch.zeros(shape, dtype=dtype, pin_memory=pin))
            for _ in self.layers
        ]

    @torch.inference_mode()
    def start_load_kv(self, transfers: KVTransfers) -> None:
        """The copies of this rank's shard of the blocks, in every layer: stores (device -> host) first, for
        a stored block may be a reused one this step's loads or forward overwrite. The bytes are copied
        raw (uint8 views), whatever the cache's dtype."""
        if transfers.stores:
            device_ids = self._to_device(torch.tensor([d for d, _ in transfers.stores], dtype=torch.long))
            host_ids = torch.tensor([h for _, h in transfers.stores], dtype=torch.long)
            for layer, host in zip(self.layers, self.host_caches, strict=True):
                for cache, host_cache in zip((layer.k_cache, layer.v_cache), host, strict=True):
                    _raw(host_cache)[host_ids] = _raw(cache).index_select(0, device_ids).cpu()
        if transfers.loads:
            host_ids = torch.tensor([h for h, _ in transfers.loads], dtype=torch.long)
            device_ids = self._to_device(torch.tensor([d for _, d in transfers.loads], dtype=torch.long))
            for layer, host in zip(self.layers, self.host_caches, strict=True):
                for cache, host_cache in zip((layer.k_cache, layer.v_cache), host, strict=True):
                    _raw(cache)[device_ids] = self._to_device(_raw(host_cache).index_select(0, host_ids))

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.device.type == "cpu" else tensor.pin_memory().to(self.device, non_blocking=True)


class MooncakeWorker:
    name = "mooncake"

    def __init__(self, model: nn.Module, host: str, rank: int) -> None:
        """Starts a transfer engine on ``host`` and registers this rank's caches with it (``layout``)."""
        self.agent = KVTransferAgent(host)
        self.rank = rank
        self.layout: KVLayout = self.agent.register(kv_caches(model))

    def start_load_kv(self, reads: Sequence[RemoteRead]) -> list[int | str]:
        """This rank's part of each read: the bytes, or why it failed (every rank answers every read)."""
        return [self.agent.read(read, self.rank) for read in reads]


def start_load_kv(workers: dict[str, KVConnectorWorker], metadata: dict[str, Any]) -> dict[str, Any]:
    """Every worker's part of a step's metadata on this rank, by connector name."""
    return {name: workers[name].start_load_kv(meta) for name, meta in metadata.items()}


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes (its last dimension in bytes): copies that need no dtype support."""
    return cache.view(torch.uint8)
