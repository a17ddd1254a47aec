"""The replies that the grammar forces (server/api/protocol.py ``tool_calls_schema``): with
``tool_choice: "required"`` a JSON array of ``{"name", "parameters"}`` objects; with a named function
that function's arguments object alone."""

from __future__ import annotations

from pagedserve.server.api.tool_parsers.base import ParsedOutput, ToolParser
from pagedserve.server.api.tool_parsers.partial_json import (
    PartialCall,
    scan_calls,
    skip_whitespace,
    value_text,
)


class RequiredToolParser(ToolParser):
    name = "required"

    def parse(self, text: str) -> ParsedOutput:
        pos = skip_whitespace(text, 0)
        if not text.startswith("[", pos):
            return ParsedOutput()
        return ParsedOutput(calls=scan_calls(text, pos + 1, ",", ("parameters",)))


class NamedToolParser(ToolParser):
    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str) -> ParsedOutput:
        pos = skip_whitespace(text, 0)
        arguments, end = value_text(text, pos)
        return ParsedOutput(calls=[PartialCall(self.function, arguments, end is not None)])
