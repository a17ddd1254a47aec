"""POST /v1/chat/completions: the tokenizer's chat template, one engine request, JSON or SSE chunks."""

from __future__ import annotations

import time
from typing import Any

from pagedserve.server.api.errors import APIError
from pagedserve.server.api.protocol import ChatCompletionRequest
from pagedserve.server.api.serving_base import (
    ChoiceShaper,
    ClientDisconnected,
    EventStreamResponse,
    OpenAIServing,
    dumps,
    random_id,
    usage_dict,
)
from pagedserve.server.engine.output import CompletionOutput, RequestOutput
from pagedserve.server.engine.processor import PromptInput
from starlette.requests import Request
from starlette.responses import Response

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
        top_logprobs = request.top_logprobs or 0
        params = self.sampling_params(request, requested, top_logprobs if request.logprobs else None)
        prompt: PromptInput = {"prompt": prompt_text, "prompt_token_ids": prompt_ids}
        (engine_stream,) = await self.add_requests([prompt], params, "messages")

        echo = ""
        if request.echo and conversation and conversation[-1]["role"] == ROLE:
            echo = conversation[-1]["content"] or ""
        tracker = self.metrics.track(len(prompt_ids), engine_stream.max_tokens, request.n)
        stream = self.observed(engine_stream, tracker)
        request_id = f"chatcmpl-{random_id()}"
        created = int(time.time())
        headers = {"X-Request-Id": request_id}
        if request.stream:
            base = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
            }
            opening = [
                {
                    "index": i,
                    "delta": {"role": ROLE, "content": echo},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(request.n)
            ]
            chunks = self.stream_chunks(
                [stream], self._chunk_choice(request), base, len(prompt_ids), request.stream_options, opening
            )
            return EventStreamResponse(chunks, headers=headers)
        try:
            (final,) = await self.final_outputs(raw_request, [stream])
        except ClientDisconnected:
            return Response(status_code=499)
        body = self._response(final, request, request_id, created, echo)
        return Response(dumps(body), media_type="application/json", headers=headers)

    def _response(
        self, final: RequestOutput, request: ChatCompletionRequest, request_id: str, created: int, echo: str
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

    def _chunk_choice(self, request: ChatCompletionRequest) -> ChoiceShaper:
        """A chat chunk's choice: the delta's text as `delta.content`, with its tokens' logprobs."""
        top_logprobs = request.top_logprobs or 0

        def shape(p_index: int, delta: CompletionOutput) -> dict[str, Any]:
            logprobs = None
            if request.logprobs and delta.logprobs is not None:
                logprobs = self.chat_logprobs(delta.token_ids, delta.logprobs, top_logprobs)
            return {
                "index": delta.index,
                "delta": {"content": delta.text},
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
            }

        return shape
