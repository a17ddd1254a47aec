"""Issue 16, tool calling through the API, in-process: the fake engine's core "generates" a scripted
reply (api_fakes.SCRIPT), so what the parsers read is known; the HTTP layer, the engine's front end and
the official openai client (over the in-process app) are real.

The parsers' own contract (each reading of a growing text extends the previous one) is checked at every
cut of a few replies; the grammar-forced forms ("required", a named function) are checked here for the
schema they send, and against the real model in test_tool_calls_server.py.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pagedserve.server.api.tool_parsers import TOOL_PARSERS
from pagedserve.server.api.tool_parsers.base import ToolParser
from pagedserve.server.api.tool_parsers.forced import NamedToolParser, RequiredToolParser
from pagedserve.server.api.tool_parsers.stream import ToolCallStream, whole_reply
from pagedserve.server.sampling_params import SamplingParams

from pagedserve.testing import api_fakes
from pagedserve.testing.api_fakes import FakeEngine, app_client, assert_400, scripted
from pagedserve.testing.processes import pagedserve_argv

MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"$ref": "#/$defs/zone"}},
    "required": ["zone"],
    "$defs": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMS},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}},
]
HERMES_REPLY = (
    "Checking. <tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>'
)
LLAMA_REPLY = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time"}'
AUTO = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    """Room for the scripted replies (conftest.py's engine has 128 tokens)."""
    engine = FakeEngine(max_model_len=1024)
    yield engine
    await engine.shutdown(grace_seconds=0)


def openai_client(client: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=client, max_retries=0)


# ------------------------------------------------------------------------------------ parser contract
READINGS: list[tuple[ToolParser, str, list[tuple[str, Any]], str | None]] = [
    (TOOL_PARSERS["hermes"](), HERMES_REPLY,
     [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "Europe/Paris"})], "Checking. "),
    (TOOL_PARSERS["hermes"](), '<tool_call>{"arguments": {"q": "a}\\"b"}, "name": "s"}</tool_call>',
     [("s", {"q": 'a}"b'})], None),
    (TOOL_PARSERS["hermes"](), "No tools <tool today.", [], "No tools <tool today."),
    (TOOL_PARSERS["llama3_json"](), LLAMA_REPLY,
     [("get_weather", {"city": "Paris"}), ("get_time", {})], None),
    (TOOL_PARSERS["llama3_json"](), ' {"name": "f", "arguments": {"x": [1, {"y": null}]}}',
     [("f", {"x": [1, {"y": None}]})], None),
    (TOOL_PARSERS["llama3_json"](), 'Paris is sunny {"name": "f"}', [], 'Paris is sunny {"name": "f"}'),
    (RequiredToolParser(), '[{"name": "get_time", "parameters": {"zone": "A/B"}} ,'
                           '{"name":"g","parameters":{}}]',
     [("get_time", {"zone": "A/B"}), ("g", {})], None),
    (NamedToolParser("get_weather"), ' {"city": "Paris  "} ', [("get_weather", {"city": "Paris  "})], None),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "calls", "content"), READINGS)
def test_whole_reply_reads_the_calls(parser: ToolParser, text: str, calls: list, content: str | None) -> None:
    got_content, tool_calls = whole_reply(parser, text, None)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls] == calls
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in tool_calls)


@pytest.mark.parametrize(("parser", "text", "calls", "content"), READINGS)
def test_every_cut_of_a_stream_adds_up_to_the_whole_reply(
    parser: ToolParser, text: str, calls: list, content
) -> None:
    """Whatever the pieces, the deltas concatenate to the whole reply: names once, before arguments."""
    for size in (1, 2, 5, len(text)):
        stream = ToolCallStream(parser)
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        got_content, got = "", {}
        for i, piece in enumerate(pieces):
            delta = stream.feed(piece, finished=i == len(pieces) - 1)
            got_content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["index"] == len(got) and call["type"] == "function"
                    got[call["index"]] = {"name": call["function"]["name"], "arguments": ""}
                got[call["index"]]["arguments"] += call["function"]["arguments"]
        assert got_content == (content or ""), size
        assert [(c["name"], json.loads(c["arguments"])) for c in got.values()] == calls, size


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    _, calls = whole_reply(TOOL_PARSERS["hermes"](), HERMES_REPLY, 1)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


# ------------------------------------------------------------------------------------------- requests
async def test_auto_without_the_flags_is_a_400_as_in_vllm(engine: FakeEngine) -> None:
    async with await app_client(engine) as client:
        for fields, param in (({}, "tools"), ({"tool_choice": "auto"}, "tool_choice")):
            r = await client.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, **fields})
            assert "--enable-auto-tool-choice" in assert_400(r, param)


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "nope"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "needs tools"),
        ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice", ""),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
          "tool_choice": "required"}, "tools.0.function.parameters", "not a valid JSON schema"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "[1"}}]},
         "tools.0.function.parameters", "not JSON"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name", ""),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type", ""),
        ({"tools": TOOLS, "tool_choice": "required", "guided_json": {"type": "object"}}, "tool_choice",
         "both constrain"),
        ({"tools": [{"type": "function", "function": {"name": "a", "parameters": TIME_PARAMS}},
                    {"type": "function", "function": {"name": "b", "parameters": {
                        **TIME_PARAMS, "$defs": {"zone": {"type": "integer"}}}}}],
          "tool_choice": "required"}, "tools", "$defs/zone"),
    ],
)  # fmt: skip
async def test_bad_tool_requests_are_400s_naming_the_field(
    engine: FakeEngine, sent: list, fields: dict, param: str, says: str
) -> None:
    async with await app_client(engine, **AUTO) as client:
        message = assert_400(
            await client.post("/v1/chat/completions", json={"messages": MSGS, **fields}), param
        )
        assert says in message, message
    assert sent == []


async def test_required_sends_vllms_array_schema(engine: FakeEngine, sent: list[SamplingParams]) -> None:
    async with await app_client(engine) as client:
        for parallel in (None, False):
            body = {"messages": MSGS, "tools": TOOLS, "tool_choice": "required", "max_tokens": 2}
            if parallel is not None:
                body["parallel_tool_calls"] = parallel
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    schema, single = (p.structured_outputs.json for p in sent)  # type: ignore[union-attr]
    assert all(p.structured_outputs.disable_any_whitespace for p in sent)  # type: ignore[union-attr]
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert single["maxItems"] == 1
    assert schema["$defs"] == TIME_PARAMS["$defs"]  # hoisted to the root, where #/$defs/zone points
    assert [v["properties"]["name"] for v in schema["items"]["anyOf"]] == [
        {"enum": ["get_weather"]},
        {"enum": ["get_time"]},
    ]
    validator = jsonschema.Draft202012Validator(schema)
    validator.validate([{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}])
    for wrong in (
        [],
        [{"name": "get_time", "parameters": {"zone": "paris"}}],
        [{"name": "x", "parameters": {}}],
    ):
        assert not validator.is_valid(wrong), wrong


async def test_named_function_sends_its_parameters(engine: FakeEngine, sent: list[SamplingParams]) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    tools = [TOOLS[0], {"type": "function", "function": {"name": "get_time"}}]  # no parameters: {}
    async with await app_client(engine) as client:
        for tools_sent in (TOOLS, tools):
            body = {"messages": MSGS, "tools": tools_sent, "tool_choice": choice, "max_tokens": 2}
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    # Closed to undeclared arguments (protocol.closed_schema); no parameters: the empty object only.
    assert [p.structured_outputs.json for p in sent] == [  # type: ignore[union-attr]
        {**TIME_PARAMS, "additionalProperties": False},
        {"type": "object", "properties": {}, "additionalProperties": False},
    ]


async def test_none_and_no_tools_send_no_constraint(engine: FakeEngine, sent: list[SamplingParams]) -> None:
    async with await app_client(engine) as client:
        for fields in ({"tools": TOOLS, "tool_choice": "none"}, {"tool_choice": "none"}, {}):
            r = await client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, **fields})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["tool_calls"] == []
    assert [p.structured_outputs for p in sent] == [None, None, None]


# --------------------------------------------------------------------------------------------- replies
async def test_auto_hermes_reply_has_tool_calls(
    engine: FakeEngine, sent: list[SamplingParams], monkeypatch: pytest.MonkeyPatch
) -> None:
    stop = scripted(monkeypatch, HERMES_REPLY)
    async with await app_client(engine, **AUTO) as client:
        result = await openai_client(client).chat.completions.create(
            model="fake-model",
            messages=MSGS,
            tools=TOOLS,
            **stop,  # type: ignore[arg-type]
        )
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking. "
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("get_time", {"zone": "Europe/Paris"}),
    ]
    assert len({c.id for c in calls}) == 2
    assert sent[0].structured_outputs is None  # auto is read from free text
    assert sent[0].skip_special_tokens is False  # <tool_call> is a special token in Hermes tokenizers


async def test_auto_stream_works_with_the_openai_stream_helper(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    stop = scripted(monkeypatch, HERMES_REPLY)
    async with await app_client(engine, **AUTO) as client:
        oai = openai_client(client)
        async with oai.chat.completions.stream(
            model="fake-model",
            messages=MSGS,
            tools=TOOLS,
            **stop,  # type: ignore[arg-type]
        ) as stream:
            names = [
                event.name async for event in stream if event.type == "tool_calls.function.arguments.done"
            ]
            final = await stream.get_final_completion()
        raw = await client.post(
            "/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "stream": True, **stop}
        )
    assert names == ["get_weather", "get_time"]
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking. "
    calls = choice.message.tool_calls or []
    assert [json.loads(c.function.arguments) for c in calls] == [
        {"city": "Paris", "unit": "c"},
        {"zone": "Europe/Paris"},
    ]
    # OpenAI's shape: each call's first delta has its index, id, type and name; later ones only arguments
    deltas = [
        call
        for block in raw.text.split("\n\n")
        if block.startswith("data: {")
        for choice_ in json.loads(block[6:])["choices"]
        for call in choice_["delta"].get("tool_calls") or []
    ]
    firsts = [d for d in deltas if "id" in d]
    assert [(d["index"], d["type"], d["function"]["name"]) for d in firsts] == [
        (0, "function", "get_weather"),
        (1, "function", "get_time"),
    ]
    assert all(
        set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        for d in deltas
        if "id" not in d
    )
    assert len(deltas) > len(firsts) + 2  # the arguments come in fragments, not in one piece


async def test_auto_reply_without_a_call_is_content(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    reply = "It is sunny <tool in Paris."
    stop = scripted(monkeypatch, reply)
    async with await app_client(engine, **AUTO) as client:
        body = {"messages": MSGS, "tools": TOOLS, **stop}
        whole = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert whole["message"] == {"role": "assistant", "content": reply, "tool_calls": []}
    assert whole["finish_reason"] == "stop"
    chunks = [json.loads(b[6:]) for b in streamed.text.split("\n\n") if b.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == reply
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_llama3_json_parser_flag(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    stop = scripted(monkeypatch, LLAMA_REPLY)
    settings = {"enable_auto_tool_choice": True, "tool_call_parser": "llama3_json"}
    async with await app_client(engine, **settings) as client:
        body = {"messages": MSGS, "tools": TOOLS, "parallel_tool_calls": False, **stop}
        choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]


async def test_forced_reply_is_calls_with_null_content(
    engine: FakeEngine, sent: list[SamplingParams], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grammar makes the model write these replies (test_tool_calls_server.py): here, scripted."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [
        ("required", '[{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}]', "get_time"),
        (named, '{"city": "Paris"}', "get_weather"),
    ]
    for tool_choice, reply, name in cases:
        stop = scripted(monkeypatch, reply)
        async with await app_client(engine) as client:
            body = {"messages": MSGS, "tools": TOOLS, "tool_choice": tool_choice, **stop}
            choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
            cut = (await client.post("/v1/chat/completions", json={**body, "max_tokens": 5})).json()[
                "choices"
            ][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == name
        assert cut["finish_reason"] == "length"  # cut by max_tokens: not "tool_calls"


# ---------------------------------------------------------------------------------- chat template
TOOL_TEMPLATE = (
    "{% for t in tools or [] %}[tool {{ t.function.name }} {{ t.function.parameters | tojson }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% for c in m.tool_calls or [] %}{call {{ c.function.name }} {{ c.function.arguments.city }}}"
    "{% endfor %}"
    "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{{ m.content }}{% endfor %}<assistant>"
)


async def test_tools_and_tool_messages_render_through_the_template(engine: FakeEngine) -> None:
    """HF's apply_chat_template(tools=...) semantics: the tools' JSON objects reach the template; an
    assistant message's tool-call arguments (JSON text on the wire) reach it as an object."""
    messages = [
        *MSGS,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    async with await app_client(engine, trust_request_chat_template=True) as client:
        r = await client.post(
            "/tokenize", json={"messages": messages, "tools": TOOLS[:1], "chat_template": TOOL_TEMPLATE}
        )
    assert r.status_code == 200, r.text
    text = bytes(t - api_fakes.OFFSET for t in r.json()["tokens"]).decode()
    assert text.startswith(f"[tool get_weather {json.dumps(WEATHER_PARAMS)}]")
    assert "<assistant>{call get_weather Paris}" in text
    assert "<tool>(call_1)sunny" in text


def test_serve_help_documents_the_tool_flags_and_the_structured_output_fields() -> None:
    done = subprocess.run(pagedserve_argv("serve", "--help"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    help_text = " ".join(done.stdout.split())
    assert "--enable-auto-tool-choice" in help_text
    assert "--tool-call-parser {hermes,llama3_json}" in help_text
    for field in ("response_format", "json_schema", "structured_outputs", "guided_json", "guided_regex",
                  "guided_choice", "guided_grammar", "tool_choice", "guided_decoding_backend"):
        assert field in help_text, field


def test_auto_tool_choice_without_a_parser_is_refused_at_start() -> None:
    done = subprocess.run(
        pagedserve_argv("serve", "--enable-auto-tool-choice"), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in done.stderr + done.stdout
