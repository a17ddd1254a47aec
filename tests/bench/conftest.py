"""Fixtures for the benchmark tests: a stand-in OpenAI streaming server and the real engine server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.testing.bench_helpers import standin
from pagedserve.testing.processes import serve_process


@pytest.fixture
def standin_server(tmp_path: Path) -> Iterator[str]:
    with standin(tmp_path / "standin.log", "--token-delay", "0.002") as fake:
        yield fake.url


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`pagedserve serve` with the embedded model, as a subprocess on 127.0.0.1."""
    with serve_process(tmp_path_factory.mktemp("real_server") / "server.log") as server:
        server.wait_ready(180)
        yield server.url
