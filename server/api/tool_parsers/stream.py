"""Tool calls in OpenAI's response shapes, from a ``ToolParser``'s readings of the output.

A whole reply: ``tool_calls`` with the calls that have a name (content null when there is none around
them); a reply with no call is all content, whatever the parser held back. A streamed reply: each call
once as ``{index, id, type, function: {name, arguments: ""}}`` as soon as its name is complete, then its
arguments in fragments ``{index, function: {arguments}}`` that concatenate to the whole reply's
arguments (the openai client's stream helpers accumulate exactly that); text that turns out to be no
call at all is sent as content when the choice finishes.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedserve.server.api.tool_parsers.base import ToolParser
from pagedserve.server.api.tool_parsers.partial_json import PartialCall


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def named_calls(calls: list[PartialCall], max_calls: int | None) -> list[PartialCall]:
    """The calls whose names are read, in order (a later call cannot come before an earlier's name)."""
    named = []
    for call in calls[:max_calls]:
        if call.name is None:
            break
        named.append(call)
    return named


def tool_call_json(call: PartialCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def whole_reply(
    parser: ToolParser, text: str, max_calls: int | None
) -> tuple[str | None, list[dict[str, Any]]]:
    """A finished reply's message content and tool calls."""
    parsed = parser.parse(text)
    calls = named_calls(parsed.calls, max_calls)
    if not calls:
        return text, []
    return parsed.content or None, [tool_call_json(call, tool_call_id()) for call in calls]


@dataclass
class ToolCallStream:
    """One choice's streamed reply: ``feed`` each new piece of text, get the delta message to send."""

    parser: ToolParser
    max_calls: int | None = None  # 1 without parallel tool calls
    text: str = ""
    sent_content: int = 0
    sent_arguments: list[int] = field(default_factory=list)  # per call sent so far: arguments' length

    @property
    def called(self) -> bool:
        return bool(self.sent_arguments)

    def feed(self, piece: str, finished: bool) -> dict[str, Any]:
        """The delta message (``content`` and/or ``tool_calls``; empty: nothing to send yet)."""
        self.text += piece
        parsed = self.parser.parse(self.text)
        deltas = [
            self._call_delta(i, call) for i, call in enumerate(named_calls(parsed.calls, self.max_calls))
        ]
        content = self.text if finished and not self.called else parsed.content
        delta: dict[str, Any] = {}
        if len(content) > self.sent_content:
            delta["content"] = content[self.sent_content :]
            self.sent_content = len(content)
        if tool_calls := [d for d in deltas if d is not None]:
            delta["tool_calls"] = tool_calls
        return delta

    def _call_delta(self, index: int, call: PartialCall) -> dict[str, Any] | None:
        if index == len(self.sent_arguments):  # a new call: its id and name first
            self.sent_arguments.append(len(call.arguments))
            return {"index": index, **tool_call_json(call, tool_call_id())}
        fragment = call.arguments[self.sent_arguments[index] :]
        if not fragment:
            return None
        self.sent_arguments[index] = len(call.arguments)
        return {"index": index, "function": {"arguments": fragment}}
