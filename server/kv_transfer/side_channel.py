"""The one message a decode engine sends a prefill engine: "I read request R's blocks; free them".

Mooncake's reads need nothing from the prefill side, so without this the prefill engine could only free a
request's blocks when ``hold_seconds`` pass. Newline-delimited JSON over TCP (``{"release": [ids]}``), one
connection per peer kept open, written from a thread so that the decode engine's step never waits on it;
a lost message costs only blocks held until their time is up.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import socketserver
import threading

logger = logging.getLogger("pagedserve.kv_transfer")


class ReleaseListener:
    """The prefill engine's end: collects the request ids its decode engines are done with."""

    def __init__(self, host: str, port: int) -> None:
        released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._released = released

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for line in self.rfile:
                    try:
                        ids = json.loads(line).get("release", [])
                    except (ValueError, AttributeError):
                        logger.warning("side channel: ignored a malformed message from %s",
                                       self.client_address)
                        continue
                    for request_id in ids if isinstance(ids, list) else []:
                        released.put(str(request_id))

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


class ReleaseSender:
    """The decode engine's end: sends each release from a thread, one open connection per peer."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[str, list[str]] | None] = queue.SimpleQueue()
        self._connections: dict[str, socket.socket] = {}
        self._thread = threading.Thread(target=self._run, name="kv-release-sender", daemon=True)
        self._thread.start()

    def send(self, address: str, request_ids: list[str]) -> None:
        self._queue.put((address, request_ids))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            address, request_ids = item
            line = (json.dumps({"release": request_ids}) + "\n").encode()
            for _attempt in range(2):  # a kept connection the peer closed is reopened once
                try:
                    self._connection(address).sendall(line)
                    break
                except OSError:
                    self._drop(address)
            else:
                logger.warning("side channel: could not tell %s to free %d requests' blocks (they are "
                               "freed when their hold time ends)", address, len(request_ids))
        for address in list(self._connections):
            self._drop(address)

    def _connection(self, address: str) -> socket.socket:
        connection = self._connections.get(address)
        if connection is None:
            host, _, port = address.rpartition(":")
            connection = self._connections[address] = socket.create_connection((host, int(port)), timeout=5)
        return connection

    def _drop(self, address: str) -> None:
        connection = self._connections.pop(address, None)
        if connection is not None:
            connection.close()
