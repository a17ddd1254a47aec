"""One choice's streamed reply, split as ``ReasoningParser.split`` splits the whole: the concatenated
reasoning deltas equal the whole reply's reasoning, and the content deltas its content.

Until the reply shows whether it opens with the tag, it is held back; inside the reasoning, a tail that
may be the start of the closing tag (``</th`` before ``ink>``) is held back until the next piece says
what it is, so a tag never leaks into either part.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.server.api.reasoning_parsers.base import ReasoningParser


@dataclass
class ReasoningStream:
    parser: ReasoningParser
    text: str = ""
    sent_reasoning: int = 0
    sent_content: int = 0

    def feed(self, piece: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) to send now for ``piece``; both "" when there is nothing yet."""
        self.text += piece
        reasoning, content = self.parser.split(self.text if finished else self._settled())
        reasoning_delta = (reasoning or "")[self.sent_reasoning :]
        content_delta = (content or "")[self.sent_content :]
        self.sent_reasoning += len(reasoning_delta)
        self.sent_content += len(content_delta)
        return reasoning_delta, content_delta

    def _settled(self) -> str:
        """The text whose split no later piece can change."""
        opens = self.parser.opens(self.text)
        if opens is None or self.parser.start.startswith(self.text.lstrip()):
            return ""  # the opening tag may still be on its way
        if not opens or self.parser.end in self.text:
            return self.text
        end = self.parser.end
        for size in range(min(len(self.text), len(end) - 1), 0, -1):
            if end.startswith(self.text[-size:]):
                return self.text[:-size]
        return self.text
