"""A small, fast stand-in for an engine replica (raw ASGI on uvicorn), for router tests and benchmarks.

Routes: POST /v1/chat/completions and /v1/completions (JSON, or SSE when ``"stream": true``, with
``chunks`` chunks ``chunk_delay`` seconds apart), GET /v1/models, /health, /metrics (vllm gauges).
Test hooks: POST /_control (JSON: fail_503 = answer the next N generation requests with 503,
health_status, waiting, kv_usage, chunk_delay, chunks, first_delay), GET /_requests (what it received:
path, authorization, body), POST /_reset.

Run standalone: ``python tests/router/fake_backend.py --port 9001 --name a``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

_JSON = [(b"content-type", b"application/json")]


class FakeBackend:
    def __init__(self, name: str = "fake", chunks: int = 4, chunk_delay: float = 0.0, record: bool = True):
        self.name = name
        self.chunks = chunks
        self.chunk_delay = chunk_delay
        self.first_delay = 0.0
        self.fail_503 = 0
        self.health_status = 200
        self.waiting = 0.0
        self.kv_usage = 0.0
        self.record = record
        self.received: list[dict] = []
        self.in_flight = 0
        self._name_b = name.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        body = b""
        more = True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        if path in ("/v1/chat/completions", "/v1/completions"):
            await self._generate(scope, path, body, send)
        elif path == "/health":
            await self._reply(send, self.health_status, b"{}")
        elif path == "/metrics":
            text = (
                "# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{model_name="{self.name}"}} {self.waiting}\n'
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                f'vllm:kv_cache_usage_perc{{model_name="{self.name}"}} {self.kv_usage}\n'
            ).encode()
            await self._reply(send, 200, text, b"text/plain; version=0.0.4")
        elif path == "/v1/models":
            data = {"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "fake"}]}
            await self._reply(send, 200, json.dumps(data).encode())
        elif path == "/_control":
            for key, value in json.loads(body or b"{}").items():
                setattr(self, key, value)
            await self._reply(send, 200, b"{}")
        elif path == "/_requests":
            await self._reply(send, 200, json.dumps(self.received).encode())
        elif path == "/_reset":
            self.received.clear()
            await self._reply(send, 200, b"{}")
        else:
            await self._reply(send, 404, b'{"error": {"message": "not found"}}')

    async def _reply(self, send, status, body, ctype=b"application/json"):
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", ctype),
                    (b"content-length", str(len(body)).encode()),
                    (b"x-backend", self._name_b),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _generate(self, scope, path, body, send):
        if self.fail_503 > 0:
            self.fail_503 -= 1
            await self._reply(send, 503, b'{"error": {"message": "overloaded", "code": 503}}')
            return
        if self.record:
            headers = dict(scope["headers"])
            auth = headers[b"authorization"].decode() if b"authorization" in headers else None
            fwd = headers[b"x-forwarded-for"].decode() if b"x-forwarded-for" in headers else None
            self.received.append(
                {
                    "forwarded_for": fwd,
                    "path": path,
                    "authorization": auth,
                    "body": body.decode("utf-8", "replace"),
                    "query": scope.get("query_string", b"").decode(),
                }
            )
        stream = b'"stream": true' in body or b'"stream":true' in body
        if self.first_delay:
            await asyncio.sleep(self.first_delay)
        if not stream:
            out = (
                b'{"id":"cmpl-1","object":"chat.completion","model":"fake","backend":"'
                + self._name_b
                + b'","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},'
                b'"finish_reason":"stop"}],'
                b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
            )
            await self._reply(send, 200, out)
            return
        self.in_flight += 1
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"x-backend", self._name_b)],
                }
            )
            for i in range(self.chunks):
                if i and self.chunk_delay:
                    await asyncio.sleep(self.chunk_delay)
                chunk = {
                    "id": "c",
                    "object": "chat.completion.chunk",
                    "backend": self.name,
                    "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
                }
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                        "more_body": True,
                    }
                )
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        finally:
            self.in_flight -= 1


class ServerThread:
    """Runs an ASGI app on 127.0.0.1 in a background thread (its own event loop)."""

    def __init__(self, app, port: int = 0, host: str = "127.0.0.1") -> None:
        import uvicorn

        self.app = app
        self.config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="on", access_log=False
        )
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.host = host
        self._port = port

    def start(self, timeout: float = 10.0) -> ServerThread:
        self.thread.start()
        deadline = time.time() + timeout
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        self._port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default="fake")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--chunk-delay", type=float, default=0.0)
    p.add_argument("--no-record", action="store_true")
    a = p.parse_args()
    app = FakeBackend(a.name, chunks=a.chunks, chunk_delay=a.chunk_delay, record=not a.no_record)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning", access_log=False, lifespan="on")


if __name__ == "__main__":
    main()
