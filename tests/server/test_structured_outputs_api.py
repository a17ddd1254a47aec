"""Issue 16, the API's part of structured outputs: every request form (OpenAI's ``response_format``,
vLLM's ``structured_outputs`` and older ``guided_*`` fields) reaches the engine as the one
``StructuredOutputsParams`` it means, and bad input is a 400 naming its field.

In-process (fake engine, real HTTP layer) for the mapping and the refusals; the acceptance (a real
`pagedserve serve` with the embedded model, the official openai client, 50+ schemas validated with
`jsonschema`, streamed and not) is in test_structured_outputs_server.py.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from api_fakes import FakeEngine, app_client
from pagedserve.server.api.protocol import GRAMMAR_BACKEND
from pagedserve.server.sampling_params import SamplingParams, StructuredOutputsParams

MSGS = [{"role": "user", "content": "Give me JSON."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}
GRAMMAR = 'root ::= "yes" | "no"'
TAG = '{"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}'


@pytest.fixture
def sent(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> list[SamplingParams]:
    """The SamplingParams of every request the server hands the engine."""
    params: list[SamplingParams] = []
    add_request = engine.add_request

    async def recording(request_id: str, prompt: Any, sampling: SamplingParams) -> Any:
        params.append(sampling)
        return await add_request(request_id, prompt, sampling)

    monkeypatch.setattr(engine, "add_request", recording)
    return params


def assert_400(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    return error["message"]


FORMS: list[tuple[dict[str, Any], StructuredOutputsParams]] = [
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON, "strict": True},
            }
        },
        StructuredOutputsParams(json=PERSON),
    ),
    ({"structured_outputs": {"json": PERSON}}, StructuredOutputsParams(json=PERSON)),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputsParams(choice=["a", "b"])),
    ({"structured_outputs": {"grammar": GRAMMAR}}, StructuredOutputsParams(grammar=GRAMMAR)),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
    ({"structured_outputs": {"structural_tag": TAG}}, StructuredOutputsParams(structural_tag=TAG)),
    (
        {"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
        StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
    ),
    ({"guided_json": PERSON}, StructuredOutputsParams(json=PERSON)),
    ({"guided_json": '{"type": "array"}'}, StructuredOutputsParams(json='{"type": "array"}')),
    ({"guided_regex": "\\d{3}"}, StructuredOutputsParams(regex="\\d{3}")),
    ({"guided_choice": ["x", "y"]}, StructuredOutputsParams(choice=["x", "y"])),
    ({"guided_grammar": GRAMMAR}, StructuredOutputsParams(grammar=GRAMMAR)),
    (
        {
            "guided_json": PERSON,
            "guided_whitespace_pattern": " ?",
            "guided_decoding_backend": GRAMMAR_BACKEND,
        },
        StructuredOutputsParams(json=PERSON, whitespace_pattern=" ?"),
    ),
    ({"guided_choice": ["x"], "guided_decoding_backend": "auto"}, StructuredOutputsParams(choice=["x"])),
]


@pytest.mark.parametrize(("fields", "expected"), FORMS)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_every_form_reaches_the_engine_as_one_constraint(
    engine: FakeEngine, sent: list[SamplingParams], path: str, fields: dict, expected: StructuredOutputsParams
) -> None:
    prompt = {"messages": MSGS} if path == "/v1/chat/completions" else {"prompt": "JSON:"}
    async with await app_client(engine) as client:
        r = await client.post(path, json={**prompt, "max_tokens": 2, **fields})
    assert r.status_code == 200, r.text
    assert [p.structured_outputs for p in sent] == [expected]


async def test_no_constraint_and_text_format_send_none(
    engine: FakeEngine, sent: list[SamplingParams]
) -> None:
    async with await app_client(engine) as client:
        for fields in ({}, {"response_format": {"type": "text"}}):
            r = await client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, **fields})
            assert r.status_code == 200, r.text
    assert [p.structured_outputs for p in sent] == [None, None]


BAD: list[tuple[dict[str, Any], str, str]] = [
    # two forms at once: the second is named
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "both constrain"),
    ({"guided_json": PERSON, "guided_choice": ["a"]}, "guided_choice", "both constrain"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": PERSON}, "guided_json", "both constrain"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    # schemas that are not schemas
    ({"guided_json": {"type": "bogus"}}, "guided_json", "not a valid JSON schema"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"guided_json": [1, 2]}, "guided_json", ""),
    (
        {"structured_outputs": {"json": {"minItems": -1}}},
        "structured_outputs.json",
        "not a valid JSON schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"required": 3}}}},
        "response_format.json_schema.schema",
        "not a valid JSON schema",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", ""),
    ({"guided_choice": []}, "guided_choice", ""),
    ({"structured_outputs": {"jsn": PERSON}}, "structured_outputs.jsn", ""),
    # the one backend
    (
        {"guided_json": PERSON, "guided_decoding_backend": "outlines"},
        "guided_decoding_backend",
        GRAMMAR_BACKEND,
    ),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "JSON"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "JSON"),
]


@pytest.mark.parametrize(("fields", "param", "says"), BAD)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_bad_constraints_are_400s_naming_the_field(
    engine: FakeEngine, sent: list[SamplingParams], path: str, fields: dict, param: str, says: str
) -> None:
    prompt = {"messages": MSGS} if path == "/v1/chat/completions" else {"prompt": "JSON:"}
    async with await app_client(engine) as client:
        message = assert_400(await client.post(path, json={**prompt, "max_tokens": 2, **fields}), param)
        assert says in message, message
        # nothing reached the engine, and the server still serves
        assert (await client.post(path, json={**prompt, "max_tokens": 2})).status_code == 200
    assert [p.structured_outputs for p in sent] == [None]


async def test_openapi_documents_the_forms(engine: FakeEngine) -> None:
    async with await app_client(engine) as client:
        schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        fields = schemas[name]["properties"]
        forms = {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar", "guided_whitespace_pattern", "guided_decoding_backend"}  # fmt: skip
        assert forms <= set(fields)
    assert set(schemas["StructuredOutputsRequest"]["properties"]) == {
        "json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace",
        "whitespace_pattern",
    }  # fmt: skip
