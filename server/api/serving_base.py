"""The base of the chat, completion and tokenization handlers: what they share.

Model check, prompt rendering, sampling parameters, the one place an engine refusal
(``InvalidRequestError``) becomes an OpenAI 400, the per-request engine streams, the one streaming
generator (chat and completions differ only in how a choice is shaped), logprobs and usage.

One engine request per prompt, each asked for DELTA outputs (``EngineClient.add_request``); a
non-streamed response is the deltas folded together. A client that goes away ends its stream: the
streaming response watches for the disconnect and cancels, a non-streamed request is raced against the
disconnect, and the engine stream, once closed, aborts its request, so its KV blocks return within one
engine step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pagedserve.common.chat_template import ChatTemplateError, ChatTemplateRenderer, request_template
from pagedserve.common.disconnect import ClientDisconnected, run_unless_disconnected, wait_for_disconnect
from pagedserve.common.errors import APIError, error_body
from pagedserve.server.api.graceful_stop import GracefulStop
from pagedserve.server.api.media import ImageRef
from pagedserve.server.api.metrics import RequestTracker, ServerMetrics
from pagedserve.server.api.protocol import (
    ChatCompletionMessageParam,
    ChatTemplateFields,
    StreamOptions,
    constraint_field,
    structured_outputs_params,
)
from pagedserve.server.engine.processor import UNSET_IS_DEFAULT
from pagedserve.server.engine.protocol import EngineClient, RequestStream
from pagedserve.server.exceptions import InvalidRequestError
from pagedserve.server.lora_request import LoRARequest
from pagedserve.server.outputs import CompletionOutput, RequestOutput
from pagedserve.server.pooling_params import PoolingParams
from pagedserve.server.sampling_params import RequestOutputKind, SamplingParams
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("pagedserve.api")
T = TypeVar("T")
# Shapes one delta of one choice into a chunk's choice: (index of the prompt, its output, the delta);
# None: nothing to send for this delta (a tool-call parser holds its text back).
ChoiceShaper = Callable[[int, RequestOutput, CompletionOutput], dict[str, Any] | None]


@dataclass
class ResponseForm:
    """What tells a chat response from a completion one; everything else about a response is shared."""

    id_prefix: str  # "chatcmpl" | "cmpl"
    object: str  # of the whole response: "chat.completion" | "text_completion"
    chunk_object: str  # of each streamed chunk
    stream: bool
    num_prompt_tokens: int
    chunk_choice: ChoiceShaper  # a streamed delta -> a chunk's choice
    choices: Callable[[list[RequestOutput]], list[dict[str, Any]]]  # folded outputs -> the body's choices
    opening: list[dict[str, Any]] | None = None  # choices streamed before any delta (chat's role)
    body_fields: Callable[[list[RequestOutput]], dict[str, Any]] | None = None  # beside the choices
    model: str | None = None  # the response's model (a LoRA adapter's name); None: the base model's


LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for -inf
_TOKENIZE_IN_THREAD_CHARS = 16384  # longer texts are tokenized off the event loop


def random_id() -> str:
    return uuid.uuid4().hex


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class EventStreamResponse(StreamingResponse):
    """A server-sent-event stream that notices a client disconnect at once, not at its next write.

    The body is streamed in one task while another waits for ``http.disconnect``; whichever ends first
    cancels the other, and the body generator is closed either way, so the engine stream inside it ends
    (and aborts its request) as soon as the client is gone.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streamer = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait((streamer, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            streamer.cancel()
            await asyncio.gather(streamer, watcher, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
        if not streamer.cancelled():
            exc = streamer.exception()
            if exc is not None and not isinstance(exc, OSError):  # OSError: the client went away
                raise exc


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with their iterator's index.

    Closing (or cancelling) the merged iterator closes every source.
    """
    pending: dict[asyncio.Future[T], int] = {}
    try:
        if len(iterators) == 1:
            async for item in iterators[0]:
                yield 0, item
            return
        pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[index]))] = index
                yield index, item
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()


class OpenAIServing:
    """Base of the chat, completion and tokenization handlers."""

    def __init__(
        self,
        engine: EngineClient,
        model_names: list[str],
        metrics: ServerMetrics,
        templates: ChatTemplateRenderer,
        stop: GracefulStop,
    ) -> None:
        self.engine = engine
        self.templates = templates
        self.stop = stop
        self.tokenizer = engine.tokenizer
        self.model_names = model_names
        self.model_name = model_names[0]
        self.max_model_len = engine.max_model_len
        self.metrics = metrics

    # ---- checks -------------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names, None for the base model; 404 for any other name."""
        if model is None or model in self.model_names:
            return None
        try:
            return self.engine.lora_named(model)
        except InvalidRequestError as exc:
            raise self.invalid_request(exc, "model") from exc

    def response_model(self, lora: LoRARequest | None) -> str:
        """What a response's ``model`` says: the adapter's name, or the base model's (vLLM's)."""
        return lora.lora_name if lora is not None else self.model_name

    def check_serving(self) -> None:
        """A 503 before any work while draining (the router retries it on another replica) or dead."""
        if self.stop.draining:
            raise APIError("The server is shutting down.", 503)
        if not self.engine.is_healthy():
            raise APIError("The engine is not running.", 503)

    def check_request(self, request: Any) -> None:
        """What only the OpenAI API has; the engine checks the prompt, limits and parameters itself."""
        self.check_serving()
        if request.use_beam_search:
            raise APIError("use_beam_search is not supported.", 400, param="use_beam_search")
        if request.best_of is not None and request.best_of != request.n:
            raise APIError("best_of must equal n: best-of sampling is not supported.", 400, param="best_of")
        if request.stream_options is not None and not request.stream:
            raise APIError("stream_options can only be set when stream is true.", 400, param="stream_options")
        if request.prompt_logprobs is not None and request.stream:
            raise APIError(
                "prompt_logprobs are not available when stream is true.", 400, param="prompt_logprobs"
            )

    @staticmethod
    def invalid_request(exc: InvalidRequestError, prompt_param: str, request: Any = None) -> APIError:
        """The one place an engine refusal becomes a 400 (a 404 for a model that does not exist); the prompt
        is `messages` in a chat request, and a constraint the grammar engine refuses is named by the field
        the request sent it in."""
        param = prompt_param if exc.param == "prompt" else exc.param
        message = exc.message
        if request is not None and param is not None and param.startswith("structured_outputs"):
            field = constraint_field(request)  # the engine names structured_outputs.<kind>
            if field not in (None, "structured_outputs"):
                message = message.replace(f"{param}: ", f"{field}: ", 1)
                param = field
        status = 404 if exc.code == "model_not_found" else 400
        return APIError(message, status, param=param, code=exc.code)

    # ---- prompts ------------------------------------------------------------------------------------

    async def tokenize(self, text: str, add_special_tokens: bool, truncate: int | None = None) -> list[int]:
        if len(text) > _TOKENIZE_IN_THREAD_CHARS:
            ids = await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        ids = list(ids)
        if truncate is not None and len(ids) > truncate:
            ids = ids[-truncate:]
        return ids

    async def apply_chat_template(
        self, request: ChatTemplateFields, conversation: list[dict[str, Any]] | None = None
    ) -> str:
        """The request's conversation (``chat_conversation``'s, made here when not given) rendered with
        the chat template (common/chat_template.py: in a sandbox, off the event loop, bounded)."""
        if request.add_generation_prompt and request.continue_final_message:
            raise APIError(
                "add_generation_prompt and continue_final_message cannot both be true.",
                400,
                param="continue_final_message",
            )
        if conversation is None:
            conversation, images = chat_conversation(request.messages)
            if images:
                raise APIError(
                    "Image parts are taken by /v1/chat/completions and /v1/responses only.",
                    400,
                    param=images[0].param,
                )
        kwargs = request.chat_template_kwargs or {}
        if request.reasoning_effort is not None:  # chat_template_kwargs may set it too, and wins
            kwargs = {"reasoning_effort": request.reasoning_effort, **kwargs}
        try:
            prompt = await self.templates.render_async(
                conversation,
                request_template=request_template(request.chat_template, kwargs),
                tools=[tool.model_dump(exclude_none=True) for tool in request.tools]
                if request.tools
                else None,
                documents=request.documents,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                kwargs=kwargs,
            )
        except ChatTemplateError as exc:
            raise APIError(exc.message, 400, param=exc.param) from exc
        return prompt

    # ---- sampling -----------------------------------------------------------------------------------

    def sampling_params(
        self, request: Any, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The engine's parameters for a request; ``prompt_logprobs`` stands in for the request's own when
        it has none (completions ask for them to echo the prompt with logprobs, as vLLM does)."""
        if request.prompt_logprobs is not None:
            prompt_logprobs = request.prompt_logprobs
        kwargs: dict[str, Any] = {
            "n": request.n,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "stop": request.stop,
            "stop_token_ids": request.stop_token_ids,
            "ignore_eos": request.ignore_eos,
            "min_tokens": request.min_tokens,
            "skip_special_tokens": request.skip_special_tokens,
            "spaces_between_special_tokens": request.spaces_between_special_tokens,
            "include_stop_str_in_output": request.include_stop_str_in_output,
            "seed": request.seed,
            "allowed_token_ids": request.allowed_token_ids,
            "bad_words": request.bad_words,
            "kv_transfer_params": request.kv_transfer_params,
            "output_kind": RequestOutputKind.DELTA,
        }
        for name in UNSET_IS_DEFAULT:  # None: the model's generation_config.json value, if any
            kwargs[name] = getattr(request, name)
        if request.logit_bias:
            try:
                kwargs["logit_bias"] = {
                    int(k): min(max(float(v), -100.0), 100.0) for k, v in request.logit_bias.items()
                }
            except ValueError as exc:
                raise APIError(
                    "logit_bias keys must be token ids (integers).", 400, param="logit_bias"
                ) from exc
        try:
            kwargs["structured_outputs"] = structured_outputs_params(request)
            return self.engine.sampling_params(**kwargs)
        except InvalidRequestError as exc:
            raise self.invalid_request(exc, "prompt") from exc

    # ---- the engine streams -------------------------------------------------------------------------

    async def add_requests(
        self,
        prompts: list[dict[str, Any]],
        params: SamplingParams | PoolingParams,
        prompt_param: str,
        request: Any,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestStream]:
        """One engine request per prompt (a prompt dict, with ``cache_salt`` added), all checked before
        any response starts, each run with ``lora_request`` (None: the base model); a refusal is a 400
        (and closes, so aborts, the requests of this call already added)."""
        streams: list[RequestStream] = []
        salt = {"cache_salt": cache_salt} if cache_salt is not None else {}
        if len(prompts) > 1 and getattr(params, "kv_transfer_params", None) is not None:
            # One response carries one kv_transfer_params: a P/D pair moves one prompt's KV
            raise APIError("kv_transfer_params needs a single prompt.", 400, param=prompt_param)
        try:
            for prompt in prompts:
                streams.append(
                    await self.engine.add_request(random_id(), {**prompt, **salt}, params, lora_request)
                )
        except InvalidRequestError as exc:
            for stream in streams:
                await stream.aclose()
            raise self.invalid_request(exc, prompt_param, request) from exc
        return streams

    async def observed(self, stream: RequestStream, tracker: RequestTracker) -> AsyncIterator[RequestOutput]:
        """The engine's stream for one prompt, observed for metrics; closing it aborts the request.

        A stream the engine ends before its request finished (aborted at shutdown) raises a 503: a
        streamed response ends with that error event, never with a silent [DONE].
        """
        finished = False
        self.stop.active += 1
        try:
            async for output in stream:
                tracker.observe(output)
                finished = output.finished
                yield output
            if not finished:
                raise APIError("The server stopped the request before it finished (shutting down).", 503)
        finally:
            self.stop.active -= 1
            if not finished:
                tracker.abort()
            await stream.aclose()

    async def final_outputs(self, request: Request, streams: list[AsyncIterator[RequestOutput]]) -> list[Any]:
        """Each stream's deltas folded into one whole output; cancelled if the client disconnects."""

        async def collect() -> list[Any]:
            finals: list[RequestOutput | None] = [None] * len(streams)
            async for index, output in merge_async_iterators(*streams):
                final = finals[index]
                if final is None:
                    finals[index] = output
                else:
                    final.add(output)
            if any(final is None for final in finals):  # aborted without an output: the engine shut down
                raise APIError("The engine stopped before the request finished.", 503)
            return finals

        return await run_unless_disconnected(request.receive, collect())

    async def respond(
        self,
        raw_request: Request,
        streams: list[AsyncIterator[RequestOutput]],
        form: ResponseForm,
        stream_options: StreamOptions | None,
    ) -> Response:
        """The response to one generation request: server-sent chunks when ``form.stream``, else one
        JSON body whose choices ``form.choices`` makes from the folded outputs (499 if the client left)."""
        request_id = f"{form.id_prefix}-{random_id()}"
        created = int(time.time())
        headers = {"X-Request-Id": request_id}
        model = form.model or self.model_name
        envelope = {"id": request_id, "object": form.object, "created": created, "model": model}
        if form.stream:
            base = {**envelope, "object": form.chunk_object}
            chunks = self.stream_chunks(
                streams, form.chunk_choice, base, form.num_prompt_tokens, stream_options, form.opening
            )
            return EventStreamResponse(chunks, headers=headers)
        try:
            finals = await self.final_outputs(raw_request, streams)
        except ClientDisconnected:
            return Response(status_code=499)
        usage = usage_dict(
            sum(len(f.prompt_token_ids) for f in finals),
            sum(len(o.token_ids) for f in finals for o in f.outputs),
            sum(f.num_cached_tokens for f in finals),
        )
        body = {**envelope, "choices": form.choices(finals), "usage": usage}
        if finals and finals[0].kv_transfer_params is not None:  # a prefill engine's, for the decode one
            body["kv_transfer_params"] = finals[0].kv_transfer_params
        if form.body_fields is not None:
            body.update(form.body_fields(finals))
        return Response(dumps(body), media_type="application/json", headers=headers)

    async def stream_chunks(
        self,
        streams: list[AsyncIterator[RequestOutput]],
        shape: ChoiceShaper,
        base: dict[str, Any],
        num_prompt_tokens: int,
        options: StreamOptions | None,
        opening: list[dict[str, Any]] | None = None,
    ) -> AsyncIterator[str]:
        """The server-sent events of one response: ``opening`` choices, a chunk per choice delta, the
        usage chunk if asked for, an error event if the engine fails mid-stream, then [DONE]."""
        include_usage = bool(options and options.include_usage)
        continuous = bool(include_usage and options and options.continuous_usage_stats)
        completion_tokens = 0
        cached_tokens = [0] * len(streams)

        def chunk(choices: list[dict[str, Any]]) -> str:
            body: dict[str, Any] = {**base, "choices": choices}
            if continuous:
                body["usage"] = usage_dict(num_prompt_tokens, completion_tokens, sum(cached_tokens))
            return sse(body)

        merged = merge_async_iterators(*streams)
        try:
            for choice in opening or []:
                yield chunk([choice])
            async for p_index, output in merged:
                cached_tokens[p_index] = output.num_cached_tokens
                completion_tokens += sum(len(o.token_ids) for o in output.outputs)
                for delta in output.outputs:
                    if (choice := shape(p_index, output, delta)) is not None:
                        yield chunk([choice])
            if include_usage:
                usage = usage_dict(num_prompt_tokens, completion_tokens, sum(cached_tokens))
                yield sse({**base, "choices": [], "usage": usage})
        except Exception as exc:
            if not isinstance(exc, APIError):
                logger.exception("stream %s failed", base.get("id"))
            yield self.stream_error(exc)
        finally:
            await merged.aclose()  # `async for` leaves it open when this generator is closed mid-stream
        yield SSE_DONE

    # ---- logprobs -----------------------------------------------------------------------------------

    def token_str(self, token_id: int, logprob: Any) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    @staticmethod
    def top_entries(step: dict[int, Any], k: int) -> list[tuple[int, Any]]:
        if k <= 0:
            return []
        ranked = [(tid, lp) for tid, lp in step.items() if lp.rank is not None and lp.rank <= k]
        ranked.sort(key=lambda item: item[1].rank)
        return ranked

    def chat_logprobs(self, token_ids: list[int], steps: list[dict[int, Any]], k: int) -> dict[str, Any]:
        content = []
        for token_id, step in zip(token_ids, steps, strict=False):
            chosen = step.get(token_id)
            token = self.token_str(token_id, chosen)
            top = []
            for tid, lp in self.top_entries(step, k):
                tok = self.token_str(tid, lp)
                top.append(
                    {
                        "token": tok,
                        "logprob": max(lp.logprob, LOGPROB_FLOOR),
                        "bytes": list(tok.encode("utf-8")),
                    }
                )
            content.append(
                {
                    "token": token,
                    "logprob": max(chosen.logprob, LOGPROB_FLOOR) if chosen is not None else LOGPROB_FLOOR,
                    "bytes": list(token.encode("utf-8")),
                    "top_logprobs": top,
                }
            )
        return {"content": content}

    def completion_logprobs(
        self, token_ids: list[int], steps: list[dict[int, Any]] | None, k: int, offset: int
    ) -> tuple[dict[str, Any], int]:
        """OpenAI's legacy logprobs object, and the text offset after the last token.

        ``steps`` None (echoed prompt tokens) gives null logprobs for those tokens.
        """
        result: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for i, token_id in enumerate(token_ids):
            step = steps[i] if steps is not None and i < len(steps) else None
            chosen = step.get(token_id) if step is not None else None
            token = self.token_str(token_id, chosen)
            result["tokens"].append(token)
            result["text_offset"].append(offset)
            offset += len(token)
            if step is None:
                result["token_logprobs"].append(None)
                result["top_logprobs"].append(None)
                continue
            result["token_logprobs"].append(
                max(chosen.logprob, LOGPROB_FLOOR) if chosen is not None else None
            )
            top = {
                self.token_str(tid, lp): max(lp.logprob, LOGPROB_FLOOR)
                for tid, lp in self.top_entries(step, k)
            }
            if chosen is not None:
                top.setdefault(token, max(chosen.logprob, LOGPROB_FLOOR))
            result["top_logprobs"].append(top)
        return result, offset

    @staticmethod
    def prompt_logprobs_json(steps: list[dict[int, Any] | None] | None) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: its Logprob}."""
        if steps is None:
            return None
        return [
            None
            if step is None
            else {
                str(token_id): {
                    "logprob": max(lp.logprob, LOGPROB_FLOOR),
                    "rank": lp.rank,
                    "decoded_token": lp.decoded_token,
                }
                for token_id, lp in step.items()
            }
            for step in steps
        ]

    @staticmethod
    def stream_error(exc: BaseException) -> str:
        """An error event for a stream that already started (its HTTP status is already sent)."""
        if isinstance(exc, APIError):
            return sse(error_body(exc.message, exc.status, exc.param, exc.code))
        return sse(error_body(f"Internal server error ({type(exc).__name__}): {exc}", 500))


def chat_conversation(
    messages: list[ChatCompletionMessageParam],
) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """The messages as the chat template reads them, and their image parts in order of appearance."""
    conversation: list[dict[str, Any]] = []
    images: list[ImageRef] = []
    for index, message in enumerate(messages):
        rendered, refs = _message_dict(message, index)
        conversation.append(rendered)
        images.extend(refs)
    return conversation, images


def _message_dict(message: ChatCompletionMessageParam, index: int) -> tuple[dict[str, Any], list[ImageRef]]:
    """One message for the template. Text parts are joined into one string, as before; a message with
    image parts keeps its parts as a list of ``{"type": "text", "text"}`` and ``{"type": "image"}``, the
    shape multimodal templates (LLaVA's, Qwen2-VL's...) read to place each image's slot."""
    content = message.content
    refs: list[ImageRef] = []
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            param = f"messages[{index}].content[{j}]"
            if part.type == "text" and part.text is not None:
                parts.append({"type": "text", "text": part.text})
            elif part.type == "image_url":
                if part.image_url is None:
                    raise APIError(f"{param}: an image_url part needs image_url.url.", 400, param=param)
                refs.append(ImageRef(part.image_url.url, f"{param}.image_url"))
                parts.append({"type": "image"})
            else:
                raise APIError(
                    f"Unsupported content part type {part.type!r}: only 'text' and 'image_url' parts are "
                    "supported.",
                    400,
                    param=param,
                )
        content = parts if refs else "\n".join(part["text"] for part in parts)
    out: dict[str, Any] = {"role": message.role, "content": content if content is not None else ""}
    for key in ("name", "tool_call_id", "tool_calls"):
        value = getattr(message, key)
        if value is not None:
            out[key] = value
    return out, refs
