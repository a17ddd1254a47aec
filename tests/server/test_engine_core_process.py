"""The engine core in its own process (server/engine/core_proc.py), on a real `pagedserve serve`: it is
a child of the server, and killing it fails the stream in flight with an error that says so, takes the
server out of service within seconds and ends it with exit code 1 (a supervisor restarts the pod)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from pagedserve.testing.processes import engine_core_pid, serve_process

pytestmark = pytest.mark.slow

OUT_OF_SERVICE_S = 5.0


def test_a_killed_core_fails_the_stream_and_takes_the_server_down(tmp_path: Path) -> None:
    with serve_process(tmp_path / "server.log", "--max-model-len", "1024") as server:
        server.wait_ready(240)
        core = engine_core_pid(server.process.pid)
        body = {"prompt": "Count:", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{server.url}/v1/completions", json=body) as r,
        ):
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            assert json.loads(next(lines)[len("data: "):])["choices"]
            os.kill(core, signal.SIGKILL)
            killed = time.monotonic()
            events = [line[len("data: "):] for line in lines]
            assert events[-1] == "[DONE]"
            assert "engine core process ended" in json.loads(events[-2])["error"]["message"], events[-2]
            while True:  # 503 while it stops, then nothing listens: never 200 again
                try:
                    if http.get(f"{server.url}/health", timeout=1).status_code != 200:
                        break
                except httpx.TransportError:
                    break
                assert time.monotonic() - killed < OUT_OF_SERVICE_S, "still healthy"
        assert server.process.wait(timeout=30) == 1, server.log_tail()
        assert "the engine core process ended (exit code -9)" in server.log_tail()
