"""The fake OpenAI backend's own contract: token counts, stream shape, usage, hooks."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from pagedserve.testing.fake_openai import FakeOpenAI
from pagedserve.testing.server_thread import ServerThread


@pytest.fixture
def fake() -> Iterator[tuple[FakeOpenAI, httpx.Client]]:
    app = FakeOpenAI(name="m1")
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=10) as client:
        yield app, client


def events(response: httpx.Response) -> list[dict | str]:
    lines = [line[len("data: ") :] for line in response.text.splitlines() if line]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def test_completion_counts_words_and_stops_early_without_ignore_eos(fake):
    _, client = fake
    r = client.post("/v1/completions", json={"prompt": "one two three", "max_tokens": 6})
    assert r.status_code == 200 and r.headers["x-backend"] == "m1"
    body = r.json()
    assert body["object"] == "text_completion" and body["backend"] == "m1"
    assert body["choices"][0]["text"] == " w0 w1 w2" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 6, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 6 and r.json()["usage"]["prompt_tokens"] == 2
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert client.get("/_stats").json() == {"requests": 2, "prompt_tokens": 5, "completion_tokens": 9}


def test_chat_stream_with_usage(fake):
    app, client = fake
    body = {"messages": [{"role": "user", "content": "a b"}], "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    out = events(client.post("/v1/chat/completions", json=body))
    assert out[-1] == "[DONE]"
    *chunks, usage, _ = out
    assert len(chunks) == app.tokens  # no max_tokens: the default length
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": " w0"}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (app.tokens - 1) + ["stop"]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 2


def test_hooks_over_http(fake):
    app, client = fake
    assert client.post("/_control", json={"fail_503": 1, "api_key": "k", "waiting": 3}).status_code == 200
    assert client.post("/_control", json={"no_such_hook": 1}).status_code == 400
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert client.post("/v1/chat/completions", json=chat).status_code == 401
    auth = {"Authorization": "Bearer k"}
    assert client.post("/v1/chat/completions", json=chat, headers=auth).status_code == 503
    assert client.post("/v1/chat/completions?x=1", json=chat, headers=auth).status_code == 200
    (seen,) = client.get("/_requests").json()
    assert seen["path"] == "/v1/chat/completions" and seen["query"] == "x=1"
    assert seen["authorization"] == "Bearer k" and json.loads(seen["body"]) == chat
    assert 'vllm:num_requests_waiting{model_name="m1"} 3' in client.get("/metrics").text
    assert client.get("/v1/models").json()["data"][0]["id"] == "m1"
    assert client.post("/_reset").status_code == 200
    assert client.get("/_requests").json() == [] and client.get("/_stats").json()["requests"] == 0
    app.health_status = 503
    assert client.get("/health").status_code == 503
    assert client.get("/nope").status_code == 404


def test_lora_adapters_follow_the_engine_contract():
    """vLLM's HTTP contract for adapters, as pagedserve's engine serves it (the router and operator tests
    rely on the fake keeping to it)."""
    app = FakeOpenAI(name="pod-0", served_model_name="base", enable_lora=True, adapters={"sql": "/a/sql"})
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=10) as client:
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
            ("base", "base", None),
            ("sql", "/a/sql", "base"),
        ]
        load = {"lora_name": "fr", "lora_path": "acme/fr"}
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 200
        assert (
            client.post("/v1/load_lora_adapter", json=load).json()["error"]["code"] == 400
        )  # already loaded
        app.refuse_loads = True
        assert (
            client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}).status_code
            == 400
        )
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "fr"}).status_code == 200
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "fr"}).status_code == 404
        for model in ("sql", "sql", "base"):
            assert client.post("/v1/completions", json={"model": model, "prompt": "hi"}).status_code == 200
        unknown = client.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        metrics = client.get("/metrics").text
        assert 'pagedserve:lora_requests_total{model_name="pod-0",engine="0",lora_name="sql"} 2' in metrics
        assert (
            'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}'
            in metrics
        )
    plain = FakeOpenAI(name="m")  # without --enable-lora: no adapter routes, any model name
    with ServerThread(plain) as server, httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 404
        assert client.post("/v1/completions", json={"model": "nope", "prompt": "hi"}).status_code == 200
        assert "lora" not in client.get("/metrics").text
