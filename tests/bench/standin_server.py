"""A small stand-in OpenAI streaming server for testing `pagedserve bench serve` without a model.

It streams one word per "token" (``max_tokens`` of them, with ``--token-delay`` seconds between), sends
the usage chunk when ``stream_options.include_usage`` is set, and counts prompt tokens as words. With
``--die-after N`` the process exits abruptly in the middle of streaming its (N+1)-th request, which is how
the failure test stops "the server" mid-run.

Run: python tests/bench/standin_server.py --port 8123 [--token-delay 0.005] [--die-after N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "standin-model"


def create_app(
    token_delay: float = 0.005, die_after: int | None = None, api_key: str | None = None
) -> FastAPI:
    app = FastAPI()
    state = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}

    @app.get("/stats")
    async def stats() -> dict:
        return state

    async def handle(request: Request, chat: bool):
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": {"message": "bad key", "type": "invalid_request_error"}}, 401)
        body = await request.json()
        if chat:
            prompt = " ".join(str(m.get("content", "")) for m in body["messages"])
        else:
            prompt = body["prompt"]
        n_prompt = len(prompt.split())
        n_out = int(body.get("max_tokens") or 16)
        if not body.get("ignore_eos"):
            n_out = max(1, n_out // 2)  # "stops early" unless asked to ignore EOS
        state["requests"] += 1
        my_index = state["requests"]
        rid = f"cmpl-{my_index}"
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def stream():
            def chunk(payload: dict) -> str:
                return "data: " + json.dumps(payload) + "\n\n"

            base = {
                "id": rid,
                "created": int(time.time()),
                "model": MODEL,
                "object": "chat.completion.chunk" if chat else "text_completion",
            }
            if chat:
                yield chunk(
                    {
                        **base,
                        "choices": [
                            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        ],
                    }
                )
            for i in range(n_out):
                await asyncio.sleep(token_delay)
                if die_after is not None and my_index > die_after and i >= 2:
                    os._exit(1)  # the server dies mid-stream
                word = f" w{i}"
                if chat:
                    c = {"index": 0, "delta": {"content": word}, "finish_reason": None}
                else:
                    c = {"index": 0, "text": word, "logprobs": None, "finish_reason": None}
                if i == n_out - 1:
                    c["finish_reason"] = "length"
                yield chunk({**base, "choices": [c]})
            state["prompt_tokens"] += n_prompt
            state["completion_tokens"] += n_out
            if include_usage:
                yield chunk(
                    {
                        **base,
                        "choices": [],
                        "usage": {
                            "prompt_tokens": n_prompt,
                            "completion_tokens": n_out,
                            "total_tokens": n_prompt + n_out,
                        },
                    }
                )
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token-delay", type=float, default=0.005)
    p.add_argument("--die-after", type=int, default=None)
    p.add_argument("--api-key", default=None)
    a = p.parse_args()
    app = create_app(a.token_delay, a.die_after, a.api_key)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
