"""What every tool-call parser gives: the text meant as content and the calls, read from the text
generated so far (server/api/tool_parsers/stream.py turns successive readings into OpenAI's deltas)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from pagedserve.server.api.tool_parsers.partial_json import PartialCall


@dataclass
class ParsedOutput:
    """One reading of the output so far. As the text grows, ``content`` and each call's ``arguments``
    only grow (each is a prefix of its next reading) and a call's name, once read, stays."""

    content: str = ""  # a prefix of the text: what is content for sure
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser(ABC):
    """Reads tool calls from a model's output (``--tool-call-parser``, or the forced forms)."""

    name: ClassVar[str]
    # Tool-call markers are special tokens in some tokenizers: the text must keep them.
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The content and calls in ``text``, the output so far (it may stop anywhere)."""
