"""Structured outputs in the engine (server/structured_output/), with the embedded model: JSON schemas,
regex, choice, json_object, grammars and structural tags always match; bad specs are refused before
anything runs; the grammar holds across continuous batching, preemption, n>1, stop strings, min_tokens,
ignore_eos and max_tokens; a token the grammar refuses fails its request alone."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import jsonschema
import pytest
import torch
from pagedserve.server.exceptions import InvalidRequestError, StepError
from pagedserve.server.sample import sampler
from pagedserve.server.sampling_params import RequestOutputKind, StructuredOutputsParams
from pagedserve.server.structured_output.bitmask import (
    GrammarBitmask,
    apply_grammar_bitmask,
    fill_grammar_bitmask,
)
from pagedserve.server.structured_output.compiler import GrammarCompiler

if TYPE_CHECKING:
    from pagedserve.server.engine.async_engine import AsyncEngine

from pagedserve import LLM, SamplingParams

PROMPT = "Answer with a JSON object about a famous scientist."

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}}, "required": ["name"]},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    {
        "type": "object",
        "properties": {"field": {"enum": ["physics", "chemistry", "biology"]}, "nobel": {"type": "boolean"}},
        "required": ["field", "nobel"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"version": {"const": 3}, "ok": {"type": "boolean"}},
        "required": ["version", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "n": {"type": "integer", "exclusiveMinimum": 10, "maximum": 10**6},
        },
        "required": ["ratio", "n"],
        "additionalProperties": False,
    },
    {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -99, "maximum": 99},
                    "y": {"type": "integer", "minimum": -99, "maximum": 99},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer", "maximum": 999},
                    {"type": "string", "maxLength": 10},
                    {"type": "null"},
                ]
            }
        },
        "required": ["value"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 15},
                    "last": {"type": "string", "maxLength": 15},
                },
                "required": ["first", "last"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["person", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "nickname": {"type": "string", "maxLength": 12},
            "born": {"type": "integer", "minimum": 1000, "maximum": 2100},
        },
        "required": ["born"],  # nickname optional
        "additionalProperties": False,
    },
    {"type": "string", "format": "date"},
]


def constrained(**fields: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(**fields)


def text_of(output: Any) -> str:
    return output.outputs[0].text


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"]
)
def test_every_schema_gives_json_that_validates(llm: LLM, sampling: dict[str, Any]) -> None:
    params = [
        SamplingParams(max_tokens=160, structured_outputs=constrained(json=schema), **sampling)
        for schema in SCHEMAS
    ]
    outputs = llm.generate([PROMPT] * len(SCHEMAS), params)
    for schema, output in zip(SCHEMAS, outputs, strict=True):
        assert output.outputs[0].finish_reason == "stop", (schema, text_of(output))
        jsonschema.validate(json.loads(text_of(output)), schema, format_checker=jsonschema.FormatChecker())


def test_a_schema_given_as_text_and_without_whitespace(llm: LLM) -> None:
    schema = SCHEMAS[1]
    spec = constrained(json=json.dumps(schema), disable_any_whitespace=True)
    (output,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=spec))
    text = text_of(output)
    jsonschema.validate(json.loads(text), schema)
    assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text


def test_regex_and_choice_always_match(llm: LLM) -> None:
    regexes = [r"\d{3}-\d{4}", r"(yes|no), because [a-z ]{5,20}\.", r"[A-Z][a-z]{2,8} [0-9]{1,3}"]
    choices = ["red", "green", "blue with a tint"]
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=constrained(regex=r))
        for r in regexes
        for s in range(3)
    ]
    params += [
        SamplingParams(temperature=1.0, seed=s, max_tokens=20, structured_outputs=constrained(choice=choices))
        for s in range(6)
    ]
    outputs = llm.generate(["Give an answer:"] * len(params), params)
    for param, output in zip(params, outputs, strict=True):
        spec = param.structured_outputs
        assert spec is not None and output.outputs[0].finish_reason == "stop"
        if spec.regex is not None:
            assert re.fullmatch(spec.regex, text_of(output)), (spec.regex, text_of(output))
        else:
            assert text_of(output) in choices


def test_json_object_and_grammars(llm: LLM) -> None:
    specs = [
        constrained(json_object=True),
        constrained(grammar='root ::= "The answer is " [0-9]+ "."'),  # GBNF
        constrained(grammar='start: "Call " NAME "()"\nNAME: /[a-z_]{1,12}/'),  # Lark
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=s) for s in specs]
    prompts = [PROMPT, "Question: what is 6 times 7?", "Which function prints?"]
    outputs = llm.generate(prompts, params)
    assert isinstance(json.loads(text_of(outputs[0])), dict)
    assert re.fullmatch(r"The answer is [0-9]+\.", text_of(outputs[1]))
    assert re.fullmatch(r"Call [a-z_]{1,12}\(\)", text_of(outputs[2]))


def test_a_structural_tag_constrains_what_follows_its_trigger(llm: LLM) -> None:
    """Free text until the trigger, then the tag's schema up to its end (the embedded model seldom
    writes the trigger itself, so the matcher is fed texts here)."""
    schema = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}
    tag = {
        "type": "structural_tag",
        "triggers": ["<fn="],
        "structures": [{"begin": "<fn=get_time>", "schema": schema, "end": "</fn>"}],
    }
    grammar = llm.engine.processor.grammar_compiler.compile(constrained(structural_tag=json.dumps(tag)))
    tokenizer = llm.get_tokenizer()

    def accepts(text: str) -> bool:
        state = grammar.new_state()
        return all(state.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))

    assert accepts('Let me check. <fn=get_time>{"tz": "UTC"}</fn> Done.')
    assert not accepts('Let me check. <fn=get_time>{"tz": "PST"}</fn>')
    assert not accepts("Let me check. <fn=get_time>not json")


BAD_SPECS = [
    pytest.param({"json": {"type": "strin"}}, "structured_outputs.json", "strin", id="bad-type"),
    pytest.param(
        {"json": {"type": "array", "uniqueItems": True}},
        "structured_outputs.json",
        "uniqueItems",
        id="unsupported-keyword",
    ),
    pytest.param({"json": {"$ref": "#/$defs/missing"}}, "structured_outputs.json", "missing", id="bad-ref"),
    pytest.param({"json": "{not json"}, "structured_outputs.json", "not valid JSON", id="not-json"),
    pytest.param({"regex": "a(b"}, "structured_outputs.regex", "unclosed group", id="bad-regex"),
    pytest.param(
        {"grammar": "start: undefined_rule"}, "structured_outputs.grammar", "undefined_rule", id="bad-grammar"
    ),
    pytest.param(
        {"structural_tag": '{"triggers": []}'},
        "structured_outputs.structural_tag",
        "structures",
        id="bad-structural-tag",
    ),
]


@pytest.mark.parametrize(("fields", "param", "problem"), BAD_SPECS)
def test_a_bad_spec_is_refused_before_any_step(
    llm: LLM, fields: dict[str, Any], param: str, problem: str
) -> None:
    core = llm.engine.core
    generated = core.scheduler.generation_tokens
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate(PROMPT, SamplingParams(structured_outputs=constrained(**fields)))
    assert refused.value.param == param and problem in refused.value.message
    assert core.scheduler.generation_tokens == generated and not core.has_unfinished()
    (fine,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(fine.outputs[0].token_ids) == 4


def test_a_grammar_too_slow_to_compile_is_refused(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    compiler = GrammarCompiler(tokenizer, llm.engine.vocab_size, frozenset({2}), timeout_s=0.05)
    # Nested counted repetitions: a lexer of a million states, built for the first mask (~1 s here).
    with pytest.raises(InvalidRequestError, match=r"did not compile within 0\.05 s") as refused:
        compiler.compile(constrained(regex="(x{1000}){1000}"))
    assert refused.value.param == "structured_outputs.regex"


def test_compiled_grammars_are_cached_by_kind_spec_and_whitespace(llm: LLM) -> None:
    compiler = GrammarCompiler(llm.get_tokenizer(), llm.engine.vocab_size, frozenset({2}), cache_size=2)
    first = compiler.compile(constrained(json=SCHEMAS[0]))
    assert compiler.compile(constrained(json=SCHEMAS[0])) is first  # a hit
    assert compiler.compile(constrained(json=SCHEMAS[0], disable_any_whitespace=True)) is not first
    assert compiler.cache_info().hits == 1 and compiler.cache_info().misses == 2
    compiler.compile(constrained(regex="[a-z]+"))  # a third distinct grammar evicts the least recent
    assert compiler.compile(constrained(json=SCHEMAS[0])) is not first
    assert compiler.cache_info().currsize == 2


def test_each_sample_of_n_has_its_own_matcher(llm: LLM) -> None:
    schema = SCHEMAS[3]
    params = SamplingParams(
        n=2, temperature=1.0, seed=3, max_tokens=60, structured_outputs=constrained(json=schema)
    )
    (output,) = llm.generate(PROMPT, params)
    assert len(output.outputs) == 2
    for sample in output.outputs:
        assert sample.finish_reason == "stop"
        jsonschema.validate(json.loads(sample.text), schema)


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(llm: LLM) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (alone,) = llm.generate(PROMPT, plain)
    mixed = [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constrained(json=s))
        for s in SCHEMAS[:4]
    ]
    outputs = llm.generate([PROMPT] * 6, [mixed[0], plain, mixed[1], mixed[2], plain, mixed[3]])
    assert outputs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outputs[4].outputs[0].token_ids == alone.outputs[0].token_ids
    for output, schema in zip([outputs[0], outputs[2], outputs[3], outputs[5]], SCHEMAS[:4], strict=True):
        jsonschema.validate(json.loads(text_of(output)), schema)


def test_max_tokens_cuts_the_json_with_length(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, structured_outputs=constrained(json=SCHEMAS[1]))
    (output,) = llm.generate(PROMPT, params)
    assert output.outputs[0].finish_reason == "length" and len(output.outputs[0].token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(text_of(output))


def test_a_finished_grammar_ends_the_request_despite_min_tokens_and_ignore_eos(llm: LLM) -> None:
    choices = ["yes", "no"]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=30, min_tokens=10, structured_outputs=constrained(choice=choices)
        ),
        SamplingParams(
            temperature=0.0, max_tokens=30, ignore_eos=True, structured_outputs=constrained(choice=choices)
        ),
    ]
    for output in llm.generate(["Is water wet? Answer:"] * 2, params):
        sample = output.outputs[0]
        assert sample.text in choices and sample.finish_reason == "stop"
        assert sample.token_ids[-1] == llm.get_tokenizer().eos_token_id  # the grammar's one way out


def test_stop_strings_still_apply(llm: LLM) -> None:
    schema = SCHEMAS[1]
    params = SamplingParams(
        temperature=0.0, max_tokens=80, stop=['"age"'], structured_outputs=constrained(json=schema)
    )
    (output,) = llm.generate(PROMPT, params)
    assert output.outputs[0].finish_reason == "stop" and output.outputs[0].stop_reason == '"age"'
    assert '"name"' in text_of(output) and '"age"' not in text_of(output)


def test_preemption_and_chunked_prefill_mid_grammar_keep_the_output_valid(model_path: str) -> None:
    # Prompts of ~5 blocks of 16 tokens, 16 blocks in all: three requests start, then grow out of room and
    # the newest is preempted mid-JSON, recomputed later from its prompt and the tokens it had (its own
    # blocks found again in the prefix cache), its matcher untouched. 64 tokens a step: every prompt is
    # prefilled in chunks, and only its last chunk samples through the grammar.
    small = LLM(model_path, num_gpu_blocks_override=16, max_model_len=256, max_num_batched_tokens=64)
    schemas = [SCHEMAS[1], SCHEMAS[7], SCHEMAS[9]] * 2
    # Distinct from their first token: no prefix-cache hits shrink their footprint.
    prompts = [
        f"Request {i}. " + "Some context about science and its history. " * 8 + PROMPT for i in range(6)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=constrained(json=s))
        for s in schemas
    ]
    outputs = small.generate(prompts, params)
    assert small.engine.core.scheduler.num_preemptions > 0
    for schema, output in zip(schemas, outputs, strict=True):
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text_of(output)), schema)
    pool = small.engine.core.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_a_token_the_grammar_refuses_fails_its_request_alone(llm: LLM) -> None:
    engine = llm.engine
    plain = SamplingParams(temperature=0.0, max_tokens=6)
    (alone,) = llm.generate(PROMPT, plain)
    # allowed_token_ids leaves the grammar nothing it accepts: the sampled token is refused.
    comma = llm.get_tokenizer().encode(",", add_special_tokens=False)
    doomed = SamplingParams(
        temperature=0.0,
        max_tokens=6,
        allowed_token_ids=comma,
        structured_outputs=constrained(choice=["yes", "no"]),
    )
    engine.add_request("doomed", PROMPT, doomed)
    engine.add_request("ok", PROMPT, plain)
    with pytest.raises(StepError) as failed:
        engine.step()
    assert failed.value.request_ids == ["doomed"]
    assert [o.request_id for o in failed.value.outputs] == ["ok"]
    final = failed.value.outputs[0]
    while engine.has_unfinished():
        for output in engine.step():
            final = output
    assert final.finished and final.outputs[0].token_ids == alone.outputs[0].token_ids
    pool = engine.core.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and not engine.output_processor.requests


def allowed_ids(mask: GrammarBitmask, position: int, vocab: int) -> set[int]:
    words = mask.bits[position].tolist()
    return {t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1}


def test_the_bitmask_masks_only_the_rows_with_a_grammar(llm: LLM) -> None:
    """Three sampled rows, the middle one constrained to a choice: its row allows just the choices'
    first tokens, the other rows' logits are untouched, and a row sampled alone keeps its own mask."""
    tokenizer = llm.get_tokenizer()
    vocab = llm.engine.vocab_size
    requests = []
    for index, spec in enumerate([None, constrained(choice=["yes", "no"]), None]):
        params = SamplingParams(temperature=0.0, structured_outputs=spec)
        requests.extend(llm.engine.process_inputs(f"row{index}", PROMPT, params).children)
    mask = fill_grammar_bitmask(requests)
    assert mask is not None and mask.rows == [1]
    allowed = allowed_ids(mask, 0, vocab)
    assert {tokenizer.decode([t]) for t in allowed} <= {"y", "ye", "yes", "n", "no"}
    assert tokenizer.encode("yes", add_special_tokens=False)[0] in allowed

    logits = torch.randn(3, vocab)
    masked = apply_grammar_bitmask(logits, mask)
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert set(torch.isfinite(masked[1]).nonzero().flatten().tolist()) == allowed
    assert mask.select(0) is None and mask.select(1) is not None

    # The batch fails, then each row is sampled alone with its own slice of the mask.
    original = sampler._apply_penalties
    calls = {"n": 0}

    def fails_once(batch_logits: torch.Tensor, batch: list[Any]) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected: the batch fails, the rows are retried alone")
        return original(batch_logits, batch)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampler, "_apply_penalties", fails_once)
        tokens = sampler.sample_each(logits, requests, mask)
    assert tokens[1].token_id in allowed  # type: ignore[union-attr]
    assert tokens[0].token_id == int(logits[0].argmax()) and tokens[2].token_id == int(logits[2].argmax())


def test_no_grammar_no_bitmask(llm: LLM) -> None:
    (request,) = llm.engine.process_inputs("plain", PROMPT, SamplingParams()).children
    assert request.grammar is None and fill_grammar_bitmask([request]) is None


async def test_streamed_deltas_of_a_constrained_request_join_into_valid_json(
    served_engine: AsyncEngine,
) -> None:
    schema = SCHEMAS[9]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=100,
        structured_outputs=constrained(json=schema),
        output_kind=RequestOutputKind.DELTA,
    )
    pieces, finish = [], None
    async for output in served_engine.generate(PROMPT, params, "streamed"):
        pieces.append(output.outputs[0].text)
        finish = output.outputs[0].finish_reason
    assert finish == "stop" and len(pieces) > 1
    jsonschema.validate(json.loads("".join(pieces)), schema)
    assert served_engine.stats().kv_cache_usage == 0.0
