"""The Responses API with the clients that default to it (issue 40): an openai-agents Agent (its default
model is the Responses model) running a function tool, and langchain's ChatOpenAI with
use_responses_api=True, over the API and a scripted engine (the tool switches the script, so the
agent's second turn gets the answer after the call)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from pagedserve.testing import api_fakes
from pagedserve.testing.api_fakes import EOS_MARK, FakeEngine, app_client, scripted

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture
async def http() -> Any:
    engine = FakeEngine(max_model_len=512)  # an agent's instructions and tools make a long prompt
    async with await app_client(engine, enable_auto_tool_choice=True, tool_call_parser="hermes") as client:
        yield client
    await engine.shutdown(grace_seconds=0)


async def test_an_openai_agents_agent_calls_its_tool_and_answers(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no trace export: nothing leaves this machine
    scripted(monkeypatch, CALL, eos=True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        monkeypatch.setattr(api_fakes, "SCRIPT", "Sunny in Paris." + EOS_MARK)
        return "18C and sunny"

    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the tool.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model="fake-model", openai_client=client),
        model_settings=ModelSettings(max_tokens=120),
    )
    result = await Runner.run(agent, "What is the weather in Paris?")
    assert calls == ["Paris"]
    assert result.final_output == "Sunny in Paris."


async def test_langchain_chat_openai_on_the_responses_api(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from langchain_openai import ChatOpenAI

    stop = scripted(monkeypatch, '{"answer": 4}', eos=True)
    sync_transport = httpx.ASGITransport(app=http._transport.app)  # type: ignore[attr-defined]
    model = ChatOpenAI(
        model="fake-model", base_url="http://test/v1", api_key="x", use_responses_api=True,
        max_tokens=stop["max_tokens"], http_async_client=httpx.AsyncClient(transport=sync_transport,
                                                                           base_url="http://test"),
    )  # fmt: skip
    reply = await model.ainvoke("What is 2 + 2? Answer in JSON.")
    assert json.loads(reply.text) == {"answer": 4}
    assert reply.response_metadata.get("id", "").startswith("resp_")
