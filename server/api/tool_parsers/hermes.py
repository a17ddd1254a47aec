"""Hermes-style tool calls (Hermes 2 Pro, Qwen 2.5 and 3): ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``, one block per call, after optional text (the content)."""

from __future__ import annotations

from pagedserve.server.api.tool_parsers.base import ParsedOutput, ToolParser
from pagedserve.server.api.tool_parsers.partial_json import scan_call

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    keeps_special_tokens = True  # <tool_call> is an added token in these tokenizers

    def parse(self, text: str) -> ParsedOutput:
        first = text.find(START)
        if first < 0:
            return ParsedOutput(content=text[: len(text) - _partial_marker(text)])
        calls = []
        at = first
        while at >= 0:
            call, _ = scan_call(text, at + len(START), ("arguments", "parameters"))
            calls.append(call)
            at = text.find(START, at + len(START))
        return ParsedOutput(content=text[:first], calls=calls)


def _partial_marker(text: str) -> int:
    """How many characters at the end of ``text`` could begin a ``<tool_call>`` still to come."""
    for size in range(min(len(START) - 1, len(text)), 0, -1):
        if text.endswith(START[:size]):
            return size
    return 0
