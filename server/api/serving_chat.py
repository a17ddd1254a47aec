"""POST /v1/chat/completions: the tokenizer's chat template, one engine request, JSON or SSE chunks."""

from __future__ import annotations

from typing import Any

from pagedserve.server.api.errors import APIError
from pagedserve.server.api.protocol import ChatCompletionRequest
from pagedserve.server.api.serving_base import (
    ChoiceShaper,
    OpenAIServing,
    ResponseForm,
)
from pagedserve.server.engine.output import CompletionOutput, RequestOutput
from starlette.requests import Request
from starlette.responses import Response

ROLE = "assistant"


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.check_request(request)
        if request.tools and request.tool_choice != "none":
            # OpenAI's default with tools is "auto"; both it and a named tool need tool calling.
            raise APIError(
                "Tool calling is not supported: with tools, send tool_choice 'none' (the tools are then "
                "only shown to the chat template).",
                400,
                param="tool_choice" if request.tool_choice is not None else "tools",
            )
        if request.top_logprobs and not request.logprobs:
            raise APIError("top_logprobs needs logprobs set to true.", 400, param="top_logprobs")

        prompt_text = await self.apply_chat_template(request)
        prompt_ids = await self.tokenize(
            prompt_text, request.add_special_tokens, request.truncate_prompt_tokens
        )
        requested = (
            request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        )
        top_logprobs = request.top_logprobs or 0
        params = self.sampling_params(request, requested, top_logprobs if request.logprobs else None)
        prompt = {"prompt": prompt_text, "prompt_token_ids": prompt_ids}
        (engine_stream,) = await self.add_requests([prompt], params, "messages", request.cache_salt)

        tracker = self.metrics.track(len(prompt_ids), engine_stream.max_tokens, request.n)
        opening = [
            {"index": i, "delta": {"role": ROLE, "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(request.n)
        ]
        form = ResponseForm(
            id_prefix="chatcmpl",
            object="chat.completion",
            chunk_object="chat.completion.chunk",
            stream=request.stream,
            num_prompt_tokens=len(prompt_ids),
            chunk_choice=self._chunk_choice(request),
            choices=lambda finals: self._choices(finals[0], request),
            opening=opening,
            body_fields=self._prompt_logprobs if request.prompt_logprobs is not None else None,
        )
        return await self.respond(
            raw_request, [self.observed(engine_stream, tracker)], form, request.stream_options
        )

    def _choices(self, final: RequestOutput, request: ChatCompletionRequest) -> list[dict[str, Any]]:
        choices = []
        for out in final.outputs:
            logprobs = None
            if request.logprobs and out.logprobs is not None:
                logprobs = self.chat_logprobs(out.token_ids, out.logprobs, request.top_logprobs or 0)
            choices.append(
                {
                    "index": out.index,
                    "message": {"role": ROLE, "content": out.text, "tool_calls": []},
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason,
                }
            )
        return choices

    def _prompt_logprobs(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """vLLM puts a chat response's prompt_logprobs beside its choices."""
        return {"prompt_logprobs": self.prompt_logprobs_json(finals[0].prompt_logprobs)}

    def _chunk_choice(self, request: ChatCompletionRequest) -> ChoiceShaper:
        """A chat chunk's choice: the delta's text as `delta.content`, with its tokens' logprobs."""
        top_logprobs = request.top_logprobs or 0

        def shape(p_index: int, output: RequestOutput, delta: CompletionOutput) -> dict[str, Any]:
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
