"""--reasoning-parser qwen3 over a real engine (issue 40): a tiny random Qwen3 whose tokenizer has Qwen3's
think tags as single tokens and whose chat template is Qwen3's. Its replies, sampled with the tags made
likely (logit_bias), open and close reasoning at random places; each chat reply, whole and streamed,
splits into exactly what the qwen3 rule makes of the same sample's raw text (the same seed through
/v1/completions, which no parser touches). A json_schema request's answer validates after free reasoning,
the grammar waiting for the closing tag."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from pagedserve.server.api.reasoning_parsers import REASONING_PARSERS

from pagedserve import LLM
from pagedserve.testing.tiny_models import TINY_ENGINE, tiny_reasoning_checkpoint

THINK, END_THINK = 259, 260  # tiny_reasoning_checkpoint's <think> and </think>
MSGS = [{"role": "user", "content": "What is 2 + 2?"}]
SEEDS = range(16)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return LLM(str(tiny_reasoning_checkpoint(tmp_path_factory.mktemp("qwen3-think"))), **TINY_ENGINE)


@pytest.fixture
async def http(llm: LLM) -> AsyncIterator[httpx.AsyncClient]:
    from pagedserve.server.api.app import ServerSettings, build_app
    from pagedserve.server.engine.async_engine import AsyncEngine

    engine = AsyncEngine(llm.engine.core, llm.engine.tokenizer, llm.engine.processor)
    await engine.start()
    app = build_app(engine, ServerSettings(access_log=False, reasoning_parser="qwen3"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                 timeout=120) as client:  # fmt: skip
        yield client
    await engine.shutdown(grace_seconds=0)


def sampling(seed: int, bias: dict[int, float]) -> dict[str, Any]:
    logit_bias = {str(token): value for token, value in bias.items()}
    return {"max_tokens": 16, "temperature": 1.0, "seed": seed, "logit_bias": logit_bias}


async def chat(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await http.post("/v1/chat/completions", json={"messages": MSGS, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


async def streamed_chat(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str | None, str | None]:
    reasoning, content = "", ""
    request = {"messages": MSGS, "stream": True, **body}
    async with http.stream("POST", "/v1/chat/completions", json=request) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
    return reasoning or None, content or None


async def test_replies_split_exactly_as_the_qwen3_rule_says(http: httpx.AsyncClient) -> None:
    parser = REASONING_PARSERS["qwen3"]
    prompt = (await http.post("/tokenize", json={"messages": MSGS})).json()["tokens"]
    kinds = set()
    for seed in SEEDS:
        body = sampling(seed, {THINK: 5.0, END_THINK: 4.0})
        raw = await http.post("/v1/completions", json={"prompt": prompt, **body})
        expected = parser.split(raw.json()["choices"][0]["text"])
        message = await chat(http, body)
        assert (message.get("reasoning_content"), message["content"]) == expected, seed
        assert await streamed_chat(http, body) == expected, seed
        kinds.add(tuple(part is not None for part in expected))
    # The samples cover a reply with reasoning and an answer, and one that is all answer or all reasoning
    assert (True, True) in kinds and len(kinds) > 1, kinds


async def test_json_schema_answer_validates_after_free_reasoning(http: httpx.AsyncClient) -> None:
    """Every answer validates; a reply may still end inside its reasoning (EOS is free there), with no
    answer. Whitespace is held to one space, or a random model's JSON wanders to max_tokens."""
    schema = {"type": "object", "properties": {"answer": {"enum": ["four", "4"]}}, "required": ["answer"],
              "additionalProperties": False}  # fmt: skip
    constraint = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
                  "guided_whitespace_pattern": " ?", "max_tokens": 40}  # fmt: skip
    reasoned_then_answered = 0
    for seed in SEEDS:
        message = await chat(http, {**sampling(seed, {THINK: 4.0, END_THINK: 5.0}), **constraint})
        if message["content"] is None:
            assert message.get("reasoning_content"), seed
            continue
        jsonschema.validate(json.loads(message["content"]), schema)
        reasoned_then_answered += bool(message.get("reasoning_content"))
    assert reasoned_then_answered >= len(SEEDS) // 2
    no_thinking = {**sampling(0, {}), **constraint, "chat_template_kwargs": {"enable_thinking": False}}
    thinking_off = await chat(http, no_thinking)
    assert thinking_off.get("reasoning_content") is None
    jsonschema.validate(json.loads(thinking_off["content"]), schema)


def test_the_tags_are_single_tokens(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_reasoning_checkpoint(tmp_path)))
    assert tokenizer.encode("<think>x</think>", add_special_tokens=False)[::2] == [THINK, END_THINK]
