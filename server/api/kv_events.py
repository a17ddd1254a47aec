"""``GET /v1/kv_events``: the engine's KV cache events as newline-delimited JSON (the format is in
server/core/kv_events.py). Behind the same bearer auth as the other /v1 routes (server/api/auth.py),
on the engine's own port, so it reaches the router through the engines' Service.

404 when the engine runs without ``--enable-kv-events``; 503 when it has as many subscribers as it
serves. The stream ends when the subscriber falls too far behind (it reconnects: a new snapshot) and
when the server drains.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pagedserve.common.errors import error_response
from pagedserve.server.api.protocol import ErrorResponse
from starlette.responses import Response, StreamingResponse

NDJSON = "application/x-ndjson"

router = APIRouter()


@router.get(
    "/v1/kv_events",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "A JSON batch of KV events a line, the first a snapshot; empty lines: heartbeats",
            "content": {NDJSON: {"schema": {"type": "string"}}},
        },
        404: {"model": ErrorResponse, "description": "KV events are off (--enable-kv-events)"},
        503: {"model": ErrorResponse, "description": "Too many subscribers, or the server is shutting down"},
    },
)
async def kv_events(raw_request: Request) -> Response:
    publisher = raw_request.app.state.engine.kv_events
    if publisher is None:
        return error_response("KV events are off: start the engine with --enable-kv-events.", 404)
    if raw_request.app.state.graceful_stop.draining:
        return error_response("The server is shutting down.", 503)
    try:
        sub = publisher.subscribe()
    except RuntimeError as exc:
        return error_response(str(exc), 503)
    return StreamingResponse(publisher.lines(sub), media_type=NDJSON)
