"""One request's position in its grammar: ``Request.grammar`` (server/request.py).

server/engine/core.py feeds it every token the request accepts, so its state always equals replaying
``output_token_ids`` from the start: preemption by recompute keeps those tokens (server/core/scheduler.py),
so the state needs no rebuilding. A token the matcher refuses (never sampled through the mask, but a
bug must not corrupt the output) fails that request alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class GrammarState:
    matcher: Any  # llguidance.LLMatcher
    vocab_size: int  # the width the token bitmask covers
    eos_token_ids: frozenset[int]  # the model's EOS ids: the grammar admits them once it is satisfied
    finished: bool = False  # it took an EOS: the request ends with "stop", even with ignore_eos

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and an error state) when the grammar refuses it.

        A complete grammar admits only EOS (its mask), as in vLLM: the EOS token then ends the request,
        so the front end treats it as any EOS (server/engine/output_processor.py leaves it out of the text).
        """
        accepted = bool(self.matcher.consume_token(token_id))
        self.finished = accepted and token_id in self.eos_token_ids
        return accepted

    @property
    def error(self) -> str:
        return str(self.matcher.get_error())
