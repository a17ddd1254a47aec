"""POST /v1/completions: one engine request per prompt (a batch of prompts runs concurrently).

``echo`` with ``logprobs`` gives the prompt tokens' logprobs (the first null) before the completion's,
from the engine's prompt logprobs; ``echo`` with ``max_tokens`` 0 returns only the prompt, as vLLM does
(the engine still generates one token, which usage counts): lm-evaluation-harness scores with that.
"""

from __future__ import annotations

from typing import Any

from pagedserve.common.errors import APIError
from pagedserve.server.api.media import ImageLoader, ImageRef
from pagedserve.server.api.protocol import CompletionRequest
from pagedserve.server.api.serving_base import (
    ChoiceShaper,
    OpenAIServing,
    ResponseForm,
)
from pagedserve.server.outputs import CompletionOutput, RequestOutput
from starlette.requests import Request
from starlette.responses import Response


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
    def __init__(self, *args: Any, images: ImageLoader) -> None:
        super().__init__(*args)
        self.images = images

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        lora = self.check_model(request.model)
        self.check_request(request)
        if request.suffix:
            raise APIError("suffix is not supported.", 400, param="suffix")
        prompts = await self._prompts(request)
        engine_inputs = [p.engine_input() for p in prompts]
        if request.multi_modal_data is not None:
            engine_inputs = [await self._with_images(request)]
        params = self.sampling_params(
            request,
            1 if _echo_only(request) else request.max_tokens,
            request.logprobs,
            prompt_logprobs=request.logprobs if request.echo else None,
        )
        engine_streams = await self.add_requests(
            engine_inputs, params, "prompt", request, lora, request.cache_salt
        )
        if request.multi_modal_data is not None:  # the processor expanded the images' placeholders
            prompts = [_Prompt(self, prompts[0].text, engine_streams[0].prompt_token_ids)]
            self.metrics.image_inputs.inc(len(engine_inputs[0]["multi_modal_data"]["image"]))
        streams = [
            self.observed(s, self.metrics.track(len(s.prompt_token_ids), s.max_tokens, request.n))
            for s in engine_streams
        ]
        form = ResponseForm(
            id_prefix="cmpl",
            object="text_completion",
            chunk_object="text_completion",
            stream=request.stream,
            num_prompt_tokens=sum(len(s.prompt_token_ids) for s in engine_streams),
            chunk_choice=self._chunk_choice(prompts, request),
            choices=lambda finals: self._choices(finals, prompts, request),
            model=self.response_model(lora),
        )
        return await self.respond(raw_request, streams, form, request.stream_options)

    async def _with_images(self, request: CompletionRequest) -> dict[str, Any]:
        """The one text prompt with its images (vLLM's ``multi_modal_data``), for the engine's processor."""
        assert request.multi_modal_data is not None
        if not isinstance(request.prompt, str):
            raise APIError("multi_modal_data needs a single text prompt, with a placeholder per image.", 400,
                           param="prompt")
        if request.truncate_prompt_tokens is not None:
            raise APIError("truncate_prompt_tokens cannot cut a prompt with images.", 400,
                           param="truncate_prompt_tokens")
        urls = request.multi_modal_data.image
        urls = [urls] if isinstance(urls, str) else urls
        refs = [ImageRef(url, f"multi_modal_data.image[{i}]") for i, url in enumerate(urls)]
        images = await self.images.load(refs)
        return {"prompt": request.prompt, "multi_modal_data": {"image": images},
                "add_special_tokens": request.add_special_tokens}

    async def _prompts(self, request: CompletionRequest) -> list[_Prompt]:
        """The batch's prompts; text is tokenized here (the engine checks every prompt)."""
        raw = request.prompt
        if isinstance(raw, str) or not raw or isinstance(raw[0], int):
            raw = [raw]  # type: ignore[list-item]  # one prompt; [] is one empty prompt, a 400
        truncate = request.truncate_prompt_tokens
        prompts = []
        for item in raw:
            if isinstance(item, str):
                ids = await self.tokenize(item, request.add_special_tokens, truncate)
                prompts.append(_Prompt(self, item if truncate is None else None, ids))
            else:
                ids = list(item)
                prompts.append(_Prompt(self, None, ids[-truncate:] if truncate else ids))
        return prompts

    def _logprobs(
        self, out: CompletionOutput, final: RequestOutput, prompt: _Prompt | None, request: CompletionRequest
    ) -> dict[str, Any]:
        """Logprobs of the output tokens, after the prompt's when echoing (only those with max_tokens 0)."""
        k = request.logprobs or 0
        if prompt is None:
            return self.completion_logprobs(out.token_ids, out.logprobs, k, 0)[0]
        prompt_part, offset = self.completion_logprobs(prompt.ids, final.prompt_logprobs, k, 0)
        if _echo_only(request):
            return prompt_part
        return _concat(prompt_part, self.completion_logprobs(out.token_ids, out.logprobs, k, offset)[0])

    def _choices(
        self, finals: list[RequestOutput], prompts: list[_Prompt], request: CompletionRequest
    ) -> list[dict[str, Any]]:
        choices = []
        for p_index, (final, prompt) in enumerate(zip(finals, prompts, strict=True)):
            for out in final.outputs:
                logprobs = None
                if request.logprobs is not None and out.logprobs is not None:
                    logprobs = self._logprobs(out, final, prompt if request.echo else None, request)
                choice = {
                    "index": p_index * request.n + out.index,
                    "text": _echoed(prompt.text, out.text, request) if request.echo else out.text,
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason,
                }
                if final.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.prompt_logprobs_json(final.prompt_logprobs)
                choices.append(choice)
        return choices

    def _chunk_choice(self, prompts: list[_Prompt], request: CompletionRequest) -> ChoiceShaper:
        """A completion chunk's choice: the delta's text (after the prompt's, on a choice's first chunk
        when echoing), with legacy logprobs whose text offsets run on across the choice's chunks."""
        n, k = request.n, request.logprobs
        started: set[int] = set()
        offsets = [0] * (len(prompts) * n)
        prompt_steps: dict[int, Any] = {}  # a prompt's logprobs come once, with its first output

        def shape(p_index: int, output: RequestOutput, delta: CompletionOutput) -> dict[str, Any]:
            if output.prompt_logprobs is not None:
                prompt_steps[p_index] = output.prompt_logprobs
            i = p_index * n + delta.index
            text = "" if _echo_only(request) else delta.text
            echo_logprobs = None
            if request.echo and i not in started:
                prompt = prompts[p_index]
                text = prompt.text + text
                if k is not None:
                    echo_logprobs, offsets[i] = self.completion_logprobs(
                        prompt.ids, prompt_steps.get(p_index), k, 0
                    )
            started.add(i)
            logprobs = None
            if _echo_only(request):
                logprobs = echo_logprobs
            elif k is not None and delta.logprobs is not None:
                logprobs, offsets[i] = self.completion_logprobs(
                    delta.token_ids, delta.logprobs, k, offsets[i]
                )
                if echo_logprobs is not None:
                    logprobs = _concat(echo_logprobs, logprobs)
            return {
                "index": i,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
            }

        return shape


def _echo_only(request: CompletionRequest) -> bool:
    """echo with max_tokens 0: the answer is the prompt alone (the engine generates one token unseen)."""
    return bool(request.echo) and request.max_tokens == 0


def _echoed(prompt_text: str, text: str, request: CompletionRequest) -> str:
    """A choice's text when echoing: the prompt, then the completion unless max_tokens was 0."""
    return prompt_text if _echo_only(request) else prompt_text + text


def _concat(first: dict[str, list[Any]], second: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {key: first[key] + second[key] for key in first}
