"""Gives each request the KV blocks it needs, reusing cached prefix blocks by their chained hash.

A full block's hash chains its parent's hash with its token ids, seeded by the model (and by the
request's ``cache_salt``, so requests with different salts never share a block), so equal hashes mean
equal prefixes. Blocks become findable as soon as they are allocated for tokens that fill them:
within one forward pass every layer stores all new K/V before any attention reads, so a request
scheduled later in the same step may already share them (this is how n > 1 samples share a prompt).
"""

from __future__ import annotations

import hashlib
from array import array

from pagedserve.server.core.block_pool import Block, BlockPool
from pagedserve.server.request import Request


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    return hashlib.blake2b(parent_hash + array("q", token_ids).tobytes(), digest_size=16).digest()


def seed_hash(model_seed: str) -> bytes:
    return hashlib.blake2b(model_seed.encode(), digest_size=16).digest()


def salted_root(root_hash: bytes, cache_salt: str | None) -> bytes:
    """The parent of a request's first block: the model's root, mixed with the salt when there is one."""
    if cache_salt is None:
        return root_hash
    return hashlib.blake2b(root_hash + cache_salt.encode(), digest_size=16).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, hash_seed: str) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.root_hash = seed_hash(hash_seed)
        self.req_blocks: dict[str, list[Block]] = {}
        self.req_hashes: dict[str, list[bytes]] = {}
        self.req_num_cached: dict[str, int] = {}  # leading blocks already registered, to skip them
        self.prefix_queries = 0  # prompt tokens looked up, in tokens as vLLM counts them
        self.prefix_hits = 0

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_of(self, request_id: str) -> list[Block]:
        return self.req_blocks.get(request_id, [])

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """The longest run of cached blocks at the start of the request's tokens.

        The last token is always computed (its logits are needed), so a fully cached prompt gives up
        its final block. A request still owing prompt logprobs needs the logits of every prompt position,
        so it takes no hits (as in vLLM), though the blocks it fills are cached for others.
        """
        if not self.enable_caching or request.needs_prompt_logprobs:
            return []
        hashes = self._full_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits

    def allocate(self, request: Request, num_new_tokens: int, cached: list[Block] | None = None) -> bool:
        """Room for ``num_new_tokens`` more tokens after the computed ones (and ``cached`` hits).

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        cached = cached or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached) * self.block_size
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(blocks) - len(cached)
        # Hits that sit in the free queue stop being free once touched.
        reclaimed = sum(1 for b in cached if b.ref_cnt == 0)
        if needed + reclaimed > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[request.request_id]
            return False
        self.pool.touch(cached)
        blocks.extend(cached)
        if needed > 0:
            blocks.extend(self.pool.allocate(needed))
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return True

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_hashes.pop(request.request_id, None)
        self.req_num_cached.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))

    def _full_block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of every full block of the request's known tokens, extended incrementally."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        if len(hashes) < num_full:
            parent = hashes[-1] if hashes else salted_root(self.root_hash, request.cache_salt)
            size = self.block_size
            for i in range(len(hashes), num_full):
                parent = hash_block(parent, request.token_slice(i * size, (i + 1) * size))
                hashes.append(parent)
        return hashes

    def _cache_full_blocks(self, request: Request, blocks: list[Block], num_tokens: int) -> None:
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        done = self.req_num_cached.get(request.request_id, 0)
        if num_full <= done:
            return
        hashes = self._full_block_hashes(request)
        for i in range(done, num_full):
            self.pool.cache(blocks[i], hashes[i])
        self.req_num_cached[request.request_id] = num_full
