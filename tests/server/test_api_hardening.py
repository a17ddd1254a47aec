"""Issue 14 in-process (fake engine, real HTTP layer): request chat templates, auth on every route, no
silent no-ops, strict types, text that is not valid Unicode, and the drain's 503s.

The real server's part (SIGTERM on a live process) is in test_graceful_stop.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from pagedserve.common.chat_template import TemplateLimits
from pagedserve.server.api.auth import OPEN_PATHS
from pagedserve.server.api.protocol import UNSUPPORTED_FIELDS
from starlette.routing import Route

from pagedserve.testing.api_fakes import FakeEngine, app_client, assert_400

MSGS = [{"role": "user", "content": "hi"}]
# Two nested loops of 15,000: seconds of pure-Python work in Jinja (issue 14 measured 7.4 s).
TRUSTED = {"trust_request_chat_template": True}
SLOW_TEMPLATE = "{% for i in range(15000) %}{% for j in range(15000) %}{% endfor %}{% endfor %}"


async def post_raw(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    """``body`` as JSON, non-ASCII escaped: a lone surrogate travels as ``\\ud83d``, as clients send it."""
    content = json.dumps(body, ensure_ascii=True).encode()
    return await client.post(path, content=content, headers={"content-type": "application/json"})


# ------------------------------------------------------------------------------ request chat templates
@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/chat/completions", {"chat_template": "{{ messages[0].content }}"}),
        ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}),
        ("/tokenize", {"chat_template": "{{ messages[0].content }}"}),
        ("/tokenize", {"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}),
    ],
)
async def test_request_chat_template_needs_trust(engine: FakeEngine, path: str, fields: dict) -> None:
    async with await app_client(engine) as client:
        message = assert_400(await client.post(path, json={"messages": MSGS, **fields}), "chat_template")
        assert "--trust-request-chat-template" in message


async def test_trusted_request_chat_template_is_rendered(engine: FakeEngine) -> None:
    async with await app_client(engine, trust_request_chat_template=True) as client:
        body = {"messages": MSGS, "chat_template": "[{{ messages[0].content }}|{{ shout }}]"}
        body["chat_template_kwargs"] = {"shout": "HEY"}
        r = await client.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == engine.tokenizer.encode("[hi|HEY]", add_special_tokens=False)
        kwargs_only = {"messages": MSGS, "chat_template_kwargs": {"chat_template": "<{{ messages|length }}>"}}
        r = await client.post("/tokenize", json=kwargs_only)
        assert r.json()["tokens"] == engine.tokenizer.encode("<1>", add_special_tokens=False)
        # the template's own failure blames the messages it refused
        refusing = {"messages": MSGS, "chat_template": "{{ raise_exception('no users here') }}"}
        assert "no users here" in assert_400(await client.post("/tokenize", json=refusing), "messages")


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'x' * 10**10 }}",  # would allocate 10 GB before rendering a character
        "{{ 'x'.center(10**10) }}",
        "{{ 'x'|center(10**10) }}",
        "{{ '%999999999d' % 1 }}",
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",  # 100 MB of output
    ],
)
async def test_template_size_bounds(engine: FakeEngine, template: str) -> None:
    limits = TemplateLimits(max_output_chars=1_000_000)
    async with await app_client(
        engine, trust_request_chat_template=True, chat_template_limits=limits
    ) as client:
        body = {"messages": MSGS, "chat_template": template, "max_tokens": 2}
        assert_400(await client.post("/v1/chat/completions", json=body), "chat_template")


async def test_slow_template_renders_off_the_event_loop_and_ends_at_its_deadline(engine: FakeEngine) -> None:
    limits = TemplateLimits(timeout_s=3.0)
    async with await app_client(
        engine, trust_request_chat_template=True, chat_template_limits=limits
    ) as client:
        body = {"messages": MSGS, "chat_template": SLOW_TEMPLATE, "max_tokens": 2}
        slow = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
        await asyncio.sleep(0.2)  # the render has started
        assert (await client.get("/health")).status_code == 200
        other = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert other.status_code == 200
        assert not slow.done(), "the template finished before the other requests were served"
        assert "longer than 3 s" in assert_400(await slow, "chat_template")


# ------------------------------------------------------------------------------------------------- auth
async def test_api_key_guards_every_route_but_the_probes(engine: FakeEngine) -> None:
    async with await app_client(engine, api_key="s3cret") as client:
        app = client._transport.app  # type: ignore[attr-defined]
        routes = [(m, r.path) for r in app.routes if isinstance(r, Route) for m in sorted(r.methods or ())]
        guarded = [(m, p) for m, p in routes if p not in OPEN_PATHS and m != "HEAD"]
        assert {("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/chat/completions")} <= set(
            guarded
        )
        for method, path in guarded:
            r = await client.request(method, path.replace("{model_id:path}", "fake-model"), json={})
            assert r.status_code == 401, (method, path, r.text)
        for path in ("/health", "/metrics", "/version", "/openapi.json"):
            assert (await client.get(path)).status_code == 200, path
        key = {"Authorization": "Bearer s3cret"}
        tokenized = await client.post("/tokenize", json={"prompt": "hi"}, headers=key)
        assert tokenized.status_code == 200


# ------------------------------------------------------------------------------------ no silent no-ops
# Structured outputs and tools are implemented (issue 16): only what would do nothing is refused here;
# tests/server/test_structured_outputs_api.py and test_tool_calls.py have the rest.
CHAT_REFUSED = [
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"structured_outputs": {"json": {}, "regex": "a+"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice"),
    ({"echo": True}, "echo"),
    ({"priority": 1}, "priority"),
    ({"max_tokenz": 3}, "max_tokenz"),  # a typo is not ignored either
]


@pytest.mark.parametrize(("fields", "param"), CHAT_REFUSED)
async def test_chat_fields_that_do_nothing_are_refused(engine: FakeEngine, fields: dict, param: str) -> None:
    async with await app_client(engine) as client:
        body = {"messages": MSGS, "max_tokens": 2, **fields}
        assert_400(await client.post("/v1/chat/completions", json=body), param)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FIELDS))
async def test_unimplemented_vllm_fields_are_named(engine: FakeEngine, name: str) -> None:
    async with await app_client(engine) as client:
        for path, body in (
            ("/v1/completions", {"prompt": "x", "max_tokens": 2, name: "x"}),
            ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, name: "x"}),
        ):
            message = assert_400(await client.post(path, json=body), name)
            assert message.startswith(f"{name} is not supported"), message


async def test_supported_variants_still_work(engine: FakeEngine) -> None:
    async with await app_client(engine) as client:
        tools = [{"type": "function", "function": {"name": "f"}}]
        for fields in (
            {"tools": tools, "tool_choice": "none"},
            {"response_format": {"type": "text"}},
            {"echo": False, "priority": 0, "temperature": 1},  # an integer where a float belongs
            # OpenAI's bookkeeping fields, which OpenAI clients send and which change no token
            {
                "store": False,
                "metadata": {"team": "a"},
                "service_tier": "auto",
                "prompt_cache_key": "k",
                "safety_identifier": "u1",
            },
        ):
            body = {"messages": MSGS, "max_tokens": 2, **fields}
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, (fields, r.text)


async def test_openapi_says_unknown_fields_are_refused(engine: FakeEngine) -> None:
    async with await app_client(engine) as client:
        schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "TokenizeChatRequest", "DetokenizeRequest"):
        assert schemas[name]["additionalProperties"] is False, name
    assert "structural_tag" not in schemas["ChatCompletionRequest"]["properties"]


# ---------------------------------------------------------------------------------------- strict types
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": "2"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": False}, "temperature"),
        ({"n": "1"}, "n"),
        ({"stream": "true"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"logprobs": "1"}, "logprobs"),
        ({"stop": 5}, "stop"),
    ],
)
async def test_loose_types_are_refused(engine: FakeEngine, fields: dict, param: str) -> None:
    async with await app_client(engine) as client:
        r = await client.post("/v1/completions", json={"prompt": "x", **fields})
        message = assert_400(r, param)
        assert param in message


# ------------------------------------------------------------------------------------ invalid Unicode
BROKEN = "broken emoji \ud83d"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": BROKEN}]}, "messages.0.content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": BROKEN}]}]},
            "messages.0.content.0.text",
        ),
        ("/v1/chat/completions", {"messages": MSGS, "stop": [BROKEN]}, "stop.0"),
        ("/v1/chat/completions", {"messages": MSGS, "chat_template": BROKEN}, "chat_template"),
        (
            "/v1/chat/completions",
            {"messages": MSGS, "chat_template_kwargs": {"x": [BROKEN]}},
            "chat_template_kwargs",
        ),
        ("/v1/completions", {"prompt": BROKEN}, "prompt"),
        ("/v1/completions", {"prompt": "x", "stop": BROKEN}, "stop"),
        ("/tokenize", {"prompt": BROKEN}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": BROKEN}]}, "messages.0.content"),
    ],
)
async def test_lone_surrogates_are_a_400_naming_the_field(
    engine: FakeEngine, path: str, body: dict, param: str
) -> None:
    async with await app_client(engine) as client:
        r = await post_raw(client, path, {"max_tokens": 2, **body} if path != "/tokenize" else body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param, error
        assert "surrogate" in error["message"]


# ---------------------------------------------------------------------------------------------- drain
async def test_drain_fails_health_and_refuses_new_requests_at_once(engine: FakeEngine) -> None:
    engine.step_delay = 0.05  # 100 tokens: 5 s, longer than the 2 s grace period
    async with await app_client(engine, shutdown_grace_seconds=2.0) as client:
        stop = client._transport.app.state.graceful_stop  # type: ignore[attr-defined]
        long = {"prompt": "x", "max_tokens": 100, "stream": True}
        streaming = asyncio.ensure_future(client.post("/v1/completions", json=long))
        while not engine.running:
            await asyncio.sleep(0.01)
        drained = asyncio.ensure_future(stop.drain())
        await asyncio.sleep(0)
        assert (await client.get("/health")).status_code == 503
        refused = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503
        body = (await streaming).text
        await drained
    events = [block for block in body.split("\n\n") if block]
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2][len("data: ") :]).get("error")
    assert error is not None and "stopped the request" in error["message"], events[-3:]
    assert len(events) < 100  # it did not run to its end
