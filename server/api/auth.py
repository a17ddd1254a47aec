"""Bearer-token authentication on every route that runs the model or a chat template.

Only the probes and the API's description stay open: /health, /metrics, /version and the OpenAPI
document with its viewers. /tokenize and /detokenize need the key too (vLLM leaves them open,
but /tokenize renders chat templates: one request can keep a worker busy for the render's time bound).
An unknown path needs the key as well, so a client without it learns nothing of the routes.

A pure ASGI middleware: it adds no task and no buffering to streamed responses.
"""

from __future__ import annotations

import hmac

from pagedserve.common.errors import error_json_bytes
from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset(
    {"/health", "/metrics", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
)


def requires_auth(path: str) -> bool:
    return path not in OPEN_PATHS


def bearer_token(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer":
                return token.strip()
            return None
    return None


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]

    def is_authorized(self, token: bytes | None) -> bool:
        if token is None:
            return False
        ok = False
        for key in self.api_keys:  # every key compared, each in constant time
            ok |= hmac.compare_digest(token, key)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") == "OPTIONS"
            or not requires_auth(scope["path"])
            or self.is_authorized(bearer_token(scope))
        ):
            await self.app(scope, receive, send)
            return
        body = error_json_bytes(
            "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'.",
            401,
            code="invalid_api_key",
        )
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
