"""Reading tool calls out of JSON text that is still being generated.

A streamed call's arguments are sent as fragments that the client concatenates, so each fragment must
extend what was sent before: the arguments here are always the model's own text (a prefix of the final
value while it is incomplete, trailing whitespace held back), never a re-serialisation of a partial
parse, which could change once more text arrives. Python's own decoder reads the complete values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


@dataclass
class PartialCall:
    """One tool call as far as it is generated: its name once complete, its arguments' text so far."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False  # the call's object is closed


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def value_text(text: str, pos: int) -> tuple[str, int | None]:
    """The JSON value that starts at ``pos``: its text and its end, or (the text so far, None) while it
    is incomplete (or malformed: it never completes)."""
    try:
        _, end = _DECODER.raw_decode(text, pos)
    except ValueError:
        return text[pos:].rstrip(_WHITESPACE), None
    return text[pos:end], end


def scan_call(text: str, pos: int, argument_keys: tuple[str, ...]) -> tuple[PartialCall, int | None]:
    """The call object ``{"name": ..., "<argument key>": {...}}`` that starts at ``pos`` (after
    whitespace): the call so far and the end of its object (None while it is incomplete). A closed
    object without arguments has the empty arguments object."""
    call = PartialCall()
    pos = skip_whitespace(text, pos)
    if not text.startswith("{", pos):
        return call, None
    pos += 1
    while True:
        pos = skip_whitespace(text, pos)
        if text.startswith("}", pos):
            call.complete = True
            call.arguments = call.arguments or "{}"
            return call, pos + 1
        if not text.startswith('"', pos):
            return call, None
        try:
            key, pos = json.decoder.scanstring(text, pos + 1)
        except ValueError:
            return call, None
        pos = skip_whitespace(text, pos)
        if not text.startswith(":", pos):
            return call, None
        pos = skip_whitespace(text, pos + 1)
        value, end = value_text(text, pos)
        if key == "name" and end is not None:
            name = json.loads(value)
            call.name = name if isinstance(name, str) else None
        elif key in argument_keys:
            call.arguments = value
        if end is None:
            return call, None
        pos = skip_whitespace(text, end)
        if text.startswith(",", pos):
            pos += 1


def scan_calls(text: str, pos: int, separator: str, argument_keys: tuple[str, ...]) -> list[PartialCall]:
    """The call objects from ``pos`` on, separated by ``separator``, up to the first incomplete one."""
    calls = []
    while (pos := skip_whitespace(text, pos)) < len(text):
        call, end = scan_call(text, pos, argument_keys)
        calls.append(call)
        if end is None:
            break
        pos = skip_whitespace(text, end)
        if not text.startswith(separator, pos):
            break
        pos += len(separator)
    return calls
