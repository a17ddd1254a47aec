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


def check_tensor_parallel(hf_config: Any, size: int) -> None:
    """ValueError, naming the numbers, unless the model splits across ``size`` ranks: query heads and
    the MLP width divide by it, and KV heads divide by it or it by them (then they are replicated)."""
    if size == 1:
        return
    from pagedserve.server.models.registry import get_model_class

    model_class = get_model_class(hf_config)
    if not model_class.supports_tensor_parallel:
        raise ValueError(f"{model_class.__name__} does not support tensor parallelism yet "
                         f"(tensor_parallel_size {size}); run it with tensor_parallel_size 1")
    spec = model_class.spec_from_config(hf_config)
    heads, kv_heads = spec.num_heads, spec.num_kv_heads
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ValueError(
            f"tensor_parallel_size {size} does not split the model's attention heads: "
            f"{heads} query heads and {kv_heads} KV heads (query heads must divide by it, KV heads by it "
            f"or it by them)"
        )
    if spec.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the MLP's intermediate_size "
                         f"{spec.intermediate_size}")
