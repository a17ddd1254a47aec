"""One request's position in its grammar: ``Request.grammar`` (server/request.py).

server/engine/core.py feeds it every token the request accepts, so its state always equals replaying
``output_token_ids`` from the start: preemption by recompute keeps those tokens (server/core/scheduler.py),
so the state needs no rebuilding. A token the matcher refuses (never sampled through the mask, but a
bug must not corrupt the output) fails that request alone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from pagedserve.server.sampling_params import ThinkGate


class Phase(enum.Enum):
    """Where a reasoning model's reply is, for its grammar (``ThinkGate``); ANSWERING without a gate."""

    DECIDING = 0  # its first token says whether it reasons: the opening tag, or the answer's first token
    THINKING = 1  # free text up to the closing tag; the grammar waits
    ANSWERING = 2  # every token through the grammar


@dataclass(eq=False)
class GrammarState:
    matcher: Any  # llguidance.LLMatcher
    vocab_size: int  # the width the token bitmask covers
    eos_token_ids: frozenset[int]  # the model's EOS ids: the grammar admits them once it is satisfied
    finished: bool = False  # it took an EOS: the request ends with "stop", even with ignore_eos
    gate: ThinkGate | None = None
    phase: Phase = Phase.ANSWERING

    def __post_init__(self) -> None:
        if self.gate is not None:
            self.phase = Phase.THINKING if self.gate.thinks_from_start else Phase.DECIDING

    @property
    def waiting(self) -> bool:
        """The reply is reasoning: its tokens are free, the grammar takes none of them."""
        return self.phase is Phase.THINKING

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and an error state) when the grammar refuses it.

        A complete grammar admits only EOS (its mask), as in vLLM: the EOS token then ends the request,
        so the front end treats it as any EOS (server/engine/output_processor.py leaves it out of the text).
        Reasoning tokens pass without reaching the matcher; the closing tag hands over to it.
        """
        if self.phase is Phase.THINKING:
            if token_id == self.gate.end_token_id:  # type: ignore[union-attr]
                self.phase = Phase.ANSWERING
            return True
        if self.phase is Phase.DECIDING:
            self.phase = Phase.ANSWERING
            if token_id == self.gate.start_token_id:  # type: ignore[union-attr]
                self.phase = Phase.THINKING
                return True
        accepted = bool(self.matcher.consume_token(token_id))
        self.finished = accepted and token_id in self.eos_token_ids
        return accepted

    @property
    def error(self) -> str:
        return str(self.matcher.get_error())
