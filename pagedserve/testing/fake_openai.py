"""A fake OpenAI-compatible engine replica for the router tests, the `bench serve` tests and the router
overhead benchmark (benchmarks/router_overhead.py). Raw ASGI, no framework: on uvicorn it answers
thousands of requests per second, so it never limits what it measures.

Generation (POST /v1/chat/completions, /v1/completions): a request generates ``max_tokens`` tokens (half
of them, at least one, without ``ignore_eos``: a model that stops early), or ``tokens`` when it sets no
``max_tokens``; token i is the word `` w{i}``. Prompt tokens are counted as words (a prompt of token ids:
its length). ``"stream": true`` gives one SSE chunk per token, ``token_delay`` seconds before each, the
usage chunk when ``stream_options.include_usage`` is set, then ``data: [DONE]``; otherwise one JSON body.
Every answer carries the header ``x-backend: <name>``, and generations a ``"backend"`` field.

Other routes: GET /v1/models (the base model, ``served_model_name`` or ``name``, then each LoRA adapter
of ``adapters`` with its ``parent``, in vLLM's shape), /health (status ``health_status``), /metrics (vLLM's
``num_requests_waiting`` and ``kv_cache_usage_perc`` gauges: ``waiting`` and ``kv_usage``; with
``enable_lora`` also ``vllm:lora_requests_info`` and ``pagedserve:lora_requests_total``).

LoRA (``enable_lora``, the engine's --enable-lora with runtime updating on): POST /v1/load_lora_adapter
``{"lora_name", "lora_path"}`` -> 200 text, 400 when the name is loaded already or ``refuse_loads`` is set;
POST /v1/unload_lora_adapter ``{"lora_name"}`` -> 200, 404 when unknown. A generation whose ``model`` is
neither ``name`` nor an adapter gets 404 ``model_not_found``; each adapter's requests are counted.

Test hooks, the attributes of `FakeOpenAI`, set in this process or over HTTP with POST /_control (JSON):
``fail_503`` (answer the next N generation requests with 503), ``health_status``, ``waiting``,
``kv_usage``, ``tokens``, ``token_delay``, ``first_delay`` (seconds before the response starts),
``adapters``, ``refuse_loads``, ``api_key`` (401 unless ``Authorization: Bearer <api_key>``),
``error_status`` (answer every generation request, after recording it, with this status and an OpenAI
error; 0: off), ``kv_transfer_params`` (a prefill engine of the router's P/D mode, router/pd.py: the
object a non-streamed generation asking ``kv_transfer_params.do_remote_decode`` gets back at the top
level of its answer; None: ``null``, an engine that kept no KV) and
``die_after`` (only where the fake has its own process: the process exits two tokens into the stream
of request N+1, as a crashing server would). GET /_requests: the generation requests received (path,
query, authorization, x-forwarded-for, body), when ``record`` is on; GET /_stats: requests, prompt and
completion tokens counted; POST /_reset: forget both.

Run on its own: ``python -m pagedserve.testing.fake_openai --port 9001 --name a [--token-delay 0.005]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions")
LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
JSON = b"application/json"
TEXT = b"text/plain; charset=utf-8"


@dataclass
class Stats:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Generation:
    """What one generation request asks for, as the fake reads it."""

    chat: bool
    stream: bool
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    include_usage: bool

    @classmethod
    def parse(cls, path: str, body: dict[str, Any], default_tokens: int) -> Generation:
        chat = path == "/v1/chat/completions"
        if chat:
            prompt: Any = " ".join(str(m.get("content", "")) for m in body.get("messages") or [])
        else:
            prompt = body.get("prompt", "")
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            n, finish = default_tokens, "stop"
        elif body.get("ignore_eos"):
            n, finish = int(max_tokens), "length"
        else:
            n, finish = max(1, int(max_tokens) // 2), "stop"  # "stops early" unless told to ignore EOS
        return cls(
            chat=chat,
            stream=bool(body.get("stream")),
            prompt_tokens=len(prompt) if isinstance(prompt, list) else len(str(prompt).split()),
            completion_tokens=n,
            finish_reason=finish,
            include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
        )

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass
class FakeOpenAI:
    """The ASGI app; every field is a test hook (see the module docstring)."""

    name: str = "fake"
    served_model_name: str | None = None  # the base model's id (default: name)
    tokens: int = 4
    token_delay: float = 0.0
    first_delay: float = 0.0
    fail_503: int = 0
    health_status: int = 200
    waiting: float = 0.0
    kv_usage: float = 0.0
    api_key: str | None = None
    die_after: int | None = None
    record: bool = True
    enable_lora: bool = False
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA name -> path, as --lora-modules
    max_loras: int = 1
    refuse_loads: bool = False
    error_status: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    lora_requests: dict[str, int] = field(default_factory=dict)  # finished requests per adapter
    received: list[dict[str, Any]] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    _running_loras: dict[str, int] = field(default_factory=dict)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        path = scope["path"]
        if path in GENERATE_PATHS:
            await self._generate(scope, path, body, send)
        elif path == "/health":
            await self._reply(send, self.health_status, {})
        elif path == "/metrics":
            await self._reply(send, 200, self._metrics().encode(), b"text/plain; version=0.0.4")
        elif path == "/v1/models":
            await self._reply(send, 200, {"object": "list", "data": self._model_cards()})
        elif path in LORA_PATHS and self.enable_lora:
            await self._lora_update(path, body, send)
        elif path == "/_control":
            hooks = json.loads(body or b"{}")
            unknown = sorted(set(hooks) - set(self.__dataclass_fields__))
            if unknown:
                message = f"no such hooks: {unknown}"
                await self._reply(send, 400, _error(message, 400, "invalid_request_error"))
                return
            for key, value in hooks.items():
                setattr(self, key, value)
            await self._reply(send, 200, {})
        elif path == "/_requests":
            await self._reply(send, 200, self.received)
        elif path == "/_stats":
            await self._reply(send, 200, vars(self.stats))
        elif path == "/_reset":
            self.received.clear()
            self.stats = Stats()
            await self._reply(send, 200, {})
        else:
            await self._reply(send, 404, _error("not found", 404))

    def _model_cards(self) -> list[dict[str, Any]]:
        base_name = self.served_model_name or self.name
        base = {"id": base_name, "object": "model", "owned_by": "fake", "root": base_name, "parent": None}
        loras = [
            {"id": lora, "object": "model", "owned_by": "fake", "root": path, "parent": base_name}
            for lora, path in self.adapters.items()
        ]
        return [base, *loras]

    async def _lora_update(self, path: str, body: bytes, send) -> None:
        """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter."""
        try:
            request = json.loads(body)
            lora = str(request["lora_name"])
        except (ValueError, TypeError, KeyError) as exc:
            await self._reply(send, 400, _error(f"bad request body: {exc!r}", 400, "invalid_request_error"))
            return
        if path == "/v1/unload_lora_adapter":
            if self.adapters.pop(lora, None) is None:
                await self._reply(
                    send, 404, _error(f"The lora adapter '{lora}' cannot be found.", 404, "NotFoundError")
                )
                return
            await self._reply(
                send, 200, f"Success: LoRA adapter '{lora}' removed successfully.".encode(), TEXT
            )
            return
        if lora in self.adapters or self.refuse_loads:
            why = "has already been loaded" if lora in self.adapters else "is not a valid PEFT adapter"
            await self._reply(
                send, 400, _error(f"The lora adapter '{lora}' {why}.", 400, "invalid_request_error")
            )
            return
        self.adapters[lora] = str(request.get("lora_path", ""))
        await self._reply(send, 200, f"Success: LoRA adapter '{lora}' added successfully.".encode(), TEXT)

    @staticmethod
    async def _lifespan(receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _metrics(self) -> str:
        text = (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="{self.name}"}} {self.waiting}\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="{self.name}"}} {self.kv_usage}\n'
        )
        if not self.enable_lora:
            return text
        running = ",".join(sorted(lora for lora, n in self._running_loras.items() if n > 0))
        info = f'max_lora="{self.max_loras}",running_lora_adapters="{running}",waiting_lora_adapters=""'
        text += f"# TYPE vllm:lora_requests_info gauge\nvllm:lora_requests_info{{{info}}} {time.time()}\n"
        text += "# TYPE pagedserve:lora_requests_total counter\n"
        for lora, count in sorted(self.lora_requests.items()):
            labels = f'model_name="{self.name}",engine="0",lora_name="{lora}"'
            text += f"pagedserve:lora_requests_total{{{labels}}} {count}\n"
        return text

    async def _reply(self, send, status: int, payload: Any, content_type: bytes = JSON) -> None:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        headers = [
            (b"content-type", content_type),
            (b"content-length", str(len(body)).encode()),
            (b"x-backend", self.name.encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _record(self, scope, path: str, body: bytes) -> None:
        headers = dict(scope["headers"])
        self.received.append(
            {
                "path": path,
                "query": scope.get("query_string", b"").decode(),
                "authorization": _header(headers, b"authorization"),
                "forwarded_for": _header(headers, b"x-forwarded-for"),
                "body": body.decode("utf-8", "replace"),
            }
        )

    async def _generate(self, scope, path: str, body: bytes, send) -> None:
        if self.api_key and _header(dict(scope["headers"]), b"authorization") != f"Bearer {self.api_key}":
            await self._reply(send, 401, _error("bad key", 401, "invalid_request_error"))
            return
        if self.fail_503 > 0:
            self.fail_503 -= 1
            await self._reply(send, 503, _error("overloaded", 503))
            return
        if self.record:
            self._record(scope, path, body)
        if self.error_status:
            await self._reply(send, self.error_status, _error("told to fail", self.error_status))
            return
        try:
            request = json.loads(body)
            gen = Generation.parse(path, request, self.tokens)
        except (ValueError, TypeError, AttributeError, RecursionError) as exc:
            await self._reply(send, 400, _error(f"bad request body: {exc}", 400, "invalid_request_error"))
            return
        model = request.get("model")
        lora = model if model in self.adapters else None
        if self.enable_lora and model not in (None, self.served_model_name or self.name) and lora is None:
            error = _error(f"The model `{model}` does not exist.", 404, "NotFoundError")
            error["error"].update(param="model", code="model_not_found")
            await self._reply(send, 404, error)
            return
        self.stats.requests += 1
        index = self.stats.requests
        if lora is not None:
            self._running_loras[lora] = self._running_loras.get(lora, 0) + 1
        try:
            if self.first_delay:
                await asyncio.sleep(self.first_delay)
            if gen.stream:
                await self._stream(gen, index, send)
            else:
                answer = self._completion(gen, index)
                if (request.get("kv_transfer_params") or {}).get("do_remote_decode"):
                    answer["kv_transfer_params"] = self.kv_transfer_params  # a prefill engine's
                await self._reply(send, 200, answer)
        finally:
            if lora is not None:
                self._running_loras[lora] -= 1
                self.lora_requests[lora] = self.lora_requests.get(lora, 0) + 1
        self.stats.prompt_tokens += gen.prompt_tokens
        self.stats.completion_tokens += gen.completion_tokens

    def _completion(self, gen: Generation, index: int) -> dict[str, Any]:
        text = "".join(f" w{i}" for i in range(gen.completion_tokens))
        if gen.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = gen.finish_reason
        return {
            **self._head(gen, index, "chat.completion" if gen.chat else "text_completion"),
            "choices": [choice],
            "usage": gen.usage(),
        }

    def _head(self, gen: Generation, index: int, kind: str) -> dict[str, Any]:
        return {"id": f"cmpl-{index}", "object": kind, "created": int(time.time()), "model": self.name,
                "backend": self.name}  # fmt: skip

    async def _stream(self, gen: Generation, index: int, send) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"x-backend", self.name.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        head = self._head(gen, index, "chat.completion.chunk" if gen.chat else "text_completion")
        last = gen.completion_tokens - 1
        for i in range(gen.completion_tokens):
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
            if self.die_after is not None and index > self.die_after and i >= 2:
                os._exit(1)  # the server dies mid-stream
            finish = gen.finish_reason if i == last else None
            if gen.chat:
                delta = {"role": "assistant", "content": f" w{i}"} if i == 0 else {"content": f" w{i}"}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": f" w{i}", "logprobs": None, "finish_reason": finish}
            await _send_event(send, {**head, "choices": [choice]})
        if gen.include_usage:
            await _send_event(send, {**head, "choices": [], "usage": gen.usage()})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _send_event(send, payload: dict[str, Any]) -> None:
    event = b"data: " + json.dumps(payload).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": event, "more_body": True})


def _header(headers: dict[bytes, bytes], name: bytes) -> str | None:
    value = headers.get(name)
    return value.decode() if value is not None else None


def _error(message: str, code: int, kind: str = "server_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(description="A fake OpenAI-compatible engine replica (see the module doc).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default="fake", help="model and backend name")
    p.add_argument("--tokens", type=int, default=4, help="tokens a request without max_tokens generates")
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds before each streamed token")
    p.add_argument("--die-after", type=int, default=None, help="exit mid-stream in request N+1")
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-record", action="store_true", help="keep no request bodies (long benchmarks)")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters, loadable at runtime")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH", help="adapters at start-up")
    a = p.parse_args(argv)
    app = FakeOpenAI(
        name=a.name,
        tokens=a.tokens,
        token_delay=a.token_delay,
        die_after=a.die_after,
        api_key=a.api_key,
        record=not a.no_record,
        enable_lora=a.enable_lora,
        adapters=dict(module.split("=", 1) for module in a.lora_modules),
    )
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning", access_log=False, lifespan="on")


if __name__ == "__main__":
    main()


def wait_router_polled(app: Any, urls: list[str], timeout: float = 30.0) -> None:
    """Until the in-process router ``app`` (router/proxy.py ``RouterApp``) has read the /v1/models of
    every replica in ``urls`` once. Before its first poll it knows no replica's load or adapters, so
    what a test of its routing sees would depend on how busy the machine is."""
    from pagedserve.testing.net import wait_until

    def polled() -> bool:
        states = [app.balancer.backends.get(url) for url in urls]
        return all(state is not None and state.models is not None for state in states)

    wait_until(polled, timeout, "the router's first poll of every replica")
