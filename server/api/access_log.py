"""One structured (key=value) access-log line per HTTP request, written when its response ends.

A pure ASGI middleware, so a streamed response is logged once, after its last chunk, with its full
duration. Probe endpoints (/health, /metrics) log at DEBUG to keep the log readable under Kubernetes.
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("pagedserve.access")
QUIET_PATHS = frozenset({"/health", "/metrics"})


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        request_id = "-"
        sent = 0

        async def logged_send(message: Message) -> None:
            nonlocal status, request_id, sent
            if message["type"] == "http.response.start":
                status = message["status"]
                for name, value in message.get("headers", ()):
                    if name == b"x-request-id":
                        request_id = value.decode("latin-1")
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, logged_send)
        finally:
            path = scope.get("path", "")
            client = scope.get("client")
            logger.log(
                logging.DEBUG if path in QUIET_PATHS else logging.INFO,
                "method=%s path=%s status=%d duration_ms=%.1f bytes_out=%d client=%s request_id=%s",
                scope.get("method", "-"),
                path,
                status,
                (time.perf_counter() - start) * 1000.0,
                sent,
                f"{client[0]}:{client[1]}" if client else "-",
                request_id,
            )
