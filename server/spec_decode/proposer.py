"""Decides, after each step, which requests get draft tokens for the next one and how many.

Drafting must not slow down what it cannot help (issue 18), so a request is not drafted for when:
- more than ``disable_by_batch_size`` requests run (vLLM's knob: the forward is compute-bound there and
  extra positions cost about what they save),
- its acceptance estimate is low: an EWMA of the share of drafts accepted per step shortens ``k`` in
  proportion and, below ``OFF_BELOW``, stops drafting for ``COOLDOWN_STEPS`` steps, after which one short
  probe is made again (text changes: a rewrite may follow a free-form preamble).
Drafts never pass max_tokens or max_model_len: the token after the last draft is always emitted too.
The same decision serves both methods: n-gram drafts are looked up here; a draft model's are only counted
here (``PENDING`` placeholders, so the scheduler reserves their slots) and filled in by the model runner
at the start of the step that verifies them (server/spec_decode/draft_model.py), once their KV slots
exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from pagedserve.server.request import Request
from pagedserve.server.spec_decode.metrics import SpecDecodingStats
from pagedserve.server.spec_decode.ngram import propose_ngram
from pagedserve.server.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from pagedserve.server.core.scheduler import Sampled, ScheduledRequest

EWMA_WEIGHT = 0.3  # weight of the newest step in the acceptance estimate
FULL_AT = 0.5  # estimate from which the full k is drafted; below it k shrinks in proportion
OFF_BELOW = 0.15  # estimate under which drafting pauses
COOLDOWN_STEPS = 8
PENDING = -1  # a draft model's token, chosen by the runner in the step that verifies it


class DraftProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats(config.num_speculative_tokens)  # vllm:spec_decode_* metrics

    def record(self, scheduled: Sequence[ScheduledRequest], sampled: Sampled) -> None:
        """Count a step's verified drafts, in the metrics and in each request's acceptance estimate."""
        drafts = {s.request.request_id: len(s.spec_token_ids) for s in scheduled if s.spec_token_ids}
        if not drafts:
            return
        for request, tokens in sampled:
            num_drafts = drafts.get(request.request_id)
            if num_drafts and not isinstance(tokens, Exception):
                self.stats.record(num_drafts, len(tokens) - 1)
                record_acceptance(request, num_drafts, len(tokens) - 1)

    def propose(self, requests: list[Request], num_running: int) -> None:
        """Set ``spec_token_ids`` of each request for the next step (empty: a plain decode)."""
        batch_too_large = num_running > self.config.disable_by_batch_size
        for request in requests:
            request.spec_token_ids = [] if batch_too_large else self._drafts(request)

    def _drafts(self, request: Request) -> list[int]:
        # A grammar's requests are drafted for too: their drafts are checked against the matcher when
        # verified (server/spec_decode/grammar_drafts.py).
        if request.finished:
            return []
        if request.spec_cooldown > 0:
            request.spec_cooldown -= 1
            return []
        room = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens)
        k = min(self._allowed(request.spec_acceptance), room - 1)
        if k < 1:
            return []
        if self.config.uses_draft_model:
            return [PENDING] * k
        tokens = np.fromiter(_all_tokens(request), dtype=np.int64, count=request.num_tokens)
        cfg = self.config
        assert cfg.prompt_lookup_min is not None and cfg.prompt_lookup_max is not None
        return propose_ngram(tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max, k)

    def _allowed(self, acceptance: float) -> int:
        k = self.config.num_speculative_tokens
        return max(1, min(k, round(k * acceptance / FULL_AT)))


def record_acceptance(request: Request, num_drafts: int, num_accepted: int) -> None:
    """Fold one verified step into the request's acceptance estimate; pause drafting when it is low."""
    rate = num_accepted / num_drafts
    request.spec_acceptance = (1 - EWMA_WEIGHT) * request.spec_acceptance + EWMA_WEIGHT * rate
    if request.spec_acceptance < OFF_BELOW:
        request.spec_cooldown = COOLDOWN_STEPS
        request.spec_acceptance = OFF_BELOW * 2  # one short probe after the pause


def _all_tokens(request: Request):
    yield from request.prompt_token_ids
    yield from request.output_token_ids
