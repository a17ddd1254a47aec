"""POST /v1/chat/completions: the tokenizer's chat template, one engine request, JSON or SSE chunks."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pagedserve.server.api.errors import APIError
from pagedserve.server.api.protocol import ChatCompletionRequest
from pagedserve.server.api.serving_engine import (
    SSE_DONE,
    ClientDisconnected,
    EventStreamResponse,
    OpenAIServing,
    dumps,
    random_id,
    sse,
    usage_dict,
)
from starlette.requests import Request
from starlette.responses import Response

logger = logging.getLogger("pagedserve.api")
ROLE = "assistant"


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.check_request(request)
        if request.tools and request.tool_choice not in (None, "none"):
            raise APIError(
                "Tool calling is not supported: send tool_choice 'none' (tools are then only shown "
                "to the chat template).",
                400,
                param="tool_choice",
            )
        if request.response_format and request.response_format.get("type", "text") != "text":
            raise APIError("Only response_format type 'text' is supported.", 400, param="response_format")
        if request.top_logprobs and not request.logprobs:
            raise APIError("top_logprobs needs logprobs set to true.", 400, param="top_logprobs")

        prompt_text, conversation = self.apply_chat_template(
            request.messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template=request.chat_template,
            chat_template_kwargs=request.chat_template_kwargs,
            tools=request.tools,
        )
        prompt_ids = await self.tokenize(
            prompt_text, request.add_special_tokens, request.truncate_prompt_tokens
        )
        requested = (
            request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        )
        max_tokens = self.resolve_max_tokens(requested, len(prompt_ids), "messages")
        top_logprobs = request.top_logprobs or 0
        params = self.sampling_params(request, max_tokens, top_logprobs if request.logprobs else None)

        echo = ""
        if request.echo and conversation and conversation[-1]["role"] == ROLE:
            echo = conversation[-1]["content"] or ""
        tracker = self.metrics.track(len(prompt_ids), max_tokens, request.n)
        stream = self.generate({"prompt": prompt_text, "prompt_token_ids": prompt_ids}, params, tracker)
        request_id = f"chatcmpl-{random_id()}"
        created = int(time.time())
        headers = {"X-Request-Id": request_id}
        if request.stream:
            chunks = self._stream(stream, request, request_id, created, len(prompt_ids), echo)
            return EventStreamResponse(chunks, headers=headers)
        try:
            (final,) = await self.final_outputs(raw_request, [stream])
        except ClientDisconnected:
            return Response(status_code=499)
        body = self._response(final, request, request_id, created, echo)
        return Response(dumps(body), media_type="application/json", headers=headers)

    def _response(
        self, final: Any, request: ChatCompletionRequest, request_id: str, created: int, echo: str
    ) -> dict[str, Any]:
        choices = []
        completion_tokens = 0
        for out in final.outputs:
            completion_tokens += len(out.token_ids)
            logprobs = None
            if request.logprobs and out.logprobs is not None:
                logprobs = self.chat_logprobs(out.token_ids, out.logprobs, request.top_logprobs or 0)
            choices.append(
                {
                    "index": out.index,
                    "message": {"role": ROLE, "content": echo + out.text, "tool_calls": []},
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason,
                }
            )
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": usage_dict(len(final.prompt_token_ids), completion_tokens, final.num_cached_tokens),
        }

    async def _stream(
        self,
        stream: AsyncIterator[Any],
        request: ChatCompletionRequest,
        request_id: str,
        created: int,
        num_prompt_tokens: int,
        echo: str,
    ) -> AsyncIterator[str]:
        n = request.n
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(include_usage and options and options.continuous_usage_stats)
        want_logprobs = bool(request.logprobs)
        top_logprobs = request.top_logprobs or 0
        base = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.model_name,
        }
        text_len, token_len, done = [0] * n, [0] * n, [False] * n
        completion_tokens = cached_tokens = 0

        def chunk(choice: dict[str, Any]) -> str:
            body = {**base, "choices": [choice]}
            if continuous:
                body["usage"] = usage_dict(num_prompt_tokens, completion_tokens, cached_tokens)
            return sse(body)

        try:
            for index in range(n):
                yield chunk(
                    {
                        "index": index,
                        "delta": {"role": ROLE, "content": echo},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
            async for output in stream:
                cached_tokens = output.num_cached_tokens
                completion_tokens = sum(len(o.token_ids) for o in output.outputs)
                for out in output.outputs:
                    i = out.index
                    if done[i]:
                        continue
                    finish = out.finish_reason
                    delta = out.text[text_len[i] :]
                    if not delta and finish is None:
                        continue  # nothing new to show yet (a held-back stop-string prefix)
                    logprobs = None
                    if want_logprobs and out.logprobs is not None:
                        start = token_len[i]
                        logprobs = self.chat_logprobs(
                            out.token_ids[start:], out.logprobs[start:], top_logprobs
                        )
                    text_len[i], token_len[i] = len(out.text), len(out.token_ids)
                    done[i] = finish is not None
                    yield chunk(
                        {
                            "index": i,
                            "delta": {"content": delta},
                            "logprobs": logprobs,
                            "finish_reason": finish,
                            "stop_reason": out.stop_reason,
                        }
                    )
            if include_usage:
                usage = usage_dict(num_prompt_tokens, completion_tokens, cached_tokens)
                yield sse({**base, "choices": [], "usage": usage})
        except Exception as exc:
            if not isinstance(exc, APIError):
                logger.exception("chat stream %s failed", request_id)
            yield self.stream_error(exc)
        finally:
            await stream.aclose()  # `async for` leaves it open when this generator is closed mid-stream
        yield SSE_DONE
