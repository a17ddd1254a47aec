"""Drafts of a request with a grammar (structured outputs), checked against its matcher before their
verification (server/spec_decode/rejection_sampler.py).

The drafts the grammar admits are kept, and the first one it refuses too: under its position's mask the
target gives that draft probability 0, so verification rejects it with certainty and draws the token there
from the residual ``max(p - q, 0)``, which keeps sampling exact when a draft model drew it from its own
``q`` (dropping it instead would draw from ``p`` and bias the output). The drafts after it are cut. The
bitmask of every verified position comes from the matcher advanced over the drafts before it, and the
matcher is rolled back afterwards: server/engine/core.py advances it by the accepted tokens only.
"""

from __future__ import annotations

import torch
from pagedserve.server.grammar_state import GrammarState, Phase
from pagedserve.server.structured_output.bitmask import BITS, GrammarBitmask, fill_row


def check_drafts(grammar: GrammarState, drafts: list[int]) -> tuple[list[int], GrammarBitmask]:
    """The drafts to verify and the mask of each of their ``len + 1`` positions (as batch rows 0..).
    Before a reasoning model's answer (server/grammar_state.py ``Phase``) none: the step samples one
    free token, as without speculation."""
    words = (grammar.vocab_size + BITS - 1) // BITS
    if grammar.phase is not Phase.ANSWERING:
        bits = torch.empty((1, words), dtype=torch.int32)
        fill_row(grammar, bits, 0)
        return [], GrammarBitmask([0], bits)
    matcher = grammar.matcher
    num_valid = int(matcher.validate_tokens(drafts))
    kept = drafts[: num_valid + 1]
    masks = [_mask(matcher, words)]
    consumed = 0
    for token in kept[:num_valid]:
        # Past an EOS the matcher is stopped: positions after it end the request if reached, never sampled.
        if token in grammar.eos_token_ids or not matcher.consume_token(token):
            break
        consumed += 1
        masks.append(_mask(matcher, words))
    if consumed:
        matcher.rollback(consumed)
    # Positions after a refused draft or an EOS draft: their tokens are never kept (see above).
    masks.extend([masks[-1]] * (len(kept) + 1 - len(masks)))
    return kept, GrammarBitmask(list(range(len(masks))), torch.cat(masks))


def _mask(matcher: object, words: int) -> torch.Tensor:
    bits = torch.empty((1, words), dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(bits.data_ptr(), words * 4)  # type: ignore[attr-defined]
    return bits
