"""Work raced against the HTTP client going away: the engine server's non-streamed responses
(server/api/serving_base.py) and the router's forwarding (router/proxy.py) both stop, and so free the
engine's request, the moment their client disconnects. Torch-free and Starlette-free: the router uses it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
Receive = Callable[[], Awaitable[dict[str, Any]]]  # an ASGI receive callable


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns once the client has gone (or the response is complete: then the server reports it too)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (and raising ClientDisconnected) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
