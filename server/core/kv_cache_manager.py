"""Gives each request the KV blocks it needs, reusing cached prefix blocks by their chained hash.

A full block's hash chains its parent's hash with its token ids, seeded by the model (and by the
request's ``cache_salt`` and LoRA adapter, so requests with different salts or adapters never share a
block, and by the hashes of the images whose placeholder tokens it holds), so equal hashes mean equal
prefixes. Blocks become findable as soon as they are allocated for
tokens that fill them: within one forward pass every layer stores all new K/V before any attention
reads, so a request scheduled later in the same step may already share them (this is how n > 1 samples
share a prompt).

Sliding window (``sliding_window``: every attention layer of the model attends only to the last
``sliding_window`` positions, as Mistral's do): a block wholly before the window of a request's next
token is never read again, so it goes back to the pool as the request advances and its place in the
block table is taken by one shared null block, which the attention kernels never read (vLLM's
SlidingWindowManager). A freed block keeps its hash, so other requests may still hit it. A prefix hit
needs only the blocks inside the window of the first token the request computes: the ones before may
be evicted already, and are not taken. Models whose layers differ (Gemma 2/3 alternate local and global
layers) pass no window and keep every block; vLLM's hybrid allocator, one block table per kind of layer,
is the full answer there.

KV from outside the pool (the CPU KV tier, a prefill engine's blocks) is the KV connectors' business
(server/core/kv_connector.py): the scheduler asks them how far a prefix continues past the hits found here
and allocates blocks for those tokens too (``cache=False`` until they are loaded, then ``cache_blocks``);
``on_evict`` tells them of each cached block the pool is about to reuse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagedserve.common.block_hash import hash_block, salted_root, seed_hash
from pagedserve.server.core.block_pool import Block, BlockPool
from pagedserve.server.core.kv_events import BlockStored
from pagedserve.server.request import Request


def uniform_sliding_window(layer_windows: Iterable[int | None]) -> int | None:
    """The window the KV cache may slide by: the one every attention layer shares (each layer's, all
    pipeline stages': ``DecoderForCausalLM.sliding_windows``). ``None`` when a layer attends to everything,
    including models whose layers differ (Gemma 2/3's local and global layers: the global ones need every
    block)."""
    windows = set(layer_windows)
    return windows.pop() if len(windows) == 1 else None


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        hash_seed: str,
        sliding_window: int | None = None,
        enable_kv_events: bool = False,
        on_evict: Callable[[bytes, int], None] | None = None,
    ) -> None:
        """``on_evict(block_hash, block_id)``: called for each cached block the pool is about to reuse
        (a KV connector's ``on_block_evicted``)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_kv_events=enable_kv_events, on_evict=on_evict)
        # Stands in the block table for blocks freed behind the window; held for good, never cached.
        self.null_block: Block | None = self.pool.allocate(1)[0] if sliding_window is not None else None
        self.root_hash = seed_hash(hash_seed)
        self.req_blocks: dict[str, list[Block]] = {}
        # Each request's block table as ids, kept beside req_blocks so a step reads it without a copy
        # (the runner indexes it by request id; nobody outside this class changes it)
        self.req_block_ids: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[bytes]] = {}
        self.req_num_cached: dict[str, int] = {}  # leading blocks already registered, to skip them
        self.req_num_skipped: dict[str, int] = {}  # leading blocks already behind the window (null)
        self.prefix_queries = 0  # prompt tokens looked up, in tokens as vLLM counts them
        self.prefix_hits = 0  # ... found on the device

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_of(self, request_id: str) -> list[Block]:
        return self.req_blocks.get(request_id, [])

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the live list: read it, never change it)."""
        return self.req_block_ids.get(request_id, [])

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """The longest cached prefix of the request's tokens, as blocks for the start of its table.

        The last token is always computed (its logits are needed), so a fully cached prompt gives up
        its final block. A request still owing prompt logprobs needs the logits of every prompt position,
        so it takes no hits (as in vLLM), though the blocks it fills are cached for others. With a
        sliding window only the blocks inside the window of the first computed token must be cached;
        the null block stands for those before it. Nothing changes until ``allocate``.
        """
        if not self.enable_caching or request.skips_prefix_cache:
            return []
        hashes = self.full_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        found = [self.pool.lookup(block_hash) for block_hash in hashes[:max_blocks]]
        num_hit = self._longest_usable_prefix(found)
        skipped = self._num_skipped_blocks(num_hit * self.block_size)
        hits = [self.null_block] * skipped + found[skipped:num_hit]
        self.prefix_queries += request.num_tokens
        self.prefix_hits += num_hit * self.block_size
        return hits  # type: ignore[return-value]  # the null block is one only with a window

    def _longest_usable_prefix(self, found: list[Block | None]) -> int:
        """The most leading blocks a request can take: every block it still needs there is cached."""
        if self.sliding_window is None:
            return next((i for i, block in enumerate(found) if block is None), len(found))
        best, run = 0, 0  # run: cached blocks ending at block i
        for i, block in enumerate(found):
            run = run + 1 if block is not None else 0
            if run >= i + 1 - self._num_skipped_blocks((i + 1) * self.block_size):
                best = i + 1
        return best

    def _num_skipped_blocks(self, num_computed: int) -> int:
        """Leading blocks wholly before the window of the token at ``num_computed``: never read again.
        The window holds positions ``num_computed - sliding_window + 1 .. num_computed`` (HF's)."""
        if self.sliding_window is None:
            return 0
        return max(num_computed - self.sliding_window + 1, 0) // self.block_size

    def allocate(
        self, request: Request, num_new_tokens: int, cached: list[Block] | None = None, cache: bool = True,
    ) -> bool:
        """Room for ``num_new_tokens`` more tokens after the computed ones (and ``cached`` hits).
        ``cache=False``: the new blocks are not findable until ``cache_blocks`` (their KV comes from
        a KV connector, server/core/kv_connector.py, and is not there yet).

        Returns False when the pool cannot supply the blocks, changing nothing but the return of blocks
        that have fallen out of the sliding window (which are never read again either way).
        """
        blocks = self.req_blocks.get(request.request_id)
        if not cached and blocks is not None and self.sliding_window is None:
            # Most steps of a decode: its blocks hold the new token already (one check, no allocation).
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens <= len(blocks) * self.block_size:
                if self.enable_caching:
                    self._cache_full_blocks(request, blocks, num_tokens)
                return True
        cached = cached or []
        if blocks is None:
            blocks = self.req_blocks[request.request_id] = []
            self.req_block_ids[request.request_id] = []
        num_computed = request.num_computed_tokens + len(cached) * self.block_size
        self._free_skipped_blocks(request.request_id, blocks, num_computed)
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(blocks) - len(cached)
        taken = [b for b in cached if b is not self.null_block]
        # Hits that sit in the free queue stop being free once touched.
        reclaimed = sum(1 for b in taken if b.ref_cnt == 0)
        if needed + reclaimed > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[request.request_id]
                del self.req_block_ids[request.request_id]
            return False
        self.pool.touch(taken)
        added = cached
        if needed > 0:
            added = [*added, *self.pool.allocate(needed)]
        blocks.extend(added)
        self.req_block_ids[request.request_id].extend(b.block_id for b in added)
        if self.enable_caching and cache:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (the scheduler has the connectors forget theirs)."""
        self.pool.reset_prefix_cache()

    def cache_blocks(self, request: Request) -> None:
        """Make the full blocks of the request's computed tokens findable (after ``cache=False``)."""
        if self.enable_caching:
            self._cache_full_blocks(request, self.req_blocks[request.request_id], request.num_computed_tokens)

    def detach(self, request: Request) -> list[Block] | None:
        """A finished request's blocks, taken from it without being freed: held for a peer engine to read
        (server/core/mooncake_connector.py), then given to ``release``. None, and nothing taken, when some
        of them fell behind the sliding window already."""
        blocks = self.req_blocks.get(request.request_id, [])
        if self.null_block is not None and self.null_block in blocks:
            return None
        for table in (self.req_blocks, self.req_block_ids, self.req_hashes, self.req_num_cached,
                      self.req_num_skipped):
            table.pop(request.request_id, None)
        return blocks

    def release(self, blocks: list[Block]) -> None:
        """Free blocks ``detach`` took, last first (as ``free`` does: the prefix's end is evicted first)."""
        self.pool.free(list(reversed(blocks)))

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_block_ids.pop(request.request_id, None)
        self.req_hashes.pop(request.request_id, None)
        self.req_num_cached.pop(request.request_id, None)
        first_real = self.req_num_skipped.pop(request.request_id, 0)
        self.pool.free([b for b in reversed(blocks[first_real:]) if b is not self.null_block])

    def _free_skipped_blocks(self, request_id: str, blocks: list[Block], num_computed: int) -> None:
        """Return the blocks behind the window of the token at ``num_computed``; the null block takes
        their places, so positions still index the table."""
        done = self.req_num_skipped.get(request_id, 0)
        skipped = min(self._num_skipped_blocks(num_computed), len(blocks))
        if skipped <= done:
            return
        # Oldest first, so evicted first: a windowed prefix hit needs the blocks nearest its end.
        self.pool.free([b for b in blocks[done:skipped] if b is not self.null_block])
        blocks[done:skipped] = [self.null_block] * (skipped - done)
        assert self.null_block is not None  # a window exists, so it does
        self.req_block_ids[request_id][done:skipped] = [self.null_block.block_id] * (skipped - done)
        self.req_num_skipped[request_id] = skipped

    def full_block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of every full block of the request's known tokens, extended incrementally."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        if len(hashes) < num_full:
            lora_name = request.lora_request.lora_name if request.lora_request is not None else None
            parent = hashes[-1] if hashes else salted_root(self.root_hash, request.cache_salt, lora_name)
            size = self.block_size
            for i in range(len(hashes), num_full):
                start, end = i * size, (i + 1) * size
                images = b"".join(image.hash for image in request.mm_inputs if image.rows_in(start, end))
                parent = hash_block(parent, request.token_slice(start, end), images)
                hashes.append(parent)
        return hashes

    def _cache_full_blocks(self, request: Request, blocks: list[Block], num_tokens: int) -> None:
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        done = self.req_num_cached.get(request.request_id, 0)
        if num_full <= done:
            return
        hashes = self.full_block_hashes(request)
        stored = []
        for i in range(done, num_full):
            # A hit past the window (null) was never taken; cache() is False for blocks already findable.
            if blocks[i] is not self.null_block and self.pool.cache(blocks[i], hashes[i]):
                stored.append(i)
        self.req_num_cached[request.request_id] = num_full
        if stored and self.pool.events is not None:
            self._record_stored(request, hashes, stored)

    def _record_stored(self, request: Request, hashes: list[bytes], stored: list[int]) -> None:
        """One BlockStored per run of consecutive newly stored blocks (vLLM's shape: a chain with the
        parent of its first block)."""
        size = self.block_size
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            self.pool.events.append(
                BlockStored(
                    block_hashes=[hashes[i] for i in run],
                    parent_block_hash=hashes[first - 1] if first > 0 else None,
                    token_ids=request.token_slice(first * size, (last + 1) * size),
                    block_size=size,
                )
            )
