"""Fixtures for the benchmark tests: a stand-in OpenAI streaming server and the real engine server."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from bench_helpers import REPO, free_port, standin, stop, wait_http


@pytest.fixture
def standin_server() -> Iterator[str]:
    with standin("--token-delay", "0.002") as (base, _):
        yield base


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`pagedserve serve` with the embedded model, as a subprocess on 127.0.0.1."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("real_server") / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONSAFEPATH": "1"},  # ./operator must not shadow the stdlib module
        )
        base = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_http(base + "/health", proc, 180)
            except (RuntimeError, TimeoutError) as e:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{e}; server log:\n{tail}") from None
            yield base
        finally:
            stop(proc)
