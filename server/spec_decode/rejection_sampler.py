"""Verifies a request's draft tokens against the target model's logits at each drafted position.

The runner (server/worker/model_runner.py) computes logits at the last known token and at each draft;
row ``i`` is the target's next-token distribution after ``drafts[:i]``. Each row is processed exactly as
server/sample/sampler.py processes a normal step (allowed ids, bad words, min_tokens, bias, penalties,
then temperature, min-p, top-k/p), with the request seen as if ``drafts[:i]`` were already generated,
so the tokens that come out are distributed exactly as without speculation:

- greedy: drafts are accepted while they equal the target's argmax; the argmax after them follows.
- random (Leviathan et al. 2023, vLLM's RejectionSampler): draft ``x`` is accepted with probability
  ``min(1, p(x) / q(x))``; at the first rejection a token is drawn from ``normalize(max(p - q, 0))``,
  after all ``k`` accepted a bonus token from ``p``. An n-gram draft is a point mass (``q(x) = 1``); a
  draft model sampling at the request's temperature passes its ``q`` (server/spec_decode/draft_model.py).
  Uniforms and draws come from the request's own generator when it is seeded, so seeds reproduce.

A request with a grammar verifies only the drafts its matcher admits (and the first it refuses), each
position under its own bitmask (server/spec_decode/grammar_drafts.py).
"""

from __future__ import annotations

import dataclasses

import torch
from pagedserve.server.request import Request
from pagedserve.server.sample.sampler import (
    SampledToken,
    exponential_race,
    filtered_probs,
    process_logits,
    sampler_output,
)
from pagedserve.server.spec_decode.grammar_drafts import check_drafts
from pagedserve.server.structured_output.bitmask import GrammarBitmask


def verify_drafts(logits: torch.Tensor, request: Request, draft_token_ids: list[int],
                  draft_probs: torch.Tensor | None = None) -> list[SampledToken]:
    """``logits`` ``[k + 1, vocab]`` for ``k`` drafts: the accepted drafts and one more token.
    ``draft_probs`` ``[k, vocab]``: the distributions a sampling draft model drew the drafts from (None:
    each draft a point mass, as n-gram and greedy drafts are)."""
    grammar: GrammarBitmask | None = None
    if request.grammar is not None:
        draft_token_ids, grammar = check_drafts(request.grammar, draft_token_ids)
        grammar.bits = grammar.bits.to(logits.device)
        logits = logits[: len(draft_token_ids) + 1]
        draft_probs = draft_probs[: len(draft_token_ids)] if draft_probs is not None else None
    views = position_views(request, draft_token_ids)
    processed, raw_logprobs = process_logits(logits, views, grammar)
    if request.params.greedy:
        target = processed.argmax(dim=-1)
        num_accepted = _num_leading_equal(target[:-1].tolist(), draft_token_ids)
        token_ids = target[: num_accepted + 1]
    else:
        probs = filtered_probs(processed, views)
        drafts = torch.tensor(draft_token_ids, dtype=torch.long, device=logits.device)
        token_ids = accept_drafts(probs, drafts, draft_probs, request.generator)
    kept = views[: len(token_ids)]
    raw = raw_logprobs[: len(token_ids)] if raw_logprobs is not None else None
    return sampler_output(token_ids, raw, kept).to_host(kept)


def position_views(request: Request, draft_token_ids: list[int]) -> list[Request]:
    """The request as the sampler must see it at each drafted position: drafts[:i] already generated.
    Shallow copies: the params, the generator and the prompt are the request's own objects."""
    outputs = request.output_token_ids
    return [request] + [
        dataclasses.replace(request, output_token_ids=outputs + draft_token_ids[:i])
        for i in range(1, len(draft_token_ids) + 1)
    ]


def accept_drafts(probs: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                  generator: torch.Generator | None) -> torch.Tensor:
    """The standard rejection rule over ``k`` drafts: ``probs`` ``[k + 1, vocab]`` the target's,
    ``draft_probs`` ``[k, vocab]`` the proposer's (None: each draft a point mass). Returns the accepted
    drafts followed by one recovered or bonus token."""
    k = draft_token_ids.shape[0]
    rows = torch.arange(k, device=probs.device)
    target_p = probs[rows, draft_token_ids]
    draft_q = draft_probs[rows, draft_token_ids] if draft_probs is not None else torch.ones_like(target_p)
    uniform = torch.rand(k, generator=generator, device=probs.device)
    # u < p / q, written without the division; q > 0 at the draft that q itself proposed.
    accepted = (uniform * draft_q < target_p).tolist()
    num_accepted = _num_leading_equal(accepted, [True] * k)
    if num_accepted == k:
        last = probs[k:k + 1]
    else:
        q = draft_probs[num_accepted] if draft_probs is not None else torch.zeros_like(probs[0]).index_fill(
            0, draft_token_ids[num_accepted:num_accepted + 1], 1.0)
        residual = (probs[num_accepted] - q).clamp_min(0)
        # All mass on the draft (p == q there) cannot be rejected; the guard keeps rounding from a 0-row.
        last = (residual if bool(residual.sum() > 0) else probs[num_accepted]).unsqueeze(0)
    extra = exponential_race(last, [generator])  # the race needs no normalisation
    return torch.cat([draft_token_ids[:num_accepted], extra])


def _num_leading_equal(values: list, expected: list) -> int:
    for i, (value, wanted) in enumerate(zip(values, expected, strict=False)):
        if value != wanted:
            return i
    return min(len(values), len(expected))
