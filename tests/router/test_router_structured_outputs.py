"""Issue 16: the router passes structured-output fields, tools and tool-call streams through untouched.

One real engine (the embedded model, ``--enable-auto-tool-choice --tool-call-parser hermes``) and a
router in front of it, on 127.0.0.1. The same greedy requests, sent straight to the engine and through
the router, give the same answers: the same JSON under a schema, and the same stream of tool-call deltas
(ids and timestamps aside); the router's prefix hashing renders the request's tools too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pagedserve import default_model
from pagedserve.testing.processes import ServerProcess, router_process, serve_process

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,  # closed: in an open object the 135M model adds keys until max_tokens
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
REQUESTS: list[dict[str, Any]] = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}},
    {"guided_json": WEATHER},
    {"structured_outputs": {"choice": ["sunny", "rainy"]}},
    {"tools": TOOLS, "tool_choice": "required", "stream": True},
    {
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "stream": True,
    },
]


@pytest.fixture(scope="module")
def engine_and_router(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    logs = tmp_path_factory.mktemp("structured")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    flags = ["--disable-access-log", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with serve_process(logs / "engine.log", *flags, env=env) as engine:
        engine.wait_ready(240)
        router_flags = ["--tokenizer", str(default_model()), "--model-name", MODEL, "--log-level", "warning"]
        with router_process(logs / "router.log", [engine.url], *router_flags, env=env) as router:
            router.wait_ready(60)
            yield engine, router


def answer(base_url: str, fields: dict[str, Any]) -> Any:
    """The answer with what differs between two runs of the same request (ids, timestamps) left out."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 120, "temperature": 0, **fields}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    if not fields.get("stream"):
        return r.json()["choices"]
    events = [b[len("data: ") :] for b in r.text.split("\n\n") if b.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"] for e in events[:-1]]
    for choices in chunks:
        for choice in choices:
            for call in choice["delta"].get("tool_calls") or []:
                assert call.pop("id", "chatcmpl-tool-").startswith("chatcmpl-tool-")
    return chunks


@pytest.mark.parametrize(
    "fields", REQUESTS, ids=["response_format", "guided_json", "choice", "required", "named"]
)
def test_router_passes_structured_outputs_and_tool_streams_through(engine_and_router, fields: dict) -> None:
    engine, router = engine_and_router
    direct = answer(engine.url, fields)
    routed = answer(router.url, fields)
    assert routed == direct
    if fields.get("stream"):  # a tool-call stream: the calls are there, in OpenAI's delta shape
        deltas = [c for choices in routed for ch in choices for c in ch["delta"].get("tool_calls") or []]
        first = [d for d in deltas if d["index"] == 0]
        assert first and first[0]["function"]["name"] == "get_weather" and first[0]["type"] == "function"
        arguments = "".join(d["function"].get("arguments", "") for d in first)
        assert set(json.loads(arguments)) == {"city", "unit"}
        assert routed[-1][0]["finish_reason"] == "tool_calls"
    else:
        assert routed[0]["finish_reason"] == "stop"
