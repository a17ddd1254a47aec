"""The pooling runner's half of a step: a pooling request's hidden states into its one vector.

A prompt may run in several chunks (chunked prefill, or a recompute after preemption, which starts
again at position 0), so MEAN keeps a running sum on the request and CLS the first position; the
chunk that ends the prompt makes the vector: the last position's state (LAST), the mean, or the first;
then the first ``dimensions`` values (Matryoshka) and unit length when the params say so, in float32
as sentence-transformers computes it. The model runner (server/worker/model_runner.py) finds the rows;
the vector leaves the device when the step is read back (``LaunchedStep.result``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagedserve.server.request import Request


@dataclass
class PoolingRows:
    """The positions ``[start, start + num_rows)`` of a pooling request's prompt computed this step,
    starting at ``row`` of the step's hidden states."""

    request: Request
    row: int
    start: int
    num_rows: int

    @property
    def completes(self) -> bool:
        return self.start + self.num_rows == self.request.num_prompt_tokens


def pool(hidden: torch.Tensor, rows: PoolingRows) -> torch.Tensor | None:
    """Fold this chunk into the request's pooling; its vector once the chunk ends the prompt, else None."""
    request, params = rows.request, rows.request.pooling
    assert params is not None and params.pooling_type is not None
    chunk = hidden[rows.row : rows.row + rows.num_rows].float()
    if params.pooling_type == "MEAN":
        total = chunk.sum(dim=0)
        if rows.start > 0 and request.pooling_sum is not None:
            total += request.pooling_sum
        request.pooling_sum = total
    elif params.pooling_type == "CLS" and rows.start == 0:
        request.pooling_sum = chunk[0].clone()  # hidden's buffer is the step's only
    if not rows.completes:
        return None
    if params.pooling_type == "LAST":
        vector = chunk[-1]
    elif params.pooling_type == "MEAN":
        vector = request.pooling_sum / request.num_prompt_tokens
    else:
        vector = request.pooling_sum
    request.pooling_sum = None
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector
