"""Which rank of how many this process is, for the layers being built.

Layers read ``current()`` (their tensor-parallel shard) and ``current_stage()`` (their pipeline stage)
once, when they are constructed, and keep them: the loader builds a model inside ``building(tp, stage)``,
so two engines in one process (a TP=1 engine beside a TP=2 one in a test) never see each other's state.

Ranks are numbered stage by stage: global rank ``stage * tp_size + tp_rank``, so rank 0 (the driver, in
the engine process) is stage 0's tensor-parallel rank 0, and each stage's ranks form one tensor-parallel
group.
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


@dataclass(frozen=True)
class PipelineStage:
    """This rank's pipeline stage: a contiguous run of the decoder layers (vLLM's split: the remainder of
    ``num_layers / size`` goes to the first stages). Activations pass from stage s's tensor-parallel rank
    t to stage s+1's rank t, and the last stage hands its final hidden rows back to stage 0, which holds
    the embedding and the LM head: the driver samples, and hidden rows are narrower than logit rows."""

    index: int = 0
    size: int = 1
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def global_rank(self, stage: int) -> int:
        """The global rank of ``stage``'s tensor-parallel rank that pairs with this one."""
        return stage * self.tp_size + self.tp_rank

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of the layers this stage holds."""
        if num_layers < self.size:
            raise ValueError(f"pipeline_parallel_size {self.size} exceeds the model's {num_layers} layers")
        base, extra = divmod(num_layers, self.size)
        start = self.index * base + min(self.index, extra)
        return start, start + base + (self.index < extra)


SINGLE = TensorParallel()
ONE_STAGE = PipelineStage()
_current = SINGLE
_current_stage = ONE_STAGE


def current() -> TensorParallel:
    return _current


def current_stage() -> PipelineStage:
    return _current_stage


@contextlib.contextmanager
def building(tp: TensorParallel, stage: PipelineStage = ONE_STAGE) -> Iterator[None]:
    """Layers constructed inside take ``tp``'s shard of ``stage``'s layers."""
    global _current, _current_stage
    previous = _current, _current_stage
    _current, _current_stage = tp, stage
    try:
        yield
    finally:
        _current, _current_stage = previous
