"""The worker side of the KV connector: this engine's KV cache, registered with Mooncake's transfer engine
(PyPI ``mooncake-transfer-engine-non-cuda``: its TCP transport runs on any machine, RDMA where there is
one), and reads of a peer's blocks into it.

A prefill engine registers its cache tensors once (``register``) and publishes their ``KVLayout``: its
transfer engine's session and, per layer, where K and V start and how many bytes a block takes. A decode
engine reads a request's blocks straight from those addresses into blocks of its own cache
(``read_blocks``): one batched read of every (layer, K/V, block), no copy and no code on the prefill side.
Blocks are contiguous in both caches (``[num_blocks, block_size, kv_heads, head_dim]``, server/layers/
attention.py ``allocate_kv_caches``), so a block is one span of ``block_bytes``, whatever its dtype (FP8
included: the bytes are copied as they are, so both engines must use the same kv_cache_dtype).

Mooncake rather than our own socket protocol: it is what vLLM's and SGLang's Mooncake connectors move KV
with, batches thousands of spans in one call, and switches to RDMA where the NICs have it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagedserve.server.kv_transfer_params import KVLayout, block_runs

# Spans per batched read: Mooncake's TCP transport rejects a batch past its queue's length (2,400 spans of
# a 40-block prompt on 30 layers were refused, "TCP lane queue-full").
MAX_SPANS_PER_BATCH = 128
INSTALL_HINT = (
    "prefill/decode disaggregation needs Mooncake's transfer engine: pip install "
    "'pagedserve[pd]' (mooncake-transfer-engine-non-cuda) and apt-get install libibverbs1 librdmacm1"
)


@dataclass(frozen=True)
class RemoteRead:
    """One request's read, as every rank takes it (sent whole to the other ranks): rank r reads the same
    blocks from the prefill engine's rank r (``layouts[r]``)."""

    layouts: tuple[KVLayout, ...]
    remote_blocks: list[int]
    local_blocks: list[int]


def kv_caches(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (K, V) cache of each of its attention layers (its stage's, under pipeline parallelism)."""
    return [(layer.k_cache, layer.v_cache) for layer in model.attention_layers()]


class KVTransferAgent:
    """One engine's transfer engine: registers its caches, reads peers' blocks into them."""

    def __init__(self, host: str) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise RuntimeError(f"{INSTALL_HINT} ({exc})") from exc
        self.engine = TransferEngine()
        # P2P handshake: peers exchange segment descriptors directly, no metadata server to run.
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"Mooncake's transfer engine did not start on {host}")
        self.host = host
        self.layout: KVLayout | None = None

    def register(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> KVLayout:
        """Register every layer's (K, V) cache; returns the layout peers read by."""
        if not caches:
            raise ValueError("no KV cache to register")
        block_bytes = caches[0][0][0].numel() * caches[0][0].element_size()
        for tensor in (t for pair in caches for t in pair):
            if tensor.device.type != "cpu":
                raise ValueError("the non-CUDA transfer engine moves host memory: a GPU cache needs NIXL or "
                                 "Mooncake's CUDA build")
            if not tensor.is_contiguous() or tensor[0].numel() * tensor.element_size() != block_bytes:
                raise ValueError("KV caches must be contiguous, with blocks of one size in every layer")
            if self.engine.register_memory(tensor.data_ptr(), tensor.numel() * tensor.element_size()) != 0:
                raise RuntimeError("Mooncake refused to register a KV cache tensor")
        self.layout = KVLayout(
            session=f"{self.host}:{self.engine.get_rpc_port()}",
            k_addrs=tuple(k.data_ptr() for k, _ in caches),
            v_addrs=tuple(v.data_ptr() for _, v in caches),
            block_bytes=block_bytes,
        )
        return self.layout

    def read(self, read: RemoteRead, rank: int) -> int | str:
        """Rank ``rank``'s part of a read: the bytes, or why it failed, as a message (every rank goes on to
        the gather that follows, failed or not)."""
        try:
            return self.read_blocks(read.layouts[rank], read.remote_blocks, read.local_blocks)
        except (RuntimeError, ValueError) as exc:
            return f"rank {rank}: {exc}"

    def read_blocks(self, remote: KVLayout, remote_blocks: list[int], local_blocks: list[int]) -> int:
        """Copy the peer's ``remote_blocks`` into this engine's ``local_blocks``, every layer's K and V;
        returns the bytes read. RuntimeError when the transfer fails (the caller recomputes instead),
        ValueError when the peer's cache has another shape."""
        assert self.layout is not None, "register the caches first"
        if len(remote_blocks) != len(local_blocks):
            raise ValueError("as many local blocks as remote ones")
        if remote.block_bytes != self.layout.block_bytes or len(remote.k_addrs) != len(self.layout.k_addrs):
            raise ValueError("the peer's cache has another shape (layers, block size, heads or dtype)")
        runs = block_runs(remote_blocks, local_blocks)
        sources = remote.spans([r for r, _, _ in runs])
        targets = self.layout.spans([lo for _, lo, _ in runs])
        lengths = [n * remote.block_bytes for _ in remote.k_addrs for _ in "kv" for _, _, n in runs]
        for start in range(0, len(sources), MAX_SPANS_PER_BATCH):
            end = start + MAX_SPANS_PER_BATCH
            if self.engine.batch_transfer_sync_read(remote.session, targets[start:end], sources[start:end],
                                                    lengths[start:end]) != 0:
                raise RuntimeError(f"reading {len(remote_blocks)} KV blocks from {remote.session} failed")
        return sum(lengths)
