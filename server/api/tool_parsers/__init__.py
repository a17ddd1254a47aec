"""Tool-call parsers, chosen by name with ``--tool-call-parser`` (vLLM's names), and the forced forms.

One parser per file: ``hermes``, ``llama3_json``; ``forced.py`` reads the replies the grammar forces for
``tool_choice`` "required" and a named function. ``stream.py`` shapes any parser's readings into
OpenAI's messages and stream deltas.
"""

from __future__ import annotations

from pagedserve.server.api.tool_parsers.base import ToolParser
from pagedserve.server.api.tool_parsers.hermes import HermesToolParser
from pagedserve.server.api.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser)
}
