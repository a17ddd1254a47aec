"""The collectives a tensor-parallel model runs, over its ``TensorParallel`` group (no-ops on one rank).

Every rank must call each one, in the same order: the driver tells the other ranks what to run
(server/executor/tp_driver.py), so their calls match its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from pagedserve.server.distributed.parallel_state import PipelineStage, TensorParallel


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The sum of ``x`` over the ranks, on every rank (row-parallel outputs, vocab-parallel lookups)."""
    if tp.size > 1:
        dist.all_reduce(x, group=tp.group)
    return x


def gather_to_driver(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor | None:
    """Rank 0 gets every rank's ``x`` ``[n, k]`` side by side, ``[n, size * k]``; the others get None
    (only the driver samples, so only it needs whole logit rows)."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)] if tp.is_driver else None
    dist.gather(x, parts, dst=dist.get_global_rank(tp.group, 0), group=tp.group)
    return torch.cat(parts, dim=-1) if parts is not None else None


def broadcast_tensor(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Rank 0's ``x`` on every rank (the others pass a tensor of the same shape and dtype to fill)."""
    if tp.size > 1:
        dist.broadcast(x, src=dist.get_global_rank(tp.group, 0), group=tp.group)
    return x


def send_to_stage(tensors: list[torch.Tensor], stage: PipelineStage, to_stage: int) -> None:
    """This rank's ``tensors`` to its peer of stage ``to_stage`` (same tensor-parallel rank), in order."""
    for x in tensors:
        dist.send(x.contiguous(), dst=stage.global_rank(to_stage))


def receive_from_stage(like: list[torch.Tensor], stage: PipelineStage, from_stage: int) -> list[torch.Tensor]:
    """What the peer of stage ``from_stage`` sent with ``send_to_stage``, into tensors shaped as ``like``."""
    for x in like:
        dist.recv(x, src=stage.global_rank(from_stage))
    return like
