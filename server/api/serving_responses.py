"""POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel: OpenAI's Responses API
over the chat pipeline (server/api/responses.py maps the shapes), with a bounded in-memory store for
``previous_response_id`` and streamed events in OpenAI's order and names.

Streamed, a reply is: ``response.created``, ``response.in_progress``; per output item
``response.output_item.added``, its parts and deltas (``response.reasoning_text.delta``,
``response.content_part.added`` + ``response.output_text.delta``, ``response.function_call_arguments.delta``),
their ``.done`` events and ``response.output_item.done``; then ``response.completed`` (or
``response.incomplete`` when max_output_tokens cut it) with the whole Response, the same object
GET /v1/responses/{id} returns.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedserve.common.disconnect import ClientDisconnected
from pagedserve.common.errors import APIError
from pagedserve.common.routing import new_response_id
from pagedserve.server.api.protocol import ChatCompletionRequest
from pagedserve.server.api.responses import (
    ResponsesRequest,
    chat_request_body,
    function_call_item,
    history_items,
    message_item,
    new_id,
    output_items,
    output_text,
    reasoning_item,
    response_object,
    usage_json,
)
from pagedserve.server.api.serving_base import EventStreamResponse, dumps
from pagedserve.server.api.serving_chat import ChatRun, OpenAIServingChat
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

MAX_STORED_RESPONSES = 1024  # the oldest are forgotten first: previous_response_id then gets a 404


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the Response object
    history: list[dict[str, Any]]  # input and output items, for the next turn
    task: asyncio.Task[Any] | None = None  # while it runs: what cancel stops


class ResponseStore:
    """The last MAX_STORED_RESPONSES responses, by id."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self.items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self.items[response_id] = stored
        self.items.move_to_end(response_id)
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        stored = self.items.get(response_id)
        if stored is None:
            raise APIError(f"Response with id '{response_id}' not found.", 404, param=param)
        return stored


@dataclass
class EventWriter:
    """Numbers and writes one stream's events as server-sent events (``event:`` and ``data:`` lines)."""

    sequence: int = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {dumps(event)}\n\n"

    def on(self, kind: str, item: dict[str, Any], output_index: int, **fields: Any) -> str:
        """An event about a part of output item ``item``; text parts are content part 0."""
        where = {} if kind.startswith("response.function_call") else {"content_index": 0}
        return self(kind, item_id=item["id"], output_index=output_index, **where, **fields)


@dataclass
class OpenItems:
    """The output items a stream has opened, in order, and what each has accumulated."""

    items: list[dict[str, Any]] = field(default_factory=list)
    reasoning: int | None = None  # output index of the reasoning item
    message: int | None = None  # output index of the message item
    calls: dict[int, int] = field(default_factory=dict)  # a chat tool call's index -> output index


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, instance: str) -> None:
        self.chat = chat
        self.instance = instance  # in every response id: the router finds the replica that stores it
        self.store = ResponseStore()

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        history = []
        if request.previous_response_id is not None:
            history = self.store.get(request.previous_response_id, "previous_response_id").history
        try:
            chat_request = ChatCompletionRequest.model_validate(chat_request_body(request, history))
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise APIError(f"{where}: {error['msg']}", 400, param=where) from exc
        run = await self.chat.start(chat_request)
        response_id = new_response_id(self.instance)
        if request.stream:
            events = self._events(response_id, request, chat_request, run)
            return EventStreamResponse(events, headers={"X-Request-Id": response_id})
        try:
            (final,) = await self.chat.final_outputs(raw_request, [run.stream])
        except ClientDisconnected:
            return Response(status_code=499)
        (choice,) = self.chat.choices(final, chat_request, run.tool_parser)
        message = choice["message"]
        output = output_items(message)
        body = response_object(
            response_id,
            request,
            run.model,
            output,
            "completed",
            self._usage(final, message.get("reasoning_content"), len(final.outputs[0].token_ids)),
            choice["finish_reason"],
        )
        self._keep(response_id, request, body)
        return Response(dumps(body), media_type="application/json", headers={"X-Request-Id": response_id})

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self.store.get(response_id).body

    def cancel(self, response_id: str) -> dict[str, Any]:
        """Stops a response that is still streaming (its engine request is aborted); a finished one
        cannot be cancelled (OpenAI cancels only background responses, which this server has not)."""
        stored = self.store.get(response_id)
        if stored.task is None or stored.task.done():
            raise APIError(
                f"Response '{response_id}' has finished: only a running response can be cancelled.",
                400,
                param="response_id",
            )
        stored.task.cancel()
        stored.body = {**stored.body, "status": "cancelled"}
        return stored.body

    def _keep(self, response_id: str, request: ResponsesRequest, body: dict[str, Any]) -> None:
        if request.store:
            self.store.put(response_id, StoredResponse(body, history_items(request, body["output"])))

    def _usage(self, final: Any, reasoning: str | None, output_tokens: int) -> dict[str, int]:
        """The Response's usage; reasoning tokens counted by tokenizing the reasoning text again."""
        reasoning_tokens = (
            len(self.chat.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        )
        return usage_json(
            len(final.prompt_token_ids),
            output_tokens,
            final.num_cached_tokens,
            min(reasoning_tokens, output_tokens),
        )

    # ---- streaming ------------------------------------------------------------------------------------

    async def _events(
        self, response_id: str, request: ResponsesRequest, chat_request: ChatCompletionRequest, run: ChatRun
    ) -> AsyncIterator[str]:
        write, opened = EventWriter(), OpenItems()
        created = int(time.time())
        shape = self.chat.chunk_choice(chat_request, run.tool_parser)
        stored = StoredResponse(
            response_object(response_id, request, run.model, [], "in_progress", None, created_at=created), []
        )
        stored.task = asyncio.current_task()
        if request.store:
            self.store.put(response_id, stored)
        yield write("response.created", response=stored.body)
        yield write("response.in_progress", response=stored.body)
        finish_reason, output_tokens, final = None, 0, None
        try:
            async for output in run.stream:
                final = output
                for delta in output.outputs:
                    output_tokens += len(delta.token_ids)
                    choice = shape(0, output, delta)
                    if choice is None:
                        continue
                    for event in self._delta_events(write, opened, choice["delta"]):
                        yield event
                    finish_reason = choice["finish_reason"] or finish_reason
        except asyncio.CancelledError:
            stored.body = {**stored.body, "status": "cancelled"}
            raise
        except APIError as exc:
            yield write("error", code=None, message=exc.message, param=exc.param)
            return
        for event in self._close(write, opened):
            yield event
        reasoning = next((i["content"][0]["text"] for i in opened.items if i["type"] == "reasoning"), None)
        usage = self._usage(final, reasoning, output_tokens) if final is not None else None
        body = response_object(
            response_id,
            request,
            run.model,
            opened.items,
            "completed",
            usage,
            finish_reason,
            created_at=created,
        )
        stored.body, stored.task = body, None
        if request.store:
            stored.history = history_items(request, body["output"])
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        yield write(kind, response=body)

    def _delta_events(self, write: EventWriter, opened: OpenItems, delta: dict[str, Any]) -> list[str]:
        """One chat delta (reasoning, text, tool call fragments) as Responses events."""
        events: list[str] = []
        if reasoning := delta.get("reasoning_content"):
            if opened.reasoning is None:
                opened.reasoning = self._open(write, opened, reasoning_item(new_id("rs"), ""), events)
            item = opened.items[opened.reasoning]
            item["content"][0]["text"] += reasoning
            events.append(write.on("response.reasoning_text.delta", item, opened.reasoning, delta=reasoning))
        if content := delta.get("content"):
            if opened.message is None:
                item = message_item(new_id("msg"), "", status="in_progress")
                opened.message = self._open(write, opened, item, events)
                item["content"] = [output_text("")]
                part = output_text("")
                events.append(write.on("response.content_part.added", item, opened.message, part=part))
            index = opened.message
            item = opened.items[index]
            item["content"][0]["text"] += content
            events.append(write.on("response.output_text.delta", item, index, delta=content, logprobs=[]))
        for call in delta.get("tool_calls") or []:
            if call["index"] not in opened.calls:
                named = {**call, "function": {"name": call["function"]["name"], "arguments": ""}}
                item = function_call_item(new_id("fc"), named, status="in_progress")
                opened.calls[call["index"]] = self._open(write, opened, item, events)
            index = opened.calls[call["index"]]
            if arguments := call.get("function", {}).get("arguments"):
                opened.items[index]["arguments"] += arguments
                events.append(write.on("response.function_call_arguments.delta", opened.items[index], index,
                                       delta=arguments))  # fmt: skip
        return events

    @staticmethod
    def _open(write: EventWriter, opened: OpenItems, item: dict[str, Any], events: list[str]) -> int:
        """Add ``item`` to the output and announce it; its output index."""
        index = len(opened.items)
        opened.items.append(item)
        announced = {**item, "content": []} if "content" in item else dict(item)
        events.append(write("response.output_item.added", output_index=index, item=announced))
        return index

    def _close(self, write: EventWriter, opened: OpenItems) -> list[str]:
        """The .done events of every open item, in output order."""
        events = []
        for index, item in enumerate(opened.items):
            if item["type"] == "reasoning":
                text = item["content"][0]["text"]
                events.append(write.on("response.reasoning_text.done", item, index, text=text))
            elif item["type"] == "message":
                part = item["content"][0]
                text = part["text"]
                events.append(write.on("response.output_text.done", item, index, text=text, logprobs=[]))
                events.append(write.on("response.content_part.done", item, index, part=part))
            else:
                name, arguments = item["name"], item["arguments"]
                kind = "response.function_call_arguments.done"
                events.append(write.on(kind, item, index, name=name, arguments=arguments))
            if item["type"] != "reasoning":
                item["status"] = "completed"
            events.append(write("response.output_item.done", output_index=index, item=item))
        return events
