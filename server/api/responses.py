"""OpenAI's Responses API (POST /v1/responses), as vLLM serves it: its request shape, and how a request
maps onto a chat request and a chat reply onto its output items.

A Responses request is a chat request in another envelope: ``instructions`` become the system message,
``input`` items (and the stored items of ``previous_response_id``) the conversation, ``text.format`` the
response format, flat function ``tools`` the chat's. The chat pipeline (server/api/serving_chat.py) runs
it; server/api/serving_responses.py shapes the reply into output items and stream events.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar, Literal

from pagedserve.common.errors import APIError
from pagedserve.server.api.protocol import JSONSchema, PromptCacheOptions, ReasoningEffort, RequestModel, Text
from pydantic import Field, field_validator

# Fields of OpenAI's Responses request this server does not implement, and why: each one a 400 naming it.
UNSUPPORTED_RESPONSES_FIELDS = {
    "background": "background responses are not supported: send the request and wait, or stream it",
    "background_options": "background responses are not supported",
    "conversation": "conversations are not stored: send previous_response_id",
    "prompt": "stored prompt templates are not supported: send instructions and input",
    "context_management": "context management is not supported",
    "max_tool_calls": "built-in tools are not supported: function tools only",
    "moderation": "no moderation model runs here",
    "image": "image generation is not supported",
    "access_programs": "not supported by this server",
}


class FunctionTool(RequestModel):
    """A Responses function tool: flat, unlike the chat's ``{"type", "function": {...}}``."""

    type: Literal["function"] = "function"
    name: Text = Field(..., min_length=1)
    description: Text | None = None
    parameters: JSONSchema | None = None
    strict: bool | None = None


class NamedFunctionChoice(RequestModel):
    type: Literal["function"] = "function"
    name: Text


class TextFormat(RequestModel):
    """``text.format``: plain text, any JSON object, or JSON valid under a schema (flat, as OpenAI's)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Text | None = None
    schema_: JSONSchema | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextOptions(RequestModel):
    format: TextFormat | None = None


class ReasoningOptions(RequestModel):
    """``effort`` reaches the chat template as chat's ``reasoning_effort`` does; no summary is made."""

    effort: ReasoningEffort | None = None
    summary: None = None


class ResponsesRequest(RequestModel):
    """POST /v1/responses."""

    refused_fields: ClassVar[dict[str, str]] = UNSUPPORTED_RESPONSES_FIELDS

    model: Text | None = None
    input: Text | list[dict[str, Any]] = Field(..., description="a user message, or a list of input items")
    instructions: Text | None = None
    previous_response_id: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    stream: bool = False
    store: bool = Field(True, description="kept in this server's bounded memory, for previous_response_id")
    include: list[Text] | None = Field(None, description="only empty: no extra output data is reported yet")
    truncation: Literal["disabled"] | None = None
    top_logprobs: Literal[0] | None = None
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Literal["in_memory"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    service_tier: Literal["auto", "default"] | None = None
    stream_options: dict[str, Any] | None = None


    @field_validator("include")
    @classmethod
    def _nothing_included(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise ValueError(f"{', '.join(value)}: not supported (no extra output data is reported yet)")
        return value


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- request -> chat ------------------------------------------------------------------------------------


def conversation_of(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages from Responses items: messages as they are, function calls as an assistant message's
    ``tool_calls`` (consecutive calls share one), their outputs as ``tool`` messages; reasoning dropped."""
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad_item(index, f"role must be user, system, developer or assistant, got {role!r}")
            messages.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _text_of(item.get("content"), index),
                }
            )
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text_of(output, index)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind == "reasoning":
            continue  # the model's own past thoughts: templates leave them out of the next turn
        else:
            raise _bad_item(index, f"items of type {kind!r} are not supported")
    return messages


def _text_of(content: Any, index: int) -> str | list[dict[str, Any]]:
    """A message item's content as chat content: its text parts joined, or, when it has
    ``input_image`` parts, the chat parts (``text`` and ``image_url``) in order."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad_item(index, "content must be a string or a list of text parts")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind == "input_image":
            raise _bad_item(index, "input_image parts need an image_url (file_id is not supported)")
        else:
            raise _bad_item(index, f"content parts of type {kind!r} are not supported: text and images only")
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def _bad_item(index: int, message: str) -> APIError:
    return APIError(f"input[{index}]: {message}", 400, param=f"input[{index}]")


def chat_request_body(request: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request that runs ``request``; ``history``: the items of its previous responses."""
    items = [{"role": "user", "content": request.input}] if isinstance(request.input, str) else request.input
    messages = conversation_of(history + items)
    if request.instructions:
        messages.insert(0, {"role": "system", "content": request.instructions})
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "stream": request.stream,
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "parallel_tool_calls": request.parallel_tool_calls,
        "reasoning_effort": request.reasoning.effort if request.reasoning is not None else None,
    }
    if request.tools:
        body["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in request.tools
        ]
    choice = request.tool_choice
    if isinstance(choice, NamedFunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif text_format is not None and text_format.type == "json_schema":
        schema = {
            "name": text_format.name or "response",
            "schema": text_format.schema_,
            "strict": text_format.strict,
        }
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    return {key: value for key, value in body.items() if value is not None}


# ---- chat reply -> output items ---------------------------------------------------------------------------


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [output_text(text)] if status == "completed" else [],
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def function_call_item(item_id: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    function = call["function"]
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function.get("arguments") or "",
        "status": status,
    }


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat reply's message (content, tool_calls, reasoning_content) as Responses output items."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"]))
    items += [function_call_item(new_id("fc"), call) for call in message.get("tool_calls") or []]
    return items


def response_object(
    response_id: str,
    request: ResponsesRequest,
    model: str,
    output: list[dict[str, Any]],
    status: str,
    usage: dict[str, int] | None,
    finish_reason: str | None = None,
    created_at: int | None = None,
) -> dict[str, Any]:
    """The Response object, as OpenAI's (``openai.types.responses.Response`` validates it)."""
    text_format = request.text.format if request.text is not None and request.text.format else None
    incomplete = status == "incomplete" or (status == "completed" and finish_reason == "length")
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at if created_at is not None else int(time.time()),
        "status": "incomplete" if incomplete else status,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": model,
        "output": output,
        "instructions": request.instructions,
        "previous_response_id": request.previous_response_id,
        "max_output_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tools": [
            {**tool.model_dump(exclude_none=True), "strict": bool(tool.strict)}
            for tool in request.tools or []
        ],
        "tool_choice": _tool_choice_json(request.tool_choice),
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "text": {
            "format": text_format.model_dump(by_alias=True, exclude_none=True)
            if text_format
            else {"type": "text"}
        },
        "truncation": "disabled",
        "store": request.store,
        "metadata": request.metadata or {},
        "usage": usage,
    }


def _tool_choice_json(choice: Any) -> Any:
    if choice is None:
        return "auto"
    return choice.model_dump() if isinstance(choice, NamedFunctionChoice) else choice


def usage_json(prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def history_items(request: ResponsesRequest, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a later request's previous_response_id continues from: this request's input and its output
    (instructions stay with their request, as at OpenAI)."""
    items = [{"role": "user", "content": request.input}] if isinstance(request.input, str) else request.input
    return [*items, *(json.loads(json.dumps(item)) for item in output)]
