"""Reasoning parsers, chosen by name with ``--reasoning-parser`` (vLLM's names): they split a reply into
its reasoning (``reasoning_content``) and its answer (``content``).

``base.py`` holds the one mechanism, a model family's think tags and whether its replies start in
thought; ``stream.py`` splits a streamed reply piece by piece, exactly as the whole reply splits.
"""

from __future__ import annotations

from pagedserve.server.api.reasoning_parsers.base import ReasoningParser

# Qwen3 writes <think>...</think> itself, and answers without it when thinking is off (its template's
# enable_thinking=false puts an empty think block in the prompt): no </think>, all content.
QWEN3 = ReasoningParser(name="qwen3", start="<think>", end="</think>", thinks_from_start=False)
# DeepSeek-R1 and its distills: the template opens <think> in the prompt, so a reply is reasoning until
# </think> (a <think> the model writes again is dropped); no </think>: all reasoning, cut short.
DEEPSEEK_R1 = ReasoningParser(name="deepseek_r1", start="<think>", end="</think>", thinks_from_start=True)

REASONING_PARSERS: dict[str, ReasoningParser] = {parser.name: parser for parser in (QWEN3, DEEPSEEK_R1)}
