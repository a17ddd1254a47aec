"""Which rank of how many this process is, for the layers being built.

Layers read ``current()`` once, when they are constructed, and keep it: the loader builds a model inside
``building(tp)``, so two engines in one process (a TP=1 engine beside a TP=2 one in a test) never see each
other's state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group; ``group`` None: one rank, no collectives."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def piece(self, total: int, pieces: int | None = None) -> tuple[int, int]:
        """(start, size) of this rank's piece when ``total`` is cut into ``pieces`` equal pieces (default
        one per rank); with fewer pieces than ranks, neighbouring ranks share one (replicated KV heads)."""
        pieces = pieces or self.size
        if total % pieces:
            raise ValueError(f"{total} does not split into {pieces} equal pieces")
        size = total // pieces
        return (self.rank * pieces // self.size) * size, size


SINGLE = TensorParallel()
_current = SINGLE


def current() -> TensorParallel:
    return _current


@contextlib.contextmanager
def building(tp: TensorParallel) -> Iterator[None]:
    """Layers constructed inside take ``tp``'s shard."""
    global _current
    previous, _current = _current, tp
    try:
        yield
    finally:
        _current = previous
