"""A bounded fuzz of the whole request path: a careless or hostile client, through the router, to two
real engine servers (the embedded model, on CPU), all on 127.0.0.1.

1,200 requests from a seeded generator: malformed and truncated JSON, wrong types, out-of-range and
oversized values, text that is not valid Unicode, fields the server does not implement, wrong paths and
methods, and clients that hang up before the answer or in the middle of a stream, mixed with small valid
requests. Every answer must be a 2xx or a 4xx in OpenAI's error shape; afterwards both engines are
healthy and their running/waiting requests and KV-cache usage are back to 0 (nothing leaked).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest

from pagedserve.testing.processes import router_process, serve_process

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
NUM_REQUESTS = 1200
CONCURRENCY = 16
CLIENT_TIMEOUT_S = 120.0
ENGINE_FLAGS = ("--uvicorn-log-level", "warning", "--disable-access-log", "--shutdown-grace-period", "1",
                "--max-model-len", "2048")  # fmt: skip
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


@dataclass
class Case:
    """One fuzz request: what is sent, and how the client behaves."""

    kind: str
    method: str = "POST"
    path: str = "/v1/chat/completions"
    body: bytes = b""
    content_type: str = "application/json"
    hang_up: str | None = None  # "before-answer" | "mid-stream": the client disconnects
    hang_up_after_s: float = 0.0  # "before-answer": how long the client waits first


@dataclass
class Result:
    case: Case
    status: int | None = None
    body: bytes = b""
    disconnected: bool = False
    problems: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


# --------------------------------------------------------------------------------------- the generator
def _chat(rng: random.Random, **extra: object) -> dict:
    body: dict = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Say something about the number {rng.randint(0, 999)}."}],
        "max_tokens": rng.randint(1, 4),
        "temperature": rng.choice([0, 0.7, 1.0]),
    }
    body.update(extra)
    return body


def _completion(rng: random.Random, **extra: object) -> dict:
    body: dict = {"model": MODEL, "prompt": f"Count to {rng.randint(2, 9)}:", "max_tokens": rng.randint(1, 4)}
    body.update(extra)
    return body


def _json(body: object, path: str = "/v1/chat/completions", **kw: object) -> Case:
    return Case(kind=kw.pop("kind", "json"), path=path, body=json.dumps(body).encode(), **kw)  # type: ignore[arg-type]


def valid(rng: random.Random) -> Case:
    if rng.random() < 0.5:
        return _json(_chat(rng, stream=rng.random() < 0.5, n=rng.choice([1, 2])), kind="valid")
    return _json(_completion(rng, stream=rng.random() < 0.5, logprobs=rng.choice([None, 2])),
                 "/v1/completions", kind="valid")  # fmt: skip


def malformed_json(rng: random.Random) -> Case:
    text = json.dumps(_chat(rng))
    broken = rng.choice([
        text[: rng.randint(1, len(text) - 1)],  # truncated
        text.replace(":", "=", 1),
        "{" * 500 + "}" * 499,  # unbalanced, deeply nested
        "[" * 20000,  # nesting past any recursion limit
        "",
        "null",
        "[]",
        '"just a string"',
        "\x00\x01\x02",
    ])  # fmt: skip
    return Case(kind="malformed", path=rng.choice(["/v1/chat/completions", "/v1/completions"]),
                body=broken.encode("utf-8", "surrogatepass"))  # fmt: skip


def not_utf8(rng: random.Random) -> Case:
    raw = json.dumps(_chat(rng)).encode()
    cut = rng.randint(1, len(raw) - 2)
    return Case(kind="bytes", body=raw[:cut] + bytes([0xFF, 0xFE, 0xC0]) + raw[cut:])


WRONG_TYPES: list[tuple[str, object]] = [
    ("max_tokens", "2"), ("max_tokens", True), ("max_tokens", 2.5), ("max_tokens", [2]),
    ("temperature", "hot"), ("temperature", True), ("top_p", {}), ("n", "1"), ("n", 1.5), ("stream", "yes"),
    ("seed", "42"), ("stop", 7), ("stop", [1, 2]), ("logit_bias", [1]), ("logit_bias", {"x": 1}),
    ("messages", "hello"),
    ("messages", [{"role": 5, "content": "x"}]), ("messages", [{"content": "no role"}]), ("messages", []),
    ("model", 7), ("stream_options", "on"), ("top_k", "5"), ("min_p", "0.1"), ("presence_penalty", "0"),
]  # fmt: skip


def wrong_type(rng: random.Random) -> Case:
    key, value = rng.choice(WRONG_TYPES)
    return _json(_chat(rng, **{key: value}), kind="wrong-type")


OUT_OF_RANGE: list[tuple[str, object]] = [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 10**9), ("max_tokens", 2**70), ("n", 0),
    ("n", 10**6), ("temperature", -1), ("temperature", 1e308), ("top_p", 0), ("top_p", 2), ("top_k", -5),
    ("min_p", 1.5), ("seed", 2**64), ("seed", -(2**64)), ("presence_penalty", 9), ("frequency_penalty", -9),
    ("repetition_penalty", 0), ("top_logprobs", 1000), ("logit_bias", {"99999999": 5}),
    ("logit_bias", {"0": 1e9}), ("stop_token_ids", [-1]), ("stop_token_ids", [2**40]), ("min_tokens", -3),
    ("model", "no-such-model"), ("truncate_prompt_tokens", -1),
]  # fmt: skip


def out_of_range(rng: random.Random) -> Case:
    key, value = rng.choice(OUT_OF_RANGE)
    extra = {key: value}
    if key == "top_logprobs":
        extra["logprobs"] = True
    return _json(_chat(rng, **extra), kind="range")


def oversized(rng: random.Random) -> Case:
    choice = rng.randrange(6)
    if choice == 0:  # a prompt far past the context window
        return _json(_completion(rng, prompt="lorem ipsum " * rng.randint(3000, 40000)), "/v1/completions",
                     kind="oversized")  # fmt: skip
    if choice == 1:  # thousands of messages
        msgs = [{"role": "user", "content": "hi"}] * rng.randint(2000, 8000)
        return _json(_chat(rng, messages=msgs), kind="oversized")
    if choice == 2:  # a huge stop list
        return _json(_chat(rng, stop=["x" * 50] * rng.randint(100, 5000)), kind="oversized")
    if choice == 3:  # a huge logit_bias
        bias = {str(i): 0.1 for i in range(rng.randint(1000, 50000))}
        return _json(_chat(rng, logit_bias=bias), kind="oversized")
    if choice == 4:  # a batch of many prompts (legal: it is bounded only by what the engine can queue)
        return _json(_completion(rng, prompt=["hi"] * rng.randint(50, 200), max_tokens=1), "/v1/completions",
                     kind="oversized")  # fmt: skip
    return _json(_completion(rng, prompt=[rng.randint(0, 2**31) for _ in range(rng.randint(10, 5000))]),
                 "/v1/completions", kind="oversized")  # fmt: skip


def bad_text(rng: random.Random) -> Case:
    text = rng.choice(
        ["broken emoji \ud83d", "\udc00 low", "nul \x00 byte", "rtl \u202e", "bom \ufeff", "😀" * 50]
    )
    where = rng.randrange(4)
    if where == 0:
        body, path = _chat(rng, messages=[{"role": "user", "content": text}]), "/v1/chat/completions"
    elif where == 1:
        body, path = _completion(rng, prompt=text), "/v1/completions"
    elif where == 2:
        body, path = _chat(rng, stop=[text]), "/v1/chat/completions"
    else:
        body, path = {"model": MODEL, "prompt": text}, "/tokenize"
    # json.dumps escapes lone surrogates as \udXXX, exactly what a broken client sends.
    return _json(body, path, kind="unicode")


# Fields the server refuses here: structured outputs and tools it serves (issue 16), so their bad forms.
UNSUPPORTED: list[tuple[str, object]] = [
    ("guided_json", {"type": "bogus"}), ("guided_regex", "a("), ("guided_choice", []),
    ("structured_outputs", {"json": {"type": "object"}, "regex": "a"}),
    ("response_format", {"type": "json_schema"}),
    # tool_choice "auto" (the default with tools) needs --enable-auto-tool-choice, which these engines lack
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    ("echo", True), ("chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}"),
    ("guided_decoding_backend", "outlines"),
]  # fmt: skip


def unsupported(rng: random.Random) -> Case:
    key, value = rng.choice(UNSUPPORTED)
    return _json(_chat(rng, **{key: value}), kind="unsupported")


def wrong_route(rng: random.Random) -> Case:
    method, path = rng.choice([
        ("GET", "/v1/chat/completions"), ("PUT", "/v1/completions"), ("POST", "/v1/nope"), ("POST", "/v2/x"),
        ("DELETE", "/v1/models"), ("POST", "/v1/chat/completions/../../etc/passwd"), ("POST", "/%ff%fe"),
    ])  # fmt: skip
    return Case(kind="route", method=method, path=path, body=json.dumps(_chat(rng)).encode())


def wrong_content_type(rng: random.Random) -> Case:
    ctype = rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""])
    return Case(kind="content-type", body=json.dumps(_chat(rng)).encode(), content_type=ctype)


def hang_up(rng: random.Random) -> Case:
    long = _chat(rng, max_tokens=rng.randint(40, 120), stream=rng.random() < 0.7, temperature=0.8)
    case = _json(long, kind="hang-up")
    case.hang_up = rng.choice(["before-answer", "mid-stream"]) if long["stream"] else "before-answer"
    case.hang_up_after_s = rng.uniform(0.05, 0.6)
    return case


GENERATORS: list[tuple[float, Callable[[random.Random], Case]]] = [
    (0.12, valid), (0.08, malformed_json), (0.04, not_utf8), (0.14, wrong_type), (0.14, out_of_range),
    (0.07, oversized), (0.08, bad_text), (0.08, unsupported), (0.04, wrong_route), (0.03, wrong_content_type),
    (0.08, hang_up),
]  # fmt: skip


def fuzz_cases(seed: int, count: int) -> list[Case]:
    rng = random.Random(seed)
    weights = [w for w, _ in GENERATORS]
    makers = [m for _, m in GENERATORS]
    return [rng.choices(makers, weights)[0](rng) for _ in range(count)]


# ---------------------------------------------------------------------------------------- the checks
def openai_error_problems(result: Result) -> list[str]:
    """What is wrong with a 4xx body, measured against OpenAI's error shape."""
    try:
        doc = json.loads(result.body)
    except ValueError:
        return ["4xx body is not JSON"]
    error = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(error, dict):
        return ["4xx body has no error object"]
    problems = []
    if not isinstance(error.get("message"), str) or not error["message"]:
        problems.append("error.message missing")
    if not isinstance(error.get("type"), str):
        problems.append("error.type missing")
    return problems


def check(result: Result) -> Result:
    if result.disconnected:
        return result
    status = result.status
    if status is None:
        result.problems.append("no answer")
    elif 200 <= status < 300:
        # Some generated values are legal (a 2xx is right for them), but nothing invalid may pass.
        if result.case.kind in ("malformed", "bytes", "wrong-type", "unsupported"):
            result.problems.append(f"invalid {result.case.kind} request answered {status}")
    elif 400 <= status < 500:
        result.problems.extend(openai_error_problems(result))
        if result.case.kind == "valid":
            result.problems.append(f"valid request refused: {result.body[:300]!r}")
    else:
        result.problems.append(f"status {status}: {result.body[:300]!r}")
    return result


def problem_report(bad: list[Result]) -> str:
    """One line per kind of problem (how often, and the first request that showed it)."""
    first: dict[tuple[str, str], Result] = {}
    counts: Counter[tuple[str, str]] = Counter()
    for result in bad:
        key = (result.case.kind, result.problems[0][:60])
        counts[key] += 1
        first.setdefault(key, result)
    lines = []
    for key, count in counts.most_common():
        r = first[key]
        lines.append(f"{count}x {key[0]} {r.case.method} {r.case.path} {r.case.body[:160]!r}: {r.problems}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- the client
async def send(client: httpx.AsyncClient, case: Case) -> Result:
    started = time.monotonic()
    result = await _send(client, case)
    result.elapsed_s = time.monotonic() - started
    return result


async def _send(client: httpx.AsyncClient, case: Case) -> Result:
    result = Result(case)
    headers = {"content-type": case.content_type} if case.content_type else {}
    request = client.build_request(case.method, case.path, content=case.body, headers=headers)
    try:
        if case.hang_up == "before-answer":
            # Give the request time to reach an engine and start, then drop the connection.
            response_task = asyncio.ensure_future(client.send(request, stream=True))
            done, _ = await asyncio.wait({response_task}, timeout=case.hang_up_after_s)
            if done:
                await response_task.result().aclose()
            else:
                response_task.cancel()
            result.disconnected = True
            return result
        response = await client.send(request, stream=True)
        result.status = response.status_code
        try:
            if case.hang_up == "mid-stream" and response.status_code == 200:
                async for _ in response.aiter_bytes():
                    break
                result.disconnected = True
                return result
            result.body = await response.aread()
        finally:
            await response.aclose()
    except httpx.HTTPError as exc:
        result.problems.append(f"transport error {type(exc).__name__}: {exc}")
    return check(result)


async def run_fuzz(base_url: str, cases: list[Case]) -> list[Result]:
    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    queue: asyncio.Queue[Case] = asyncio.Queue()
    for case in cases:
        queue.put_nowait(case)
    results: list[Result] = []

    async with httpx.AsyncClient(base_url=base_url, timeout=CLIENT_TIMEOUT_S, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                results.append(await send(client, queue.get_nowait()))

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return results


def gauges(url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in GAUGES:
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        values = gauges(url)
        if all(values.get(name, 0.0) == 0.0 for name in GAUGES) or time.monotonic() > deadline:
            return values
        time.sleep(0.5)


# ------------------------------------------------------------------------------------------ the test
@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    import os

    import pagedserve

    logdir = tmp_path_factory.mktemp("fuzz")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    engines = [serve_process(logdir / f"engine{i}.log", *ENGINE_FLAGS, env=env).start() for i in range(2)]
    router = None
    try:
        for engine in engines:
            engine.wait_ready(240)
        flags = ["--tokenizer", pagedserve.default_model(), "--model-name", MODEL, "--health-interval", "0.5",
                 "--log-level", "warning"]  # fmt: skip
        router = router_process(logdir / "router.log", [e.url for e in engines], *flags, env=env).start()
        router.wait_ready(60)
        yield router, engines
    finally:
        for proc in [router, *engines]:
            if proc is not None:
                proc.stop()


@pytest.mark.heavy
def test_fuzz_through_the_router_leaves_both_engines_healthy_and_idle(fleet):
    router, engines = fleet
    cases = fuzz_cases(seed=14, count=NUM_REQUESTS)
    started = time.monotonic()
    results = asyncio.run(run_fuzz(router.url, cases))
    elapsed = time.monotonic() - started

    statuses = Counter(r.status if not r.disconnected else "hung-up" for r in results)
    kinds = Counter(r.case.kind for r in results)
    seconds = Counter()
    for r in results:
        seconds[r.case.kind] += round(r.elapsed_s, 1)
    print(f"client-seconds by kind: {dict(seconds.most_common())}")
    print(f"{len(results)} requests in {elapsed:.0f} s; statuses {dict(statuses)}; kinds {dict(kinds)}")
    assert len(results) == NUM_REQUESTS
    bad = [r for r in results if r.problems]
    assert not bad, (
        f"{len(bad)} bad answers:\n{problem_report(bad)}\n--- router log:\n{router.log_tail(2000)}"
    )
    assert statuses.get(200, 0) >= kinds["valid"], statuses  # every valid request succeeded

    for i, engine in enumerate(engines):
        engine.check_alive()
        assert httpx.get(engine.url + "/health", timeout=10).status_code == 200, engine.log_tail()
        left = wait_idle(engine.url)
        idle = all(left.get(name, 0.0) == 0.0 for name in GAUGES)
        assert idle, f"engine{i} not idle: {left}\n{engine.log_tail()}"
    router.check_alive()
    assert httpx.get(router.url + "/ready", timeout=10).status_code == 200
