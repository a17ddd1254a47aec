"""The token ids of text segments the router has tokenized (router/hashing.py: the text between added
tokens of a rendered prompt), least recently used first out, bounded by bytes.

Bounded by bytes, not entries: a segment is anything from one word to a 100k-token document, so a
bound on entries bounds nothing (4,096 long system prompts are gigabytes). An entry's size counts its
text, its ids (4 bytes each, kept in an ``array``) and the bookkeeping of the cache around them.
Segments too large for the whole budget are not cached. Safe to use from several threads (long prompts
are hashed in worker threads, router/proxy.py).
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from cachetools import LRUCache

# What one entry costs beside its text and ids: the cache's dicts (data, sizes, LRU order) and the
# entry object; measured with sys.getsizeof on CPython 3.11-3.13, rounded up.
ENTRY_OVERHEAD_BYTES = 400


@dataclass(frozen=True, slots=True)
class _Segment:
    ids: array
    nbytes: int


class SegmentCache:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._cache: LRUCache[str, _Segment] = LRUCache(maxsize=max_bytes, getsizeof=lambda s: s.nbytes)
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes held now (the sum of the entries' sizes)."""
        return int(self._cache.currsize)

    def __len__(self) -> int:
        return len(self._cache)

    def get(self, text: str) -> array | None:
        with self._lock:
            segment = self._cache.get(text)
        return None if segment is None else segment.ids

    def put(self, text: str, ids: Sequence[int]) -> array:
        """Cache ``ids`` for ``text`` (unless they alone exceed the budget); returns them as an array."""
        packed = array("I", ids)  # tokenizers' ids are u32
        nbytes = sys.getsizeof(text) + sys.getsizeof(packed) + ENTRY_OVERHEAD_BYTES
        if nbytes <= self.max_bytes:
            with self._lock:
                self._cache[text] = _Segment(packed, nbytes)
        return packed

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
