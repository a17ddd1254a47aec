"""An ASGI app (the router's RouterApp, the fake OpenAI backend) served by uvicorn on a background
thread of this process, so a test can reach into the app's state while it serves."""

from __future__ import annotations

import threading
import time
from typing import Any


class ServerThread:
    """uvicorn on ``host:port`` (0: a free port, known once started) in a daemon thread, own event loop."""

    def __init__(self, app: Any, port: int = 0, host: str = "127.0.0.1") -> None:
        import uvicorn  # not at module level: importing pagedserve.testing needs no server extras

        self.app = app
        self.host = host
        self._port = port
        self.server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on", access_log=False)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout: float = 10.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"{type(self.app).__name__} did not start on {self.host}:{self._port}")
            time.sleep(0.01)
        self._port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
