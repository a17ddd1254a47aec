"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

The one builder of that shape for the whole stack: the engine server (router/proxy.py too) answers every
failure through here: request validation (FastAPI's 422 becomes a 400, as OpenAI and vLLM answer),
unknown routes and methods, the serving layer's own checks, unexpected exceptions (a 500 whose message
names the exception class, nothing more), and the router's own refusals (no backend, bad gateway).

The builder itself imports nothing heavier than ``json``: the router, which runs in the slim image,
imports it without FastAPI's request machinery; ``install_error_handlers`` brings FastAPI in.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI, Request
    from starlette.responses import JSONResponse

logger = logging.getLogger("pagedserve.api")

# OpenAI's `type` for each status the server sends.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class APIError(Exception):
    """An error to send as an OpenAI error response."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    err_type = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(
    message: str,
    status: int = 400,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(message, status, param, code), status_code=status, headers=headers)


def error_json_bytes(message: str, status: int, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps(error_body(message, status, param, code)).encode()


def _loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    # pydantic names the member of a union it tried ("list[str]", "function-after[...]"): not a field.
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header") and not _is_union_tag(p)]
    return ".".join(parts) or None


def _depth(error: dict[str, Any]) -> int:
    return len([p for p in error.get("loc", ()) if not _is_union_tag(p)])


def _is_union_tag(part: Any) -> bool:
    # "list[str]", "function-after[...]", or a model's name ("TokenizeChatRequest"); fields are snake_case
    return isinstance(part, str) and ("[" in part or "(" in part or part[:1].isupper())


def validation_message(errors: list[dict[str, Any]]) -> str:
    lines = []
    for err in errors[:10]:
        param = _loc_to_param(err.get("loc", ()))
        msg = err.get("msg", "invalid value")
        lines.append(f"{param}: {msg}" if param else msg)
    if len(errors) > 10:
        lines.append(f"... and {len(errors) - 10} more errors")
    return "; ".join(lines)


def install_error_handlers(
    app: FastAPI, unknown_field_message: Callable[[str, str], str] | None = None
) -> None:
    """``unknown_field_message(name, path)``: the 400's message for a field the schema of the request to
    ``path`` does not have."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        if errors and errors[0].get("type") == "json_invalid":
            return error_response(f"Invalid JSON body: {errors[0].get('msg', 'cannot parse')}", 400)
        # With unions, pydantic reports every member it tried: the deepest location is the member that
        # came closest, so its field is the one to name.
        first = (
            max(errors, key=lambda err: (_loc_to_param(err.get("loc", ())) or "").count("."))
            if errors
            else {}
        )
        param = _loc_to_param(first.get("loc", ()))
        if first.get("type") == "extra_forbidden" and unknown_field_message and param:
            message = unknown_field_message(param.rsplit(".", 1)[-1], request.url.path)
            return error_response(message, 400, param=param)
        return error_response(validation_message(errors) or "Invalid request", 400, param=param)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(status).phrase
        if status == 404 and message == "Not Found":
            message = f"Not found: {request.method} {request.url.path}"
        elif status == 405:
            message = f"Method {request.method} not allowed on {request.url.path}"
        return error_response(message, status, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(f"Internal server error ({type(exc).__name__})", 500)
