"""POST /v1/chat/completions: the tokenizer's chat template, one engine request, JSON or SSE chunks."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagedserve.common.errors import APIError
from pagedserve.server.api.media import ImageLoader
from pagedserve.server.api.protocol import ChatCompletionRequest, tool_choice_of
from pagedserve.server.api.reasoning_parsers import REASONING_PARSERS
from pagedserve.server.api.reasoning_parsers.base import ReasoningParser
from pagedserve.server.api.reasoning_parsers.stream import ReasoningStream
from pagedserve.server.api.serving_base import (
    ChoiceShaper,
    OpenAIServing,
    ResponseForm,
    chat_conversation,
)
from pagedserve.server.api.tool_parsers import TOOL_PARSERS
from pagedserve.server.api.tool_parsers.base import ToolParser
from pagedserve.server.api.tool_parsers.forced import NamedToolParser, RequiredToolParser
from pagedserve.server.api.tool_parsers.stream import ToolCallStream, whole_reply
from pagedserve.server.exceptions import InvalidRequestError
from pagedserve.server.outputs import CompletionOutput, RequestOutput
from pagedserve.server.sampling_params import ThinkGate
from starlette.requests import Request
from starlette.responses import Response

ROLE = "assistant"
logger = logging.getLogger(__name__)


@dataclass
class ChatRun:
    """A chat request under way: its engine stream (observed for metrics) and what reads its reply."""

    stream: AsyncIterator[RequestOutput]
    tool_parser: ToolParser | None
    num_prompt_tokens: int
    model: str  # the response's model name (a LoRA adapter's, or the base model's)


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        *args: Any,
        tool_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
        reasoning_parser: str | None = None,
        images: ImageLoader,
    ) -> None:
        super().__init__(*args)
        self.images = images
        # vLLM's rule: "auto" reads calls out of free text, so it needs both flags (server/api/cli.py).
        self.auto_tool_parser = (
            TOOL_PARSERS[tool_parser]() if enable_auto_tool_choice and tool_parser else None
        )
        self.reasoning_parser = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
        self.think_gate = think_gate(self.engine.tokenizer, self.reasoning_parser)

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        run = await self.start(request)
        # As OpenAI streams: content "" opens a text reply, null one that may be tool calls (the stream
        # helpers then leave content null when only calls follow).
        content = "" if run.tool_parser is None else None
        opening = [
            {"index": i, "delta": {"role": ROLE, "content": content}, "logprobs": None, "finish_reason": None}
            for i in range(request.n)
        ]
        form = ResponseForm(
            id_prefix="chatcmpl",
            object="chat.completion",
            chunk_object="chat.completion.chunk",
            stream=request.stream,
            num_prompt_tokens=run.num_prompt_tokens,
            chunk_choice=self.chunk_choice(request, run.tool_parser),
            choices=lambda finals: self.choices(finals[0], request, run.tool_parser),
            opening=opening,
            body_fields=self._prompt_logprobs if request.prompt_logprobs is not None else None,
            model=run.model,
        )
        return await self.respond(raw_request, [run.stream], form, request.stream_options)

    async def start(self, request: ChatCompletionRequest) -> ChatRun:
        """The request checked, templated, tokenized and added to the engine: its observed stream and
        what reads its reply. The chat and the Responses API (server/api/serving_responses.py) share it."""
        lora = self.check_model(request.model)
        self.check_request(request)
        if request.top_logprobs and not request.logprobs:
            raise APIError("top_logprobs needs logprobs set to true.", 400, param="top_logprobs")
        tool_parser = self._tool_parser(request)

        conversation, image_refs = chat_conversation(request.messages)
        if image_refs and request.truncate_prompt_tokens is not None:
            raise APIError(
                "truncate_prompt_tokens cannot be used with image parts: cutting the prompt could cut an "
                "image's tokens.",
                400,
                param="truncate_prompt_tokens",
            )
        prompt_text = await self.apply_chat_template(request, conversation)
        prompt: dict[str, Any]
        if image_refs:
            # vLLM's multimodal prompt: the engine's processor tokenizes the text with the images
            # (each image's slot expanded to its tokens) and checks --limit-mm-per-prompt.
            images = await self.images.load(image_refs)
            # The rendered template holds its special tokens already (BOS): the text is tokenized as a
            # text chat's is, without adding them again.
            prompt = {"prompt": prompt_text, "multi_modal_data": {"image": images},
                      "add_special_tokens": request.add_special_tokens}
        else:
            prompt_ids = await self.tokenize(
                prompt_text, request.add_special_tokens, request.truncate_prompt_tokens
            )
            prompt = {"prompt": prompt_text, "prompt_token_ids": prompt_ids}
        requested = (
            request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        )
        top_logprobs = request.top_logprobs or 0
        params = self.sampling_params(request, requested, top_logprobs if request.logprobs else None)
        if params.structured_outputs is not None and self.think_gate is not None:
            # vLLM's order: the model reasons freely, the constraint holds for its answer.
            constraint = dataclasses.replace(params.structured_outputs, think_gate=self.think_gate)
            params.structured_outputs = constraint
        if tool_parser is not None and tool_parser.keeps_special_tokens:
            params.skip_special_tokens = False  # the parser reads the call markers
        (engine_stream,) = await self.add_requests([prompt], params, "messages", request, lora,
                                                   request.cache_salt)
        self.metrics.image_inputs.inc(len(image_refs))
        num_prompt_tokens = len(engine_stream.prompt_token_ids)  # with images: as the engine expanded them
        tracker = self.metrics.track(num_prompt_tokens, engine_stream.max_tokens, request.n)
        stream = self.observed(engine_stream, tracker)
        return ChatRun(stream, tool_parser, num_prompt_tokens, self.response_model(lora))

    def _tool_parser(self, request: ChatCompletionRequest) -> ToolParser | None:
        """What reads the calls out of the reply: none without tools or with "none"; the server's parser
        for "auto"; the forced forms' readers for "required" and a named function."""
        try:
            choice = tool_choice_of(request)
        except InvalidRequestError as exc:
            raise self.invalid_request(exc, "messages") from exc
        if choice == "none":
            return None
        if choice == "auto":
            if self.auto_tool_parser is None:
                raise APIError(
                    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                    '(OpenAI\'s default with tools is "auto"; send tool_choice "none", "required" or a '
                    "named function otherwise)",
                    400,
                    param="tool_choice" if request.tool_choice is not None else "tools",
                )
            return self.auto_tool_parser
        if choice == "required":
            return RequiredToolParser()
        return NamedToolParser(choice.function.name)

    def choices(
        self, final: RequestOutput, request: ChatCompletionRequest, tool_parser: ToolParser | None
    ) -> list[dict[str, Any]]:
        choices = []
        for out in final.outputs:
            logprobs = None
            if request.logprobs and out.logprobs is not None:
                logprobs = self.chat_logprobs(out.token_ids, out.logprobs, request.top_logprobs or 0)
            reasoning, content = None, out.text
            if self.reasoning_parser is not None:
                reasoning, content = self.reasoning_parser.split(out.text)
            tool_calls: list[dict[str, Any]] = []
            if tool_parser is not None and content is not None:
                content, tool_calls = whole_reply(tool_parser, content, _max_calls(request))
            message = {"role": ROLE, "content": content, "tool_calls": tool_calls}
            if self.reasoning_parser is not None:
                message["reasoning_content"] = reasoning if request.include_reasoning else None
            choices.append(
                {
                    "index": out.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": _finish_reason(out.finish_reason, bool(tool_calls)),
                    "stop_reason": out.stop_reason,
                }
            )
        return choices

    def _prompt_logprobs(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """vLLM puts a chat response's prompt_logprobs beside its choices."""
        return {"prompt_logprobs": self.prompt_logprobs_json(finals[0].prompt_logprobs)}

    def chunk_choice(self, request: ChatCompletionRequest, tool_parser: ToolParser | None) -> ChoiceShaper:
        """A chat chunk's choice: the delta's text as `delta.content` (or, read by the tool parser, as
        content and `delta.tool_calls`), with its tokens' logprobs."""
        top_logprobs = request.top_logprobs or 0
        calls: dict[int, ToolCallStream] = {}  # per choice
        thoughts: dict[int, ReasoningStream] = {}  # per choice

        def shape(p_index: int, output: RequestOutput, delta: CompletionOutput) -> dict[str, Any] | None:
            logprobs = None
            if request.logprobs and delta.logprobs is not None:
                logprobs = self.chat_logprobs(delta.token_ids, delta.logprobs, top_logprobs)
            finished = delta.finish_reason is not None
            message: dict[str, Any] = {"content": delta.text}
            text, held = delta.text, False
            if self.reasoning_parser is not None:
                thought = thoughts.setdefault(delta.index, ReasoningStream(self.reasoning_parser))
                reasoning, text = thought.feed(delta.text, finished)
                message = {"content": text} if text else {}
                if reasoning and request.include_reasoning:
                    message["reasoning_content"] = reasoning
                held = not message
            called = False
            if tool_parser is not None:
                stream = calls.setdefault(delta.index, ToolCallStream(tool_parser, _max_calls(request)))
                reasoning_part = {k: v for k, v in message.items() if k == "reasoning_content"}
                message = {**reasoning_part, **stream.feed(text, finished)}
                called = stream.called
                held = not message
            if held and not finished and logprobs is None:
                return None  # text held back until a parser knows what it is
            return {
                "index": delta.index,
                "delta": message,
                "logprobs": logprobs,
                "finish_reason": _finish_reason(delta.finish_reason, called),
                "stop_reason": delta.stop_reason,
            }

        return shape


def think_gate(tokenizer: Any, parser: ReasoningParser | None) -> ThinkGate | None:
    """The parser's tags as the engine sees them, where each is one token (as in Qwen3's and DeepSeek-R1's
    vocabularies); else None, and a grammar constrains the whole reply."""
    if parser is None:
        return None
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (parser.start, parser.end)]
    if any(len(tag_ids) != 1 for tag_ids in ids):
        logger.warning("the %s think tags are not single tokens of this tokenizer: structured outputs will "
                       "constrain whole replies, reasoning included", parser.name)
        return None
    return ThinkGate(ids[0][0], ids[1][0], parser.thinks_from_start)


def _max_calls(request: ChatCompletionRequest) -> int | None:
    return 1 if request.parallel_tool_calls is False else None


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended by calling; "length" stays "length"."""
    return "tool_calls" if called and reason == "stop" else reason
