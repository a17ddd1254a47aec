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


# ------------------------------------------------- a real engine: the grammar waits for the reasoning
THINK_TEMPLATE = (  # DeepSeek-R1's way: the generation prompt opens the reasoning
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
ANSWER = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "digit": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "digit"],
    "additionalProperties": False,
}


@pytest.fixture
async def thinking_app(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny random Qwen3-shaped model whose tokenizer has <think> and </think> as tokens of their own
    (as Qwen3's and the R1 distills' do), served with --reasoning-parser deepseek_r1."""
    from pagedserve.server.api.app import ServerSettings, build_app
    from pagedserve.server.config import EngineConfig
    from pagedserve.server.engine.async_engine import AsyncEngine
    from transformers import AutoTokenizer, Qwen3Config

    from pagedserve.testing.tiny_models import TINY, TINY_VOCAB, tiny_checkpoint

    folder = tmp_path_factory.mktemp("qwen3-think")
    config = Qwen3Config(**{**TINY, "vocab_size": TINY_VOCAB + 2}, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)  # fmt: skip
    config.architectures = ["Qwen3ForCausalLM"]
    tiny_checkpoint(config, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINK_TEMPLATE
    tokenizer.save_pretrained(folder)
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(folder), device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 24, max_model_len=256
    ))  # fmt: skip
    app = build_app(engine, ServerSettings(reasoning_parser="deepseek_r1"))
    await engine.start()
    yield app, tokenizer.convert_tokens_to_ids("</think>")
    await engine.shutdown(grace_seconds=0)


async def test_a_json_schema_holds_for_the_answer_after_free_reasoning(thinking_app: Any) -> None:
    """The reasoning is free text (the random model's), the content after </think> is JSON valid under the
    schema; streamed replies split as the whole ones of the same seed."""
    import jsonschema

    app, end_id = thinking_app
    # </think> made likely enough that the random model closes its reasoning after a few tokens.
    # No free whitespace in the JSON: the random model would pad it with whitespace up to max_tokens.
    answer = {"json": ANSWER, "disable_any_whitespace": True}
    body = {"messages": MSGS, "max_tokens": 80, "temperature": 1.0,
            "logit_bias": {str(end_id): 4}, "structured_outputs": answer}  # fmt: skip
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as http:
        reasonings = []
        for seed in range(6):
            whole = (await http.post("/v1/chat/completions", json={**body, "seed": seed})).json()
            assert "choices" in whole, whole
            message = whole["choices"][0]["message"]
            assert whole["choices"][0]["finish_reason"] == "stop", message
            jsonschema.validate(json.loads(message["content"]), ANSWER)
            reasonings.append(message["reasoning_content"] or "")
            text = (await http.post("/v1/chat/completions", json={**body, "seed": seed, "stream": True})).text
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in text.splitlines()
                      if line.startswith("data: {") and json.loads(line[6:])["choices"]]  # fmt: skip
            streamed = ("".join(d.get("reasoning_content") or "" for d in deltas),
                        "".join(d.get("content") or "" for d in deltas))  # fmt: skip
            assert streamed == (reasonings[-1], message["content"])
    assert sum(1 for r in reasonings if r) >= 3, reasonings  # free reasoning came first in most


async def test_reasoning_effort_reaches_the_chat_template(engine: FakeEngine) -> None:
    """As vLLM passes it: the template's ``reasoning_effort``, which chat_template_kwargs may override; the
    Responses API's reasoning.effort becomes the chat request's."""
    from pagedserve.server.api.responses import ResponsesRequest, chat_request_body

    template = "effort={{ reasoning_effort | default('unset') }}"
    async with await app_client(engine, trust_request_chat_template=True) as http:
        overridden = {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}
        for extra, expected in (({}, "unset"), ({"reasoning_effort": "low"}, "low"), (overridden, "high")):
            body = {"messages": MSGS, "chat_template": template, "add_generation_prompt": False, **extra}
            response = await http.post("/tokenize", json=body)
            assert response.status_code == 200, response.text
            assert engine.tokenizer.decode(response.json()["tokens"]) == f"effort={expected}"
        bad = await http.post("/v1/chat/completions", json={"messages": MSGS, "reasoning_effort": "extreme"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
    request = ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "medium"}})
    assert chat_request_body(request, [])["reasoning_effort"] == "medium"
