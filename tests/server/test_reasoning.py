"""--reasoning-parser (issue 40): a reply split into reasoning_content and content by its family's think
tags, whole and streamed alike, the streamed parts concatenating exactly to the whole reply's."""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx
import openai
import pytest
from pagedserve.server.api.reasoning_parsers import REASONING_PARSERS
from pagedserve.server.api.reasoning_parsers.stream import ReasoningStream

from pagedserve.testing.api_fakes import FakeEngine, app_client, scripted

MSGS = [{"role": "user", "content": "What is 2 + 2?"}]
SPLITS = {
    # reply: (qwen3's split, deepseek_r1's)
    "<think>\nadd them\n</think>\n\n4": (("\nadd them\n", "\n\n4"), ("\nadd them\n", "\n\n4")),
    "  <think>add</think>4": (("add", "4"), ("add", "4")),
    "add them</think>4": ((None, "add them</think>4"), ("add them", "4")),
    "<think>cut by max_tok": (("cut by max_tok", None), ("cut by max_tok", None)),
    "4, no thinking": ((None, "4, no thinking"), ("4, no thinking", None)),
    "<think></think>4</think><think>": ((None, "4</think><think>"), (None, "4</think><think>")),
    "<thin": ((None, "<thin"), ("<thin", None)),
}


@pytest.mark.parametrize("reply", sorted(SPLITS))
@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_whole_replies_split_by_the_family_rule(name: str, reply: str) -> None:
    expected = SPLITS[reply][0 if name == "qwen3" else 1]
    assert REASONING_PARSERS[name].split(reply) == expected


@pytest.mark.parametrize("reply", sorted(SPLITS))
@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_a_stream_cut_anywhere_splits_as_the_whole(name: str, reply: str) -> None:
    parser = REASONING_PARSERS[name]
    for first, second in itertools.combinations_with_replacement(range(len(reply) + 1), 2):
        stream, reasoning, content = ReasoningStream(parser), "", ""
        pieces = ((reply[:first], False), (reply[first:second], False), (reply[second:], True))
        for piece, finished in pieces:
            r, c = stream.feed(piece, finished)
            reasoning, content = reasoning + r, content + c
        assert (reasoning or None, content or None) == parser.split(reply), (first, second)


REPLY = "<think>2 and 2 make 4.</think>The answer is 4."


@pytest.fixture
async def client(engine: FakeEngine) -> Any:
    async with await app_client(engine, reasoning_parser="qwen3") as http:
        yield http


def oai(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)


async def test_the_reply_and_its_stream_split_alike(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    stop = scripted(monkeypatch, REPLY)
    whole = await oai(client).chat.completions.create(model="fake-model", messages=MSGS, **stop)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == ("2 and 2 make 4.", "The answer is 4.")
    chunks = await oai(client).chat.completions.create(model="fake-model", messages=MSGS, stream=True, **stop)
    reasoning, content = [], []
    async for chunk in chunks:
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    assert ("".join(reasoning), "".join(content)) == ("2 and 2 make 4.", "The answer is 4.")
    assert sum(1 for piece in reasoning if piece) > 1  # streamed as it came, not at the end


async def test_include_reasoning_false_leaves_it_out(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    stop = scripted(monkeypatch, REPLY)
    body = {"model": "fake-model", "messages": MSGS, "include_reasoning": False, **stop}
    message = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (None, "The answer is 4.")
    text = (await client.post("/v1/chat/completions", json={**body, "stream": True})).text
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    assert not any(delta.get("reasoning_content") for delta in deltas)
    assert "".join(delta.get("content") or "" for delta in deltas) == "The answer is 4."


async def test_a_tool_call_after_the_reasoning_is_read_from_the_content(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    call = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    stop = scripted(monkeypatch, f"<think>Use it.</think>{call}")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    settings = {"reasoning_parser": "qwen3", "enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    async with await app_client(engine, **settings) as http:
        reply = await oai(http).chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "2+2?"}], tools=tools, **stop
        )
    message = reply.choices[0].message
    assert message.reasoning_content == "Use it."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    assert calls == [("add", {"a": 2})]
    assert reply.choices[0].finish_reason == "tool_calls"


async def test_without_a_parser_the_reply_is_all_content(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    stop = scripted(monkeypatch, REPLY)
    async with await app_client(engine) as http:
        body = {"model": "fake-model", "messages": MSGS, **stop}
        message = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
    assert message["content"] == REPLY and message.get("reasoning_content") is None
