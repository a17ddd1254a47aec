"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``): the log-probability, rank and top-k
alternatives of each prompt token after the first, from the logits of the position before it.

The runner (server/worker/model_runner.py) finds the rows of a step that a request still owes prompt
logprobs for (a chunked prompt spans several steps; a recomputed one skips what it already has) and
appends them to ``Request.prompt_logprobs`` as token ids and floats; their text is made by the front
end (server/engine/output_processor.py). Rows are turned into logits a slice at a time, so a long
prompt never holds a ``[prompt_len, vocab]`` tensor at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from pagedserve.server.outputs import SampledToken
from pagedserve.server.request import Request

ROWS_PER_SLICE = 256  # prompt positions turned into logits at once: 256 x 49k vocab x 4 B = 50 MB


@dataclass
class PromptLogprobRows:
    """The positions ``[first, last)`` of one request's prompt computed in this step, whose logits give
    the logprobs of prompt tokens ``first + 1 .. last``; they start at ``row`` of the step's hidden states."""

    request: Request
    row: int
    first: int
    last: int


def prompt_logprob_rows(request: Request, row: int, start: int, end: int) -> PromptLogprobRows | None:
    """What a chunk of positions ``[start, end)`` starting at hidden row ``row`` adds to the request's
    prompt logprobs, or None when it adds nothing (not asked for, already computed, or past the prompt)."""
    if not request.needs_prompt_logprobs:
        return None
    assert request.prompt_logprobs is not None
    first = max(start, len(request.prompt_logprobs))
    last = min(end, request.num_prompt_tokens - 1)
    if first >= last:
        return None
    return PromptLogprobRows(request, row + first - start, first, last)


def record_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, rows: PromptLogprobRows
) -> None:
    """``compute_logits``: the runner's (it reaches every tensor-parallel rank)."""
    request = rows.request
    assert request.prompt_logprobs is not None and request.params.prompt_logprobs is not None
    for first in range(rows.first, rows.last, ROWS_PER_SLICE):
        last = min(first + ROWS_PER_SLICE, rows.last)
        row = rows.row + first - rows.first
        logits = compute_logits(hidden[row : row + last - first])
        targets = request.prompt_token_ids[first + 1 : last + 1]
        request.prompt_logprobs.extend(
            token_logprobs(torch.log_softmax(logits, dim=-1), targets, request.params.prompt_logprobs)
        )


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], num_top: int) -> list[SampledToken]:
    """Per row of ``logprobs`` ``[n, vocab]``: the logprob and rank of ``token_ids[row]`` and the
    ``num_top`` most likely tokens."""
    chosen = torch.tensor(token_ids, device=logprobs.device).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen)
    ranks = ((logprobs > chosen_logprobs).sum(dim=-1) + 1).tolist()
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
    values = chosen_logprobs.squeeze(1).tolist()
    tops = top_ids.tolist() if top_ids is not None else [[] for _ in token_ids]
    top_values = top_logprobs.tolist() if top_logprobs is not None else [[] for _ in token_ids]
    return [
        SampledToken(token_id, logprob, rank, ids, lps)
        for token_id, logprob, rank, ids, lps in zip(token_ids, values, ranks, tops, top_values, strict=True)
    ]
