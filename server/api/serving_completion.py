"""POST /v1/completions: one engine request per prompt (a batch of prompts runs concurrently)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pagedserve.server.api.errors import APIError
from pagedserve.server.api.protocol import CompletionRequest
from pagedserve.server.api.serving_engine import (
    SSE_DONE,
    ClientDisconnected,
    EventStreamResponse,
    OpenAIServing,
    dumps,
    merge_async_iterators,
    random_id,
    sse,
    usage_dict,
)
from starlette.requests import Request
from starlette.responses import Response

logger = logging.getLogger("pagedserve.api")


class _Prompt:
    """One prompt of the batch: its token ids, and its text (decoded only if echo needs it)."""

    __slots__ = ("_text", "ids", "serving")

    def __init__(self, serving: OpenAIServing, text: str | None, ids: list[int]) -> None:
        self.serving, self._text, self.ids = serving, text, ids

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self.serving.tokenizer.decode(self.ids)
        return self._text

    def engine_input(self) -> dict[str, Any]:
        return {"prompt": self._text, "prompt_token_ids": self.ids}


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.check_request(request)
        if request.suffix:
            raise APIError("suffix is not supported.", 400, param="suffix")
        prompts = await self._prompts(request)
        streams = []
        for prompt in prompts:
            max_tokens = self.resolve_max_tokens(request.max_tokens, len(prompt.ids), "prompt")
            params = self.sampling_params(request, max_tokens, request.logprobs)
            tracker = self.metrics.track(len(prompt.ids), max_tokens, request.n)
            streams.append(self.generate(prompt.engine_input(), params, tracker))
        request_id = f"cmpl-{random_id()}"
        created = int(time.time())
        headers = {"X-Request-Id": request_id}
        if request.stream:
            return EventStreamResponse(
                self._stream(streams, prompts, request, request_id, created), headers=headers
            )
        try:
            finals = await self.final_outputs(raw_request, streams)
        except ClientDisconnected:
            return Response(status_code=499)
        body = self._response(finals, prompts, request, request_id, created)
        return Response(dumps(body), media_type="application/json", headers=headers)

    async def _prompts(self, request: CompletionRequest) -> list[_Prompt]:
        raw = request.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]  # type: ignore[list-item]
        if not raw:
            raise APIError("prompt must not be empty.", 400, param="prompt")
        truncate = request.truncate_prompt_tokens
        prompts = []
        for item in raw:
            if isinstance(item, str):
                ids = await self.tokenize(item, request.add_special_tokens, truncate)
                prompts.append(_Prompt(self, item if truncate is None else None, ids))
            else:
                ids = list(item)
                self.check_token_ids(ids, "prompt")
                prompts.append(_Prompt(self, None, ids[-truncate:] if truncate else ids))
        return prompts

    def _logprobs(self, out: Any, prompt: _Prompt | None, k: int) -> dict[str, Any]:
        """Logprobs of the output tokens, after the prompt's (null) ones when echoing."""
        if prompt is None:
            return self.completion_logprobs(out.token_ids, out.logprobs, k, 0)[0]
        prompt_part, offset = self.completion_logprobs(prompt.ids, None, k, 0)
        return _concat(prompt_part, self.completion_logprobs(out.token_ids, out.logprobs, k, offset)[0])

    def _response(
        self,
        finals: list[Any],
        prompts: list[_Prompt],
        request: CompletionRequest,
        request_id: str,
        created: int,
    ) -> dict[str, Any]:
        choices = []
        prompt_tokens = completion_tokens = cached_tokens = 0
        for p_index, (final, prompt) in enumerate(zip(finals, prompts, strict=True)):
            prompt_tokens += len(final.prompt_token_ids)
            cached_tokens += final.num_cached_tokens
            for out in final.outputs:
                completion_tokens += len(out.token_ids)
                logprobs = None
                if request.logprobs is not None and out.logprobs is not None:
                    logprobs = self._logprobs(out, prompt if request.echo else None, request.logprobs)
                choices.append(
                    {
                        "index": p_index * request.n + out.index,
                        "text": (prompt.text + out.text) if request.echo else out.text,
                        "logprobs": logprobs,
                        "finish_reason": out.finish_reason,
                        "stop_reason": out.stop_reason,
                    }
                )
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": usage_dict(prompt_tokens, completion_tokens, cached_tokens),
        }

    async def _stream(
        self,
        streams: list[AsyncIterator[Any]],
        prompts: list[_Prompt],
        request: CompletionRequest,
        request_id: str,
        created: int,
    ) -> AsyncIterator[str]:
        n = request.n
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(include_usage and options and options.continuous_usage_stats)
        k = request.logprobs
        base = {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name}
        total = len(prompts) * n
        text_len, token_len, offsets = [0] * total, [0] * total, [0] * total
        started, done = [False] * total, [False] * total
        completion_tokens = [0] * len(prompts)
        cached_tokens = [0] * len(prompts)
        prompt_tokens = sum(len(p.ids) for p in prompts)
        merged = merge_async_iterators(*streams)
        try:
            async for p_index, output in merged:
                cached_tokens[p_index] = output.num_cached_tokens
                completion_tokens[p_index] = sum(len(o.token_ids) for o in output.outputs)
                for out in output.outputs:
                    i = p_index * n + out.index
                    if done[i]:
                        continue
                    finish = out.finish_reason
                    delta = out.text[text_len[i] :]
                    echo = request.echo and not started[i]
                    if not delta and finish is None and not echo:
                        continue
                    echo_logprobs = None
                    if echo:
                        prompt = prompts[p_index]
                        delta = prompt.text + delta
                        if k is not None:
                            echo_logprobs, offsets[i] = self.completion_logprobs(prompt.ids, None, k, 0)
                    logprobs = None
                    if k is not None and out.logprobs is not None:
                        start = token_len[i]
                        logprobs, offsets[i] = self.completion_logprobs(
                            out.token_ids[start:], out.logprobs[start:], k, offsets[i]
                        )
                        if echo_logprobs is not None:
                            logprobs = _concat(echo_logprobs, logprobs)
                    started[i] = True
                    text_len[i], token_len[i] = len(out.text), len(out.token_ids)
                    done[i] = finish is not None
                    body = {
                        **base,
                        "choices": [
                            {
                                "index": i,
                                "text": delta,
                                "logprobs": logprobs,
                                "finish_reason": finish,
                                "stop_reason": out.stop_reason,
                            }
                        ],
                    }
                    if continuous:
                        body["usage"] = usage_dict(prompt_tokens, sum(completion_tokens), sum(cached_tokens))
                    yield sse(body)
            if include_usage:
                usage = usage_dict(prompt_tokens, sum(completion_tokens), sum(cached_tokens))
                yield sse({**base, "choices": [], "usage": usage})
        except Exception as exc:
            if not isinstance(exc, APIError):
                logger.exception("completion stream %s failed", request_id)
            yield self.stream_error(exc)
        finally:
            await merged.aclose()  # `async for` leaves it open when this generator is closed mid-stream
        yield SSE_DONE


def _concat(first: dict[str, list[Any]], second: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {key: first[key] + second[key] for key in first}
