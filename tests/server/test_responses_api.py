"""POST /v1/responses (issue 40) with the openai client over the API and a scripted engine: plain,
streamed (the SDK's own stream accumulator checks the events' order), text.format json_schema, a function
call round trip, previous_response_id, retrieve, and the refusals."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response
from openai.types.responses import response_create_params as create_params
from pagedserve.server.api.responses import UNSUPPORTED_RESPONSES_FIELDS, ResponsesRequest

from pagedserve.testing.api_fakes import FakeEngine, app_client, assert_400, scripted

MODEL = "fake-model"


@pytest.fixture
async def http(engine: FakeEngine) -> Any:
    settings = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes", "reasoning_parser": "qwen3"}
    async with await app_client(engine, **settings) as client:
        yield client


def oai(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)


def test_every_sdk_field_is_taken_or_refused_by_name() -> None:
    fields = {
        k for c in create_params.ResponseCreateParamsBase.__mro__ for k in getattr(c, "__annotations__", {})
    }
    taken = set(ResponsesRequest.model_fields)
    assert sorted(fields - taken - set(UNSUPPORTED_RESPONSES_FIELDS)) == []


async def test_a_plain_response_and_its_retrieval(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    stop = scripted(monkeypatch, "<think>Easy.</think>Paris.", eos=True)
    client = oai(http)
    response = await client.responses.create(
        model=MODEL,
        input="Capital of France?",
        instructions="Be brief.",
        max_output_tokens=stop["max_tokens"],
    )
    assert response.output_text == "Paris." and response.status == "completed"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Easy."
    assert response.usage.output_tokens == len("<think>Easy.</think>Paris.") + 1
    again = await client.responses.retrieve(response.id)
    assert again.model_dump() == response.model_dump()


async def test_the_stream_accumulates_to_the_same_response(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    stop = scripted(monkeypatch, "<think>Easy.</think>Paris is the capital.", eos=True)
    async with oai(http).responses.stream(
        model=MODEL,
        input="Capital of France?",
        max_output_tokens=stop["max_tokens"],
    ) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") > 1 and "response.reasoning_text.delta" in kinds
    assert final.output_text == "Paris is the capital."
    stored = await oai(http).responses.retrieve(final.id)
    assert stored.output_text == final.output_text and stored.status == "completed"


async def test_json_schema_text_format_is_the_chat_response_format(
    http: httpx.AsyncClient, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = []
    add_request = engine.add_request

    async def recording(request_id: str, prompt: Any, params: Any, lora: Any = None) -> Any:
        sent.append(params.structured_outputs)
        import dataclasses

        return await add_request(
            request_id, prompt, dataclasses.replace(params, structured_outputs=None), lora
        )

    monkeypatch.setattr(engine, "add_request", recording)
    stop = scripted(monkeypatch, '{"city": "Paris"}', eos=True)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    response = await oai(http).responses.create(
        model=MODEL,
        input="Where?",
        max_output_tokens=stop["max_tokens"],
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
    )
    assert json.loads(response.output_text) == {"city": "Paris"}
    assert sent[0].json == schema
    assert response.text.format.type == "json_schema"


async def test_a_function_call_round_trip_through_previous_response_id(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    stop = scripted(
        monkeypatch, '<tool_call>{"name": "get_weather", "arguments": {"c": "P"}}</tool_call>', eos=True
    )
    client = oai(http)
    first = await client.responses.create(
        model=MODEL,
        input="Weather?",
        tools=tools,
        max_output_tokens=stop["max_tokens"],
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"c": "P"})
    stop = scripted(monkeypatch, "Sunny.", eos=True)
    second = await client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        tools=tools,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C, sunny"}],
        max_output_tokens=stop["max_tokens"],
    )
    assert second.output_text == "Sunny." and second.previous_response_id == first.id


async def test_refusals_name_the_field(http: httpx.AsyncClient) -> None:
    assert "background responses are not supported" in assert_400(
        await http.post("/v1/responses", json={"input": "x", "background": True}), "background"
    )
    assert_400(await http.post("/v1/responses", json={"input": [{"type": "input_image"}]}), "input[0]")
    include = {"input": "x", "include": ["message.output_text.logprobs"]}
    assert "not supported" in assert_400(await http.post("/v1/responses", json=include), "include")
    missing = await http.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "previous_response_id"
    assert (await http.get("/v1/responses/resp_nope")).status_code == 404


def test_responses_validate_as_the_sdk_types() -> None:
    from pagedserve.server.api.responses import output_items, response_object

    request = ResponsesRequest.model_validate({"input": "x", "tools": [{"type": "function", "name": "f"}]})
    message = {
        "content": "hi",
        "reasoning_content": "think",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    body = response_object("resp_1", request, "m", output_items(message), "completed", None, "stop")
    parsed = Response.model_validate(body)
    assert [item.type for item in parsed.output] == ["reasoning", "message", "function_call"]
    assert parsed.output_text == "hi"
