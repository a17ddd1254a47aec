"""The proxy's own HTTP/1.1 client against raw sockets answering crafted responses."""

from __future__ import annotations

import asyncio

import pytest
from pagedserve.router.upstream import (
    UpstreamConnectError,
    UpstreamDisconnect,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamTimeout,
)

from pagedserve.testing.net import free_port


class RawServer:
    """Answers each request on a connection with the next scripted reply (bytes, or a callable)."""

    def __init__(self, replies) -> None:
        self.replies = list(replies)
        self.requests: list[bytes] = []
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None
        self.tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.tasks.add(asyncio.current_task())
        try:
            while self.replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length) if length else b""
                self.requests.append(head + body)
                reply = self.replies.pop(0)
                if callable(reply):
                    if await reply(writer) == "close":
                        break
                else:
                    writer.write(reply)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n\r\nhello"


async def test_content_length_and_keep_alive_reuse():
    async with RawServer([OK, OK, OK]) as srv:
        pool = UpstreamPool()
        for _ in range(3):
            r = await pool.request(
                srv.url, "POST", "/v1/x?q=1", [(b"authorization", b"Bearer k")], b'{"a":1}'
            )
            assert r.status == 200 and r.header(b"content-type") == b"text/plain"
            assert await r.read() == b"hello"
        assert srv.connections == 1  # one keep-alive connection for all three
        first = srv.requests[0]
        assert first.startswith(b"POST /v1/x?q=1 HTTP/1.1\r\nhost: 127.0.0.1:")
        assert b"authorization: Bearer k\r\n" in first and b"content-length: 7\r\n" in first
        assert first.endswith(b'{"a":1}')
        await pool.aclose()


async def test_chunked_body_arrives_piece_by_piece():
    gate = asyncio.Event()

    async def chunked(writer):
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        writer.write(b"7\r\ndata: 1\r\n")
        await writer.drain()
        await gate.wait()
        writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        await writer.drain()

    async with RawServer([chunked, OK]) as srv:
        pool = UpstreamPool()
        r = await pool.request(srv.url, "GET", "/", [])
        assert await r.next_chunk() == b"data: 1"  # before the server has written the rest
        gate.set()
        assert await r.next_chunk() == b"data: 2"
        assert await r.next_chunk() == b""
        assert r.at_end()
        r2 = await pool.request(srv.url, "GET", "/", [])
        assert await r2.read() == b"hello"
        assert srv.connections == 1


async def test_body_until_close_and_no_body_statuses():
    async def until_close(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()
        return "close"

    async with RawServer([until_close]) as srv:
        pool = UpstreamPool()
        r = await pool.request(srv.url, "GET", "/", [])
        assert await r.read() == b"all of it"
    async with RawServer([b"HTTP/1.1 204 No Content\r\n\r\n", OK]) as srv:
        r = await pool.request(srv.url, "DELETE", "/", [])
        assert r.status == 204 and await r.read() == b""
        assert await (await pool.request(srv.url, "GET", "/", [])).read() == b"hello"
    async with RawServer([b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"]) as srv:
        r = await pool.request(srv.url, "HEAD", "/", [])
        assert r.status == 200 and await r.read() == b""


async def test_errors():
    pool = UpstreamPool(connect_timeout=2)
    with pytest.raises(UpstreamConnectError):
        await pool.request(f"http://127.0.0.1:{free_port()}", "GET", "/", [])
    with pytest.raises(UpstreamConnectError):
        await pool.request("https://example.invalid", "GET", "/", [])

    async def close_at_once(writer):
        return "close"

    async with RawServer([close_at_once]) as srv:
        with pytest.raises(UpstreamDisconnect) as err:
            await pool.request(srv.url, "POST", "/", [], b"{}")
        assert err.value.before_response

    async def half_body(writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        await writer.drain()
        return "close"

    async with RawServer([half_body]) as srv:
        r = await pool.request(srv.url, "GET", "/", [])
        assert await r.next_chunk() == b"only part"
        with pytest.raises(UpstreamDisconnect) as err:
            await r.next_chunk()
        assert not err.value.before_response

    async with RawServer([b"NOT HTTP AT ALL\r\n\r\n"]) as srv:
        with pytest.raises(UpstreamProtocolError):
            await pool.request(srv.url, "GET", "/", [])

    async def silent(writer):
        await asyncio.sleep(5)

    async with RawServer([silent]) as srv:
        with pytest.raises(UpstreamTimeout):
            await pool.request(srv.url, "GET", "/", [], read_timeout=0.2)


async def test_a_stale_pooled_connection_is_replaced_transparently():
    async def ok_then_close(writer):
        writer.write(OK)
        await writer.drain()
        return "close"  # the server drops the idle keep-alive connection

    async with RawServer([ok_then_close, OK]) as srv:
        pool = UpstreamPool()
        r = await pool.request(srv.url, "GET", "/", [])
        assert await r.read() == b"hello"
        await asyncio.sleep(0.1)
        r = await pool.request(srv.url, "GET", "/", [])  # would hit the closed connection first
        assert await r.read() == b"hello"
        assert srv.connections == 2


async def test_unread_response_closes_its_connection_and_backpressure():
    big = b"x" * (3 << 20)

    async def large(writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big))
        writer.write(big)
        await writer.drain()

    async with RawServer([large, OK]) as srv:
        pool = UpstreamPool()
        r = await pool.request(srv.url, "GET", "/", [])
        await asyncio.sleep(0.3)
        assert r._conn.buffered <= (2 << 20)  # reading paused well before the 3 MiB arrived
        got = await r.next_chunk()
        r.close()  # abandoned mid-body: the connection is closed, not reused
        assert got
        r2 = await pool.request(srv.url, "GET", "/", [])
        assert await r2.read() == b"hello"
        assert srv.connections == 2
