"""The HTTP layer in-process against a fake engine: request mapping, response shapes, errors, auth, metrics.

No model is loaded, so these run in well under a second; the real server is tested in test_api_server.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from pagedserve.server.api.app import ServerSettings, build_app
from pagedserve.server.api.metrics import build_1_2_5_buckets
from pagedserve.server.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from pagedserve.server.sampling_params import RequestOutputKind, SamplingParams
from pydantic import ValidationError

from pagedserve.testing.api_fakes import SCRIPT, FakeEngine, app_client

MODEL = "fake-model"


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with await app_client(engine) as c:
        yield c


def events(body: str) -> list[Any]:
    out = []
    for block in body.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


# ----------------------------------------------------------------------------------------- schemas
def test_schema_accepts_openai_shapes() -> None:
    assert CompletionRequest(prompt="hi", stop="x").stop == "x"
    assert CompletionRequest(prompt=[1, 2, 3], stop=["a", "b"], logprobs=3).logprobs == 3
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompt == [[1, 2], [3]]
    assert CompletionRequest(prompt="hi").max_tokens == 16  # OpenAI's and vLLM's default for completions
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2)
    assert chat.max_tokens is None and chat.max_completion_tokens is None
    parts = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}])
    assert parts.messages[0].content[0].text == "a"  # type: ignore[index,union-attr]
    # unknown fields are refused, as OpenAI does (issue 14: an ignored field is a silent no-op)
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], some_future_field=1)


@pytest.mark.parametrize(
    "fields",
    [
        {"seed": 2**64},
        {"temperature": float("nan")},
        {"max_tokens": 0},
    ],
)
def test_schema_rejects_values_off_the_wire(fields: dict[str, Any]) -> None:
    """What the schema itself refuses: numbers nothing downstream can hold. A sampling value's range is
    the engine's to check, once (the next test)."""
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="hi", **fields)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("n", 0, "at least 1"),
        ("n", 17, "max_num_seqs"),
        ("temperature", -1, "non-negative"),
        ("top_p", 0, "(0, 1]"),
        ("top_k", -2, "-1 (disable)"),
        ("min_p", 1.5, "[0, 1]"),
        ("repetition_penalty", 0, "greater than zero"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("min_tokens", -1, "non-negative"),
        ("logprobs", 21, "[0, 20]"),
        ("prompt_logprobs", -1, "[0, 20]"),
    ],
)
async def test_sampling_ranges_are_the_engines_400s(
    client: httpx.AsyncClient, field: str, value: Any, words: str
) -> None:
    body = assert_error(await client.post("/v1/completions", json={"prompt": "x", field: value}), 400, field)
    assert words in body["message"]


def test_token_buckets_match_vllm() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(256)[-1] == 200


# -------------------------------------------------------------------------------------- endpoints
async def test_models_health_version(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 128
    assert (await client.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL
    assert_error(await client.get("/v1/models/nope"), 404)
    assert (await client.get("/health")).status_code == 200
    version = (await client.get("/version")).json()
    assert version["version"]
    modes = (version["quantization"], version["kv_cache_dtype"], version["speculative_config"])
    assert modes == (None, "auto", None)
    assert {"LlamaForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"} <= set(version["architectures"])


async def test_chat_completion_shape_and_usage(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital?"}]
    r = await client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 5}
    )
    assert r.status_code == 200, r.text
    body = ChatCompletionResponse.model_validate(r.json())
    assert body.choices[0].message.content == SCRIPT[:5]
    assert body.choices[0].finish_reason == "length"
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert body.usage.prompt_tokens == len(engine.tokenizer.encode(prompt, add_special_tokens=False))
    assert body.usage.completion_tokens == 5
    assert body.usage.total_tokens == body.usage.prompt_tokens + 5
    assert body.usage.prompt_tokens_details is not None
    assert body.usage.prompt_tokens_details.cached_tokens == 0
    assert r.headers["x-request-id"] == body.id


async def test_chat_default_max_tokens_fills_context(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "hi"}]
    r = await client.post("/v1/chat/completions", json={"messages": messages})
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == engine.config.max_model_len


async def test_max_completion_tokens_wins(client: httpx.AsyncClient) -> None:
    payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "max_completion_tokens": 3}
    assert (await client.post("/v1/chat/completions", json=payload)).json()["usage"]["completion_tokens"] == 3


async def test_chat_stream_chunks(client: httpx.AsyncClient) -> None:
    payload = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
        "top_logprobs": 2,
    }
    r = await client.post("/v1/chat/completions", json=payload)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = events(r.text)
    assert chunks[-1] == "[DONE]"
    parsed = [ChatCompletionStreamResponse.model_validate(c) for c in chunks[:-1]]
    texts: dict[int, str] = {0: "", 1: ""}
    roles = set()
    for chunk in parsed[:-1]:
        (choice,) = chunk.choices
        if choice.delta.role:
            roles.add(choice.index)
        texts[choice.index] += choice.delta.content or ""
        if choice.logprobs is not None:
            for item in choice.logprobs.content or []:
                assert len(item.top_logprobs) == 2
    assert roles == {0, 1}
    assert texts == {0: SCRIPT[:6], 1: SCRIPT[1:7]}
    assert parsed[-1].choices == [] and parsed[-1].usage is not None
    assert parsed[-1].usage.completion_tokens == 12


async def test_chat_logprobs_and_stop(client: httpx.AsyncClient) -> None:
    payload = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 20,
        "stop": ["capital"],
        "logprobs": True,
        "top_logprobs": 3,
    }
    choice = (await client.post("/v1/chat/completions", json=payload)).json()["choices"][0]
    assert choice["message"]["content"] == "Paris is the "
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "capital"
    content = choice["logprobs"]["content"]
    assert content[0]["token"] == "P" and content[0]["logprob"] == -0.25 and content[0]["bytes"] == [80]
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.25, -2.0, -3.0]


async def test_completion_batch_echo_logprobs(client: httpx.AsyncClient) -> None:
    payload = {"prompt": ["ab", "cd"], "max_tokens": 3, "echo": True, "logprobs": 1, "n": 2}
    r = await client.post("/v1/completions", json=payload)
    body = CompletionResponse.model_validate(r.json())
    assert [c.index for c in body.choices] == [0, 1, 2, 3]
    assert body.choices[0].text == "ab" + SCRIPT[:3]
    assert body.choices[3].text == "cd" + SCRIPT[1:4]
    lp = body.choices[0].logprobs
    assert lp is not None
    assert lp.tokens[1:3] == ["a", "b"]  # after <s>, which decodes to ""
    assert lp.token_logprobs[0] is None and lp.token_logprobs[-1] == -0.25
    assert lp.text_offset == sorted(lp.text_offset)
    assert body.usage.prompt_tokens == 2 * 3  # <s> + 2 bytes, twice
    assert body.usage.completion_tokens == 4 * 3


async def test_completion_token_ids_prompt_and_stream(client: httpx.AsyncClient) -> None:
    payload = {
        "prompt": [10, 11, 12],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = events((await client.post("/v1/completions", json=payload)).text)
    parsed = [CompletionStreamResponse.model_validate(c) for c in chunks[:-1]]
    assert "".join(c.choices[0].text for c in parsed if c.choices) == SCRIPT[:4]
    assert all(c.usage is not None for c in parsed)
    assert parsed[-1].usage is not None and parsed[-1].usage.prompt_tokens == 3
    assert parsed[-2].choices[0].finish_reason == "length"


async def test_tokenize_detokenize(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = (await client.post("/tokenize", json={"prompt": "hi", "return_token_strs": True})).json()
    assert r == {"count": 3, "max_model_len": 128, "tokens": [1, 107, 108], "token_strs": ["<s>", "h", "i"]}
    chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
    assert chat["count"] == len("<user>hi\n<assistant>")
    assert (await client.post("/detokenize", json={"tokens": [107, 108]})).json() == {"prompt": "hi"}
    assert_error(await client.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")


# ------------------------------------------------------------------------------------------ errors
async def test_error_shapes(client: httpx.AsyncClient) -> None:
    bad_json = await client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert_error(bad_json, 400)
    assert_error(await client.post("/v1/completions", json={"max_tokens": 3}), 400, "prompt")
    assert_error(await client.post("/v1/completions", json={"prompt": "x", "n": "many"}), 400, "n")
    assert_error(await client.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    unknown = assert_error(await client.post("/v1/completions", json={"prompt": "x", "model": "gpt-9"}), 404)
    assert unknown["code"] == "model_not_found" and "gpt-9" in unknown["message"]
    too_long = assert_error(
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 500}), 400
    )
    assert "128" in too_long["message"] and too_long["code"] == "context_length_exceeded"
    long_prompt = assert_error(
        await client.post("/v1/completions", json={"prompt": "x" * 300}), 400, "prompt"
    )
    assert "128" in long_prompt["message"]
    assert_error(await client.post("/v1/completions", json={"prompt": []}), 400, "prompt")
    assert_error(await client.post("/v1/completions", json={"prompt": [10**6]}), 400, "prompt")
    for field, value in (("stop_token_ids", [-1]), ("logit_bias", {"999999": 5})):
        streamed = {"prompt": "x", "stream": True, field: value}
        assert_error(await client.post("/v1/completions", json=streamed), 400, field)
    assert_error(await client.post("/v1/completions", json={"prompt": "x", "stream_options": {}}), 400)
    assert_error(await client.post("/v1/completions", json={"prompt": "x", "logit_bias": {"a": 1}}), 400)
    msgs = [{"role": "user", "content": "x"}]
    assert_error(await client.post("/v1/chat/completions", json={"messages": msgs, "top_logprobs": 2}), 400)
    untrusted = {"messages": msgs, "chat_template": "{{ messages }}"}  # issue 14: refused unless trusted
    assert_error(await client.post("/v1/chat/completions", json=untrusted), 400, "chat_template")
    min_tokens = {"prompt": "x", "max_tokens": 2, "min_tokens": 5}
    assert_error(await client.post("/v1/completions", json=min_tokens), 400, "min_tokens")
    assert_error(await client.get("/v1/nothing-here"), 404)
    assert_error(await client.get("/v1/completions"), 405)
    # and the server still answers normally
    assert (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status_code == 200


async def test_api_key(engine: FakeEngine) -> None:
    async with await app_client(engine, api_key="s3cret") as client:
        assert assert_error(await client.get("/v1/models"), 401)["code"] == "invalid_api_key"
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert_error(wrong, 401)
        assert_error(await client.post("/v1/completions", json={"prompt": "x"}), 401)
        ok = await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200


# -------------------------------------------------------------------------------- metrics, aborts
async def test_metrics_exposition(client: httpx.AsyncClient) -> None:
    await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    text = (await client.get("/metrics")).text
    label = f'model_name="{MODEL}"'
    gauges = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
    counters = [
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "prompt_tokens",
        "generation_tokens",
    ]
    for name in [f"vllm:{g}" for g in gauges] + [f"vllm:{c}_total" for c in counters]:
        assert any(line.startswith(name + "{") and label in line for line in text.splitlines()), name
    assert f'vllm:request_success_total{{engine="0",finished_reason="length",{label}}} 1.0' in text
    histograms = [
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ]
    for hist in histograms:
        count = 2.0 if hist == "inter_token_latency_seconds" else 1.0  # 3 tokens: 2 gaps
        assert f'vllm:{hist}_count{{engine="0",{label}}} {count}' in text, hist
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001"' in text
    assert 'vllm:request_generation_tokens_sum{engine="0",' + label + "} 3.0" in text
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert (
        'block_size="16"' in info and 'num_gpu_blocks="64"' in info and 'enable_prefix_caching="True"' in info
    )


async def _call_and_disconnect(
    engine: FakeEngine, path: str, payload: dict[str, Any], after_first_chunk: bool
) -> None:
    """Drive the ASGI app directly: the client disconnects after the first body chunk, or after 50 ms."""
    app = build_app(engine, ServerSettings())
    await engine.start()
    num_aborted = len(engine.aborted)
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": json.dumps(payload).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if after_first_chunk and message["type"] == "http.response.body" and message.get("body"):
            gone.set()

    if not after_first_chunk:
        asyncio.get_running_loop().call_later(0.05, gone.set)
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), 5)
    for _ in range(100):  # the abort reaches the engine thread within a step
        if len(engine.aborted) > num_aborted:
            break
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts(engine: FakeEngine, stream: bool) -> None:
    engine.step_delay = 0.01  # 100 tokens would take a second
    payload = {"prompt": "x", "max_tokens": 100, "stream": stream}
    await _call_and_disconnect(engine, "/v1/completions", payload, after_first_chunk=stream)
    assert len(engine.aborted) == 1 and not engine.running and not engine.finished
    payload = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100, "stream": stream}
    await _call_and_disconnect(engine, "/v1/chat/completions", payload, after_first_chunk=stream)
    assert len(engine.aborted) == 2 and not engine.running and not engine.finished


async def test_a_request_the_core_refuses_fails_alone(engine: FakeEngine) -> None:
    """An exception from the core's add_request (server/engine/async_engine.py) fails that request's
    stream; the engine loop lives on and serves the next request."""
    real_add = engine.scripted.add_request
    refused: list[str] = []

    def add_once_refused(request: Any) -> None:
        if not refused:
            refused.append(request.request_id)
            raise RuntimeError("refused by the core")
        real_add(request)

    engine.scripted.add_request = add_once_refused  # type: ignore[method-assign]
    await engine.start()
    params = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)
    with pytest.raises(RuntimeError, match="refused by the core"):
        async for _ in engine.generate("Hi", params, "first"):
            pass
    assert refused == ["first"] and engine.is_healthy()
    outputs = [o async for o in engine.generate("Hi", params, "second")]
    assert outputs[-1].finished and outputs[-1].outputs[0].text == SCRIPT[:3]
