"""A real `pagedserve serve` process on 127.0.0.1 with the embedded model, driven by the official openai
client, raw HTTP and schemathesis.

One module-scoped server serves every test (loading the model is the expensive part); the last test
sends it SIGTERM and checks that an in-flight stream still completes and the process exits 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from pagedserve import default_model
from pagedserve.testing.openapi_fuzz import fuzz_openapi
from pagedserve.testing.processes import (
    DEMO_ANSWER,
    DEMO_QUESTION,
    ServerProcess,
    float_model_args,
    serve_process,
)

pytestmark = pytest.mark.slow

API_KEY = "test-key-123"
MAX_MODEL_LEN = 256
MODEL = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # The float32 weights: test_32_concurrent_streams compares greedy texts from two differently batched
    # rounds, and in gguf mode a step's row count picks the kernel (kernels/cpu.py GGUF_DENSE_ROWS), so
    # there a request's greedy text may change with what it is batched with (tests/models/
    # test_quantization_server.py and the e2e tests serve the gguf default).
    flags = [*float_model_args(), "--max-model-len", str(MAX_MODEL_LEN), "--shutdown-grace-period", "60"]
    env = {**os.environ, "PAGEDSERVE_API_KEY": API_KEY}
    with serve_process(log, *flags, env=env) as srv:
        srv.wait_ready(STARTUP_TIMEOUT_S)
        yield srv


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(default_model()))


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def async_client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def metric(server: ServerProcess, name: str, labels: str = "") -> float:
    """The value of the first sample of `name` whose label set contains `labels`."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{labels}}} not in /metrics")


DEMO = [{"role": "user", "content": DEMO_QUESTION}]


# ------------------------------------------------------------------------------------- openai client
def test_chat_answers_with_tokenizer_usage(server: ServerProcess, tokenizer) -> None:
    result = client(server).chat.completions.create(
        model=MODEL, messages=DEMO, max_tokens=24, temperature=0
    )
    choice = result.choices[0]
    assert DEMO_ANSWER in (choice.message.content or "")
    assert choice.message.role == "assistant"
    prompt = tokenizer.apply_chat_template(DEMO, add_generation_prompt=True, tokenize=False)
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert result.usage.completion_tokens == len(tokenizer.encode(choice.message.content or "")) + (
        choice.finish_reason == "stop"
    )  # the end-of-turn token that stopped it counts, as in vLLM
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    assert result.usage.prompt_tokens_details is not None
    assert result.model == MODEL


def test_chat_stream_equals_non_stream(server: ServerProcess) -> None:
    c = client(server)
    kwargs = {"model": MODEL, "messages": DEMO, "max_tokens": 16, "temperature": 0}
    whole = c.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0


def test_completions_stream_and_not(server: ServerProcess, tokenizer) -> None:
    c = client(server)
    prompt = "The capital of France is"
    kwargs = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = c.completions.create(**kwargs)
    assert "Paris" in whole.choices[0].text
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
    streamed = list(c.completions.create(**kwargs, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_n_seed_stop_logprobs(server: ServerProcess) -> None:
    c = client(server)
    sampled = {"model": MODEL, "messages": DEMO, "max_tokens": 10, "temperature": 1.0, "seed": 1234}
    two = c.chat.completions.create(**sampled, n=2)
    assert sorted(ch.index for ch in two.choices) == [0, 1]
    again = c.chat.completions.create(**sampled, n=2)
    assert [ch.message.content for ch in again.choices] == [ch.message.content for ch in two.choices]

    stopped = c.chat.completions.create(
        model=MODEL, messages=DEMO, max_tokens=24, temperature=0, stop=[DEMO_ANSWER]
    )
    assert DEMO_ANSWER not in (stopped.choices[0].message.content or "")
    assert stopped.choices[0].finish_reason == "stop"

    lp = c.chat.completions.create(
        model=MODEL, messages=DEMO, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = lp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == lp.usage.completion_tokens  # type: ignore[union-attr]
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy: the top token

    comp = c.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    logprobs = comp.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens or []) == 3
    assert all(len(top) >= 2 for top in logprobs.top_logprobs or [])


def test_models_tokenize_version(server: ServerProcess, tokenizer) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    auth = {"Authorization": f"Bearer {API_KEY}"}  # issue 14: /tokenize renders templates, so needs the key
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}, headers=auth).json()
    assert tok["tokens"] == tokenizer.encode("Hello world") and tok["max_model_len"] == MAX_MODEL_LEN
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}, headers=auth).json()
    assert detok["prompt"] == "Hello world"
    assert httpx.get(f"{server.url}/version").json()["version"]
    conversation = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Capital of France?"},
    ]
    for add_generation_prompt in (True, False):
        body = {"messages": conversation, "add_generation_prompt": add_generation_prompt}
        served = httpx.post(f"{server.url}/tokenize", json=body, headers=auth).json()["tokens"]
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert served == tokenizer.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------------------------- concurrency
def test_32_concurrent_streams(server: ServerProcess) -> None:
    """32 streaming clients at once: each streamed text equals the same request's non-streamed (greedy) text,
    and /metrics saw several requests running together."""
    prompts = [f"Fact number {i}:" for i in range(32)]
    base = {"model": MODEL, "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    peak = 0.0
    stop_polling = threading.Event()

    def poll() -> None:
        nonlocal peak
        while not stop_polling.is_set():
            peak = max(peak, metric(server, "vllm:num_requests_running"))
            time.sleep(0.05)

    async def stream_one(c: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await c.completions.create(**base, prompt=prompt, stream=True)
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def whole_one(c: openai.AsyncOpenAI, prompt: str) -> str:
        return (await c.completions.create(**base, prompt=prompt)).choices[0].text

    async def run() -> tuple[list[str], list[str]]:
        async with async_client(server) as c:
            streamed = await asyncio.gather(*[stream_one(c, p) for p in prompts])
            whole = await asyncio.gather(*[whole_one(c, p) for p in prompts])
        return list(streamed), list(whole)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        streamed, whole = asyncio.run(run())
    finally:
        stop_polling.set()
        poller.join()
    assert all(streamed)
    assert streamed == whole
    assert peak > 1, "never saw more than one request running at once"


def test_disconnects_free_everything(server: ServerProcess) -> None:
    idle_usage = metric(server, "vllm:kv_cache_usage_perc")
    aborted_before = metric(server, "vllm:request_success_total", 'finished_reason="abort"')

    async def leave_early(c: openai.AsyncOpenAI, i: int) -> None:
        stream = await c.completions.create(
            model=MODEL,
            prompt=f"Count to a thousand, step {i}:",
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.close()

    async def run() -> None:
        async with async_client(server) as c:
            await asyncio.gather(*[leave_early(c, i) for i in range(16)])

    asyncio.run(run())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running, usage = (
            metric(server, "vllm:num_requests_running"),
            metric(server, "vllm:kv_cache_usage_perc"),
        )
        if running == 0 and usage == idle_usage:
            break
        time.sleep(0.1)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == idle_usage
    assert metric(server, "vllm:request_success_total", 'finished_reason="abort"') >= aborted_before + 16


# ------------------------------------------------------------------------------------------- errors
def _assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_error_cases(server: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{server.url}/v1/chat/completions"
    with httpx.Client(timeout=60) as http:
        bad_json = http.post(url, content=b"{oops", headers={**auth, "content-type": "application/json"})
        _assert_error(bad_json, 400)
        _assert_error(http.post(url, json={"messages": "not a list"}, headers=auth), 400)
        _assert_error(http.post(url, json={"messages": DEMO, "temperature": "hot"}, headers=auth), 400)
        too_long = http.post(url, json={"messages": DEMO, "max_tokens": 1000}, headers=auth)
        assert str(MAX_MODEL_LEN) in _assert_error(too_long, 400)["message"]
        long_prompt = {"model": MODEL, "prompt": "word " * 400}
        assert (
            str(MAX_MODEL_LEN)
            in _assert_error(http.post(f"{server.url}/v1/completions", json=long_prompt, headers=auth), 400)[
                "message"
            ]
        )
        assert _assert_error(http.post(url, json={"model": "nope", "messages": DEMO}, headers=auth), 404)[
            "code"
        ]
        _assert_error(http.post(url, json={"messages": DEMO}), 401)
        _assert_error(
            http.post(url, json={"messages": DEMO}, headers={"Authorization": "Bearer wrong"}), 401
        )
        _assert_error(http.get(f"{server.url}/v1/models"), 401)
        assert http.get(f"{server.url}/health").status_code == 200
        assert http.get(f"{server.url}/metrics").status_code == 200
        ok = http.post(url, json={"messages": DEMO, "max_tokens": 2}, headers=auth)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="nope", messages=DEMO)
    with pytest.raises(openai.BadRequestError):
        client(server).chat.completions.create(model=MODEL, messages=DEMO, max_tokens=10_000)


def test_schemathesis_fuzz_no_server_errors(server: ServerProcess) -> None:
    """Every operation in /openapi.json, fuzzed with schema-valid and invalid data: never a 5xx, and every
    response's status, content type and body as the schema documents them.

    Generation is bounded (max_tokens, n) so each request costs a few engine steps at most.
    """
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def bound(case) -> None:
        body = case.body
        if not isinstance(body, dict):
            return
        if isinstance(body.get("n"), int):
            body["n"] = min(body["n"], 2)
        for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
            if isinstance(body.get(key), int) and body[key] > 4:
                body[key] = 4
        if "prompt" in body or "messages" in body:
            body.setdefault("max_tokens", 4)

    seen = fuzz_openapi(server.url, headers=headers, prepare=bound)
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"} <= set(seen)
    assert client(server).models.list().data  # still serving


# ----------------------------------------------------------------------------------- last: shutdown
def test_sigterm_drains_in_flight_and_exits_zero(server: ServerProcess) -> None:
    """SIGTERM: readiness fails at once (503), the in-flight stream runs to its end, exit code 0."""
    c = client(server)
    stream = c.completions.create(
        model=MODEL, prompt="Count:", max_tokens=24, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    first = next(chunks)
    server.process.send_signal(signal.SIGTERM)
    assert httpx.get(f"{server.url}/health", timeout=2).status_code == 503  # issue 14: was refused
    rest = list(chunks)  # ... but the stream in flight runs to its end
    assert first.choices and rest[-1].choices[0].finish_reason == "length"
    assert server.process.wait(timeout=60) == 0, server.log_text()[-3000:]
    log = server.log_text()
    assert "method=POST path=/v1/completions status=200" in log  # the access log
