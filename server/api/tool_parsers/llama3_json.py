"""Llama 3.1+ JSON tool calls: the reply is ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``),
several separated by ``;``, optionally after ``<|python_tag|>``. A reply that starts otherwise is content
(vLLM reads calls anywhere in a whole reply but only at the start of a streamed one; here both read them
at the start, so a streamed reply and a whole one agree)."""

from __future__ import annotations

from pagedserve.server.api.tool_parsers.base import ParsedOutput, ToolParser
from pagedserve.server.api.tool_parsers.partial_json import scan_calls, skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str) -> ParsedOutput:
        pos = skip_whitespace(text, 0)
        rest = text[pos:]
        if not rest or PYTHON_TAG.startswith(rest):
            return ParsedOutput()  # not yet known whether this is a call
        if rest.startswith(PYTHON_TAG):
            pos = skip_whitespace(text, pos + len(PYTHON_TAG))
        elif not rest.startswith("{"):
            return ParsedOutput(content=text)
        return ParsedOutput(calls=scan_calls(text, pos, ";", ("parameters", "arguments")))
