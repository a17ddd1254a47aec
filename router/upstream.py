"""A lean HTTP/1.1 client for the proxy's upstream requests: asyncio protocols + the httptools parser
(the same C parser uvicorn uses), with a keep-alive pool per replica.

Why not httpx: its per-request overhead (anyio, the httpcore pool's scans) costs about a millisecond of
CPU, the router's whole budget at 1,000 requests/s. This client does what the proxy needs and no more:
write one request, hand back status and raw headers, then the body chunk by chunk as it arrives
(chunked transfer decoded, nothing buffered beyond what the socket delivered), with back-pressure.

Errors (all ``UpstreamError``): ``UpstreamConnectError`` (refused, unreachable, connect timeout),
``UpstreamDisconnect`` (the connection closed before the response was complete; ``before_response``
says whether any response byte had arrived), ``UpstreamProtocolError`` (unparseable response),
``UpstreamTimeout`` (read timeout). A pooled keep-alive connection that turns out closed before any
response byte arrives is replaced by a fresh one once, transparently (the replica closed it while idle).
"""

from __future__ import annotations

import asyncio
import collections
import time
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 1 << 20  # pause reading from the replica when this much body is buffered
_LOW_WATER = 1 << 18


class UpstreamError(Exception):
    pass


class UpstreamConnectError(UpstreamError):
    pass


class UpstreamDisconnect(UpstreamError):
    def __init__(self, message: str, before_response: bool) -> None:
        super().__init__(message)
        self.before_response = before_response


class UpstreamProtocolError(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError):
    pass


class _Conn(asyncio.Protocol):
    __slots__ = (
        "_waiter",
        "body",
        "buffered",
        "closed",
        "complete",
        "eof_body",
        "error",
        "head_only",
        "headers",
        "headers_done",
        "keep_alive",
        "key",
        "last_used",
        "parser",
        "paused",
        "received_any",
        "status",
        "transport",
    )

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.last_used = time.monotonic()
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.body: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.eof_body = False
        self.head_only = False
        self.error: UpstreamError | None = None
        self.received_any = False
        self.paused = False
        self._waiter: asyncio.Future | None = None

    # --- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # pragma: no cover - the router never asks for an upgrade
            self._fail(UpstreamProtocolError("unexpected protocol upgrade"))
            self.transport.close()
        except httptools.HttpParserError as exc:
            self._fail(UpstreamProtocolError(f"bad response from the replica: {exc}"))
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.headers_done and self.eof_body and not self.complete:
            self.complete = True  # a body delimited by the end of the connection
            self._wake()
        elif not self.complete:
            self._fail(
                UpstreamDisconnect(
                    "the replica closed the connection" + (f" ({exc})" if exc else ""),
                    before_response=not self.received_any,
                )
            )

    def pause_writing(self) -> None:  # requests are small; nothing to do
        pass

    def resume_writing(self) -> None:
        pass

    # --- httptools callbacks ---------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        if self.head_only or self.status in (204, 304) or 100 <= self.status < 200:
            if 100 <= self.status < 200:  # pragma: no cover - the router drops Expect headers
                self._fail(UpstreamProtocolError("unexpected 1xx response"))
            self.complete = True
            self.keep_alive = self.keep_alive and not self.head_only
        else:
            has_length = False
            for name, value in self.headers:
                lname = name.lower()
                if lname == b"content-length" or (
                    lname == b"transfer-encoding" and b"chunked" in value.lower()
                ):
                    has_length = True
                    break
            self.eof_body = not has_length
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(bytes(body))
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # --- helpers ---------------------------------------------------------------------------------
    def _fail(self, err: UpstreamError) -> None:
        if self.error is None:
            self.error = err
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self, timeout: float | None) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            if timeout is None:
                await self._waiter
            else:
                try:
                    await asyncio.wait_for(self._waiter, timeout)
                except asyncio.TimeoutError:
                    raise UpstreamTimeout(f"no data from the replica for {timeout:.0f} s") from None
        finally:
            self._waiter = None


class UpstreamResponse:
    """Status, raw headers, and the body as it arrives. Call ``close()`` when done (``release`` happens
    automatically once the body has been read to its end)."""

    __slots__ = ("_complete", "_conn", "_done", "_pool", "_read_timeout", "headers", "status")

    def __init__(self, pool: UpstreamPool, conn: _Conn, read_timeout: float | None) -> None:
        self._pool = pool
        self._conn = conn
        self._read_timeout = read_timeout
        self._done = False
        self._complete = False
        self.status = conn.status
        self.headers = conn.headers

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    async def next_chunk(self) -> bytes:
        """The next piece of the body; b"" at its end. Raises ``UpstreamError`` if the replica fails."""
        if self._done:  # the connection may already serve another request
            return b""
        conn = self._conn
        while True:
            if conn.body:
                chunk = conn.body.popleft()
                conn.buffered -= len(chunk)
                if conn.paused and conn.buffered < _LOW_WATER and not conn.closed:
                    conn.paused = False
                    conn.transport.resume_reading()
                if chunk:
                    return chunk
                continue
            if conn.error is not None:
                self._finish(reuse=False)
                raise conn.error
            if conn.complete:
                self._complete = True
                self._finish(reuse=True)
                return b""
            await conn._wait(self._read_timeout)

    def at_end(self) -> bool:
        """True when the whole body has been handed out (nothing buffered, the message complete)."""
        if self._done:
            return self._complete
        conn = self._conn
        return conn.complete and not conn.body and conn.error is None

    async def read(self) -> bytes:
        parts = []
        while True:
            chunk = await self.next_chunk()
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)

    def _finish(self, reuse: bool) -> None:
        if not self._done:
            self._done = True
            self._pool._release(self._conn, reuse and self._conn.complete and not self._conn.body)

    def close(self) -> None:
        """Give the connection back: to the pool if the response was read to its end, else closed (the
        replica sees the client go away and aborts the request)."""
        self._finish(reuse=self._conn.complete and not self._conn.body and self._conn.error is None)


def _split(base_url: str) -> tuple[str, int, bytes]:
    """(host, port, netloc) of an ``http://`` replica URL."""
    parts = urlsplit(base_url)
    if parts.scheme != "http":
        raise UpstreamConnectError(f"only http:// replicas are supported, got {base_url}")
    return parts.hostname or "127.0.0.1", parts.port or 80, parts.netloc.encode()


class UpstreamPool:
    def __init__(
        self,
        connect_timeout: float = 5.0,
        read_timeout: float | None = None,
        max_idle_per_host: int = 200,
        keepalive_expiry: float = 4.0,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle_per_host = max_idle_per_host
        self.keepalive_expiry = keepalive_expiry
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._hostport: dict[str, tuple[str, int, bytes]] = {}

    def _parse(self, base_url: str) -> tuple[str, int, bytes]:
        cached = self._hostport.get(base_url)
        if cached is None:
            cached = self._hostport[base_url] = _split(base_url)
        return cached

    async def _connect(self, host: str, port: int) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn((host, port)), host, port), self.connect_timeout
            )
        except asyncio.TimeoutError:
            raise UpstreamConnectError(f"connect to {host}:{port} timed out") from None
        except OSError as exc:
            raise UpstreamConnectError(f"connect to {host}:{port} failed: {exc}") from None
        return conn

    def _take_idle(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport.is_closing() or now - conn.last_used > self.keepalive_expiry:
                conn.transport.close()
                continue
            return conn
        return None

    def _release(self, conn: _Conn, reuse: bool) -> None:
        if reuse and conn.keep_alive and not conn.closed and not conn.transport.is_closing():
            idle = self._idle.setdefault(conn.key, [])
            if len(idle) < self.max_idle_per_host:
                conn._reset()
                conn.last_used = time.monotonic()
                idle.append(conn)
                return
        conn.closed = True
        if conn.transport is not None:
            conn.transport.close()

    async def request(
        self,
        base_url: str,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes = b"",
        read_timeout: float | None = ...,  # type: ignore[assignment]
    ) -> UpstreamResponse:
        """Send one request; returns once the response's status and headers have arrived."""
        host, port, netloc = self._parse(base_url)
        key = (host, port)
        timeout = self.read_timeout if read_timeout is ... else read_timeout
        parts = [method.encode(), b" ", target.encode("latin-1"), b" HTTP/1.1\r\nhost: ", netloc, b"\r\n"]
        for k, v in headers:
            parts += [k, b": ", v, b"\r\n"]
        if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            parts += [b"content-length: ", str(len(body)).encode(), b"\r\n"]
        parts.append(b"\r\n")
        payload = b"".join(parts) + body

        for attempt in range(2):
            conn = self._take_idle(key) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect(host, port)
            conn.head_only = method == "HEAD"
            conn.transport.write(payload)
            try:
                while not conn.headers_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn._wait(timeout)
            except UpstreamDisconnect as exc:
                self._release(conn, False)
                if reused and exc.before_response:
                    continue  # the replica had closed this idle connection: once more on a fresh one
                raise
            except BaseException:
                self._release(conn, False)
                raise
            return UpstreamResponse(self, conn, timeout)
        raise AssertionError("unreachable")  # pragma: no cover

    def idle_connections(self, base_url: str) -> int:
        """Pooled keep-alive connections to a replica."""
        host, port, _ = _split(base_url)
        return len(self._idle.get((host, port), ()))

    def forget(self, base_url: str) -> None:
        """A replica that left discovery: close its idle connections and drop what is kept for it. (A
        response still in flight returns its connection to the pool when it ends: forget again then.)"""
        self._hostport.pop(base_url, None)
        host, port, _ = _split(base_url)
        for conn in self._idle.pop((host, port), ()):
            conn.closed = True
            if conn.transport is not None:
                conn.transport.close()

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()
