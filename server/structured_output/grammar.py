"""A request's ``StructuredOutputsParams`` as the grammar text llguidance compiles, and its cache key.

Every kind vLLM accepts maps to one llguidance grammar: ``json`` (a JSON schema) and ``json_object`` through
llguidance's JSON-schema compiler, ``regex`` and ``grammar`` (Lark, or GBNF converted to Lark) through its
Lark front end, ``choice`` as a Lark alternation of the literal strings, and ``structural_tag`` (vLLM's
``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``) through ``llguidance.StructTag``.
Whitespace options apply to every JSON part: ``disable_any_whitespace`` allows none between tokens,
``whitespace_pattern`` replaces the default ``[\\x20\\x0A\\x0D\\x09]+``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedserve.server.exceptions import InvalidRequestError
from pagedserve.server.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class GrammarKey:
    """What makes two constraints the same grammar: the compiled-grammar cache hashes this."""

    kind: str  # the one field of StructuredOutputsParams that is set
    spec: str  # that field as text (JSON text for a schema given as an object, or for a choice list)
    disable_any_whitespace: bool
    whitespace_pattern: str | None

    @property
    def param(self) -> str:
        """The request field a refusal names."""
        return f"structured_outputs.{self.kind}"

    def invalid(self, problem: str) -> InvalidRequestError:
        return InvalidRequestError(f"{self.param}: {problem}", param=self.param)


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    kind = params.kind
    value = getattr(params, kind)
    if kind == "json_object":
        spec = ""
    elif isinstance(value, str):
        spec = value
    else:  # a schema object or a choice list; key order is kept: it is the order of the output's properties
        spec = json.dumps(value, ensure_ascii=False)
    return GrammarKey(kind, spec, params.disable_any_whitespace, params.whitespace_pattern)


def grammar_source(key: GrammarKey, special_tokens: frozenset[str]) -> str:
    """llguidance grammar text for ``key``; ``special_tokens``: the tokenizer's, for structural tags'
    triggers. Raises InvalidRequestError for a spec that is not of its kind's shape."""
    import llguidance

    if key.kind in ("json", "json_object"):
        schema = _json_value(key, key.spec) if key.kind == "json" else {"type": "object"}
        if not isinstance(schema, dict) and not isinstance(schema, bool):
            raise key.invalid("a JSON schema must be an object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_json_options(key))
    if key.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(key.spec)
    if key.kind == "choice":
        choices = json.loads(key.spec)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if key.kind == "grammar":
        try:
            return llguidance.grammar_from("grammar", key.spec)  # Lark as is, GBNF converted to Lark
        except ValueError as exc:
            raise key.invalid(str(exc)) from exc
    return _structural_tag(key, special_tokens)


def _json_options(key: GrammarKey) -> dict[str, Any]:
    options: dict[str, Any] = {"whitespace_flexible": not key.disable_any_whitespace}
    if key.whitespace_pattern is not None and not key.disable_any_whitespace:
        options["whitespace_pattern"] = key.whitespace_pattern
    return options


def _json_value(key: GrammarKey, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise key.invalid(f"not valid JSON: {exc}") from exc


def _structural_tag(key: GrammarKey, special_tokens: frozenset[str]) -> str:
    import llguidance

    tag = _json_value(key, key.spec)
    structures = tag.get("structures") if isinstance(tag, dict) else None
    triggers = tag.get("triggers") if isinstance(tag, dict) else None
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list):
        raise key.invalid('expected {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}')
    tags = []
    for item in structures:
        if not isinstance(item, dict) or not all(isinstance(item.get(f), str) for f in ("begin", "end")):
            raise key.invalid("each structure needs string 'begin' and 'end' and a 'schema'")
        begin = item["begin"]
        trigger = next((t for t in triggers if isinstance(t, str) and t and begin.startswith(t)), None)
        if trigger is None:
            raise key.invalid(f"no trigger starts the structure begin {item['begin']!r}")
        schema = item.get("schema", {})
        if not isinstance(schema, dict):
            raise key.invalid("a structure's schema must be a JSON object")
        tags.append(llguidance.StructTag(trigger=trigger, begin=item["begin"], end=item["end"],
                                         grammar={**schema, "x-guidance": _json_options(key)}))
    # A trigger written like <tool_call> is a special token only where the tokenizer has one by that name.
    special = all(t.trigger in special_tokens for t in tags if t.trigger.startswith("<"))
    return llguidance.StructTag.to_grammar(tags, assume_special=special)
