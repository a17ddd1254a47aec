"""OpenAI's request rules (issue 40), read from the `openai` package's own request types: every field of
the current Chat Completions and Completions requests is taken, or refused naming it; ``null`` is unset
for every optional one; only names OpenAI does not define are "Unrecognized". A field a new SDK adds
fails here, not as a user's 400."""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from pagedserve.server.api.protocol import (
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    closed_schema,
    tool_calls_schema,
)

from pagedserve.testing.api_fakes import FakeEngine, app_client, assert_400

MESSAGES = [{"role": "user", "content": "Hi"}]
SDK_REQUESTS = {
    "/v1/chat/completions": (chat_create_params.CompletionCreateParamsBase, ChatCompletionRequest),
    "/v1/completions": (completion_create_params.CompletionCreateParamsBase, CompletionRequest),
}
REQUIRED = {"/v1/chat/completions": {"model": "fake-model", "messages": MESSAGES},
            "/v1/completions": {"model": "fake-model", "prompt": "Hi"}}  # fmt: skip


def sdk_fields(path: str) -> set[str]:
    params, _ = SDK_REQUESTS[path]
    return {name for klass in params.__mro__ for name in getattr(klass, "__annotations__", {})}


@pytest.mark.parametrize("path", sorted(SDK_REQUESTS))
def test_every_sdk_field_is_taken_or_refused_by_name(path: str) -> None:
    _, model = SDK_REQUESTS[path]
    taken = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    unknown = sorted(sdk_fields(path) - taken - set(UNSUPPORTED_FIELDS))
    assert unknown == [], f"fields of openai's {path} request that the server neither takes nor refuses"


@pytest.fixture
async def client(engine: FakeEngine) -> Any:
    async with await app_client(engine) as http:
        yield http


@pytest.mark.parametrize("path", sorted(SDK_REQUESTS))
async def test_null_is_unset_for_every_optional_field(client: httpx.AsyncClient, path: str) -> None:
    body = {**{name: None for name in sdk_fields(path)}, **REQUIRED[path], "max_tokens": 3}
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


async def test_a_required_null_and_an_unknown_null_are_refused(client: httpx.AsyncClient) -> None:
    assert_400(await client.post("/v1/chat/completions", json={"model": "fake-model", "messages": None}),
               "messages")  # fmt: skip
    body = {**REQUIRED["/v1/chat/completions"], "nope": None}
    response = await client.post("/v1/chat/completions", json=body)
    assert "Unrecognized request argument supplied: nope" in assert_400(response, "nope")


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"verbosity": "low"}, "verbosity", "verbosity is not supported"),
        ({"moderation": {"model": "omni-moderation-latest"}}, "moderation", "moderation is not supported"),
        ({"prompt_cache_retention": "24h"}, "prompt_cache_retention", "in_memory"),
        ({"prompt_cache_options": {"mode": "explicit"}}, "prompt_cache_options.mode", "implicit"),
    ],
)
async def test_what_the_server_cannot_honour_is_a_400_naming_it(
    client: httpx.AsyncClient, fields: dict[str, Any], param: str, words: str
) -> None:
    response = await client.post("/v1/chat/completions", json={**REQUIRED["/v1/chat/completions"], **fields})
    assert words in assert_400(response, param)


async def test_the_prompt_cache_settings_it_has_are_accepted(client: httpx.AsyncClient) -> None:
    body = {**REQUIRED["/v1/chat/completions"], "max_tokens": 2, "prompt_cache_retention": "in_memory",
            "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}, "prompt_cache_key": "k"}  # fmt: skip
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200


# ----------------------------------------------------------------------------- closed tool schemas
def test_closed_schema_closes_every_object_that_says_nothing() -> None:
    schema = {
        "type": "object",
        "properties": {
            "address": {"type": "object", "properties": {"city": {"type": "string"}}},
            "open": {"type": "object", "additionalProperties": True},
            "items": {"type": "array", "items": {"properties": {"sku": {"type": "string"}}}},
            "either": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "string"}]},
        },
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}},
    }
    closed = closed_schema(schema)
    validator = jsonschema.Draft202012Validator(closed)
    assert validator.is_valid({"address": {"city": "Paris"}, "open": {"anything": 1}, "either": {"x": 1}})
    for extra in ({"zip": 1}, {"address": {"city": "P", "zip": "1"}}, {"items": [{"sku": "a", "n": 1}]},
                  {"either": {"x": 1, "y": 2}}):  # fmt: skip
        assert not validator.is_valid(extra), extra
    assert schema["properties"]["address"] == {"type": "object", "properties": {"city": {"type": "string"}}}


def test_the_required_calls_wrapper_is_closed_too() -> None:
    request = ChatCompletionRequest.model_validate({
        "messages": MESSAGES, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {}}}}},
                  {"type": "function", "function": {"name": "g"}}],
    })  # fmt: skip
    validator = jsonschema.Draft202012Validator(tool_calls_schema(request))
    assert validator.is_valid([{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}])
    wrong_calls = [
        [{"name": "f", "parameters": {"a": 1}, "why": "x"}],
        [{"name": "f", "parameters": {"b": 1}}],
        [{"name": "g", "parameters": {"x": 1}}],
    ]
    for wrong in wrong_calls:
        assert not validator.is_valid(wrong), wrong
