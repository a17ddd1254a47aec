"""A reply split into reasoning and answer by its model family's think tags (vLLM's reasoning parsers).

``split`` is the rule for a whole reply; server/api/reasoning_parsers/stream.py applies the same rule to
a reply streamed piece by piece.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str  # the tag that opens the reasoning, when the reply writes it (first, before any text)
    end: str  # the tag that closes it; the answer follows
    # True: the reply is reasoning from its first token, whether or not it writes the opening tag (the
    # prompt opened it); False: only a reply that opens with the tag has reasoning, any other is answer.
    thinks_from_start: bool

    def opens(self, text: str) -> bool | None:
        """Whether ``text`` (a reply, or its beginning) is in reasoning; None: too short to tell."""
        stripped = text.lstrip()
        if self.thinks_from_start or stripped.startswith(self.start):
            return True
        return None if self.start.startswith(stripped) else False

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply; None for a part that is not there. The reasoning runs to
        the first closing tag; a reply cut before it is all reasoning."""
        if not self.opens(text):
            return None, text or None
        stripped = text.lstrip()
        body = stripped[len(self.start) :] if stripped.startswith(self.start) else text
        reasoning, closed, content = body.partition(self.end)
        return reasoning or None, (content or None) if closed else None
