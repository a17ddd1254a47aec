"""The two messages a decode engine sends a prefill engine about a request's held blocks, over TCP as
newline-delimited JSON:

* ``{"acquire": id}``, answered ``{"held": true|false}``: before reading, so that blocks the prefill engine
  has freed (their hold time ended) and maybe reused are never read; an acquired request's blocks stay
  held until released, whatever their hold time.
* ``{"release": [ids]}``, unanswered: the reads are done (or failed); free the blocks.

Mooncake's reads need nothing from the prefill side, so without these the prefill engine could only free
blocks when their hold time ends, and a late reader could read reused blocks. Releases are written from a
thread, one connection per peer kept open, so that the decode engine's step never waits on them; a lost
release costs only blocks held until their time is up.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import socketserver
import threading
from collections.abc import Callable

logger = logging.getLogger("pagedserve.kv_transfer")
ACQUIRE_TIMEOUT_S = 5.0


class ReleaseListener:
    """The prefill engine's end: answers acquires with ``acquire(id)`` and collects released ids."""

    def __init__(self, host: str, port: int, acquire: Callable[[str], bool]) -> None:
        released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._released = released

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for line in self.rfile:
                    try:
                        message = json.loads(line)
                        if "acquire" in message:
                            reply = {"held": acquire(str(message["acquire"]))}
                            self.wfile.write((json.dumps(reply) + "\n").encode())
                        for request_id in message.get("release", []):
                            released.put(str(request_id))
                    except (ValueError, AttributeError, TypeError):
                        logger.warning("side channel: ignored a malformed message from %s",
                                       self.client_address)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.address = f"{host}:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="kv-side-channel", daemon=True).start()

    def take(self) -> list[str]:
        """The ids released since the last call."""
        ids = []
        while True:
            try:
                ids.append(self._released.get_nowait())
            except queue.Empty:
                return ids

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class Connections:
    """One kept connection per peer ("host:port"), reopened once when the peer closed it."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[socket.socket, object]] = {}

    def exchange(self, address: str, message: dict, answered: bool) -> dict | None:
        line = (json.dumps(message) + "\n").encode()
        for attempt in range(2):
            try:
                connection, reader = self._connection(address)
                connection.sendall(line)
                if not answered:
                    return None
                reply = reader.readline()  # type: ignore[attr-defined]
                if not reply:
                    raise ConnectionError("closed")
                return json.loads(reply)
            except (OSError, ValueError):
                self.drop(address)
                if attempt:
                    raise
        return None

    def _connection(self, address: str) -> tuple[socket.socket, object]:
        if address not in self._open:
            host, _, port = address.rpartition(":")
            connection = socket.create_connection((host, int(port)), timeout=ACQUIRE_TIMEOUT_S)
            self._open[address] = (connection, connection.makefile("rb"))
        return self._open[address]

    def drop(self, address: str) -> None:
        if (entry := self._open.pop(address, None)) is not None:
            entry[0].close()

    def close(self) -> None:
        for address in list(self._open):
            self.drop(address)


class ReleaseSender:
    """The decode engine's end: ``acquire`` on the caller's thread, releases from a thread of their own."""

    def __init__(self) -> None:
        self._acquiring = Connections()  # the engine core's thread only
        self._queue: queue.SimpleQueue[tuple[str, list[str]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-release-sender", daemon=True)
        self._thread.start()

    def acquire(self, address: str, request_id: str) -> bool:
        """Whether the prefill engine still holds the request's blocks (and now keeps them until released);
        False when it does not, or cannot be asked."""
        try:
            reply = self._acquiring.exchange(address, {"acquire": request_id}, answered=True)
        except (OSError, ValueError) as exc:
            logger.warning("side channel: could not reach %s (%s)", address, exc)
            return False
        return bool(reply and reply.get("held"))

    def send(self, address: str, request_ids: list[str]) -> None:
        self._queue.put((address, request_ids))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._acquiring.close()

    def _run(self) -> None:
        releasing = Connections()
        while (item := self._queue.get()) is not None:
            address, request_ids = item
            try:
                releasing.exchange(address, {"release": request_ids}, answered=False)
            except OSError:
                logger.warning("side channel: could not tell %s to free %d requests' blocks (they are "
                               "freed when their hold time ends)", address, len(request_ids))
        releasing.close()
