"""The prefix cache's block hash, shared by the engine (server/core/kv_cache_manager.py) and the router
(router/hashing.py, router/kv_index.py): one function, so the router computes from its own tokenization
exactly the hashes an engine reports in its KV events (server/core/kv_events.py).

A full block's hash is BLAKE2b-16 over its parent's hash and its token ids as little-endian int64; the
first block's parent is the root: a hash of the model seed (the engine's is ``f"{model_path}:{dtype}"``,
published with its KV events), salted by the request's ``cache_salt`` when it has one.

Pure standard library: the router must never import torch (tests/router/test_router_no_torch.py).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DIGEST_SIZE = 16


def hash_block(parent_hash: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """``extra``: what else the block's K/V depend on (the hashes of the images whose placeholder tokens
    it holds, server/core/kv_cache_manager.py), hashed as its own kind so no token block stands for it."""
    data = parent_hash + array("q", token_ids).tobytes()
    if extra:
        return hashlib.blake2b(data + extra, digest_size=DIGEST_SIZE, person=b"mm").digest()
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


def seed_hash(model_seed: str) -> bytes:
    return hashlib.blake2b(model_seed.encode(), digest_size=DIGEST_SIZE).digest()


def salted_root(root_hash: bytes, cache_salt: str | None, lora_name: str | None = None) -> bytes:
    """The parent of a request's first block: the model's root, mixed with the salt when there is one,
    then with the LoRA adapter's name when the request runs one (vLLM's extra keys carry the LoRA id):
    a block computed under one adapter is never reused by another or by the base model. The adapter is
    mixed in by a hash of its own kind (``person``), so no salt can ever stand for an adapter."""
    root = root_hash
    if cache_salt:
        data = root + cache_salt.encode("utf-8", "surrogatepass")
        root = hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()
    if lora_name:
        data = root + lora_name.encode("utf-8", "surrogatepass")
        root = hashlib.blake2b(data, digest_size=DIGEST_SIZE, person=b"lora").digest()
    return root


def chain_hashes(token_ids: Sequence[int], block_size: int, root_hash: bytes) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids``: h_i = H(h_{i-1} || tokens of block i), h_-1 = root.
    Only full blocks are hashed: the engine caches only those."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    ids = array("q", token_ids[: len(token_ids) // block_size * block_size]).tobytes()
    step = block_size * 8
    blake = hashlib.blake2b
    out: list[bytes] = []
    parent = root_hash
    for start in range(0, len(ids), step):
        parent = blake(parent + ids[start : start + step], digest_size=DIGEST_SIZE).digest()
        out.append(parent)
    return out
