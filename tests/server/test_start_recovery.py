"""A server killed while it converts the embedded model, then started again (pagedserve/cache.py,
server/loader/default_model.py): the new start finds what the dead one left, says so, and serves within
60 s; a second server started beside it while it converts waits for that conversion instead of doing
its own, and serves too."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from pagedserve.testing.processes import serve_process

pytestmark = pytest.mark.slow


def fresh_cache_server(log: Path, cache: Path):
    env = {**os.environ, "PAGEDSERVE_CACHE": str(cache)}
    return serve_process(log, "--max-model-len", "256", env=env)


def wait_for_conversion(cache: Path, server, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not list((cache / "models").glob(".SmolLM2-135M-Instruct.tmp-*")):
        server.check_alive()
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.05)


@pytest.mark.heavy  # ~32 s: a real server start, killed mid-conversion, and another
def test_a_server_killed_while_converting_leaves_nothing_that_stops_the_next(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = fresh_cache_server(tmp_path / "first.log", cache).start()
    try:
        wait_for_conversion(cache, first)
        time.sleep(1.0)
    finally:
        first.kill()
    began = time.monotonic()
    with fresh_cache_server(tmp_path / "second.log", cache) as second:
        second.wait_ready(60)
        took = time.monotonic() - began
        log = second.log_text()
        assert "left by a conversion that did not finish" in log, second.log_tail()
        assert took < 60
        models = httpx.get(f"{second.url}/v1/models", timeout=30).json()
        assert [model["id"] for model in models["data"]] == ["SmolLM2-135M-Instruct"]
    assert not list((cache / "models").glob(".SmolLM2-135M-Instruct.tmp-*"))


@pytest.mark.heavy
def test_a_server_started_beside_a_converting_one_waits_for_it(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with fresh_cache_server(tmp_path / "first.log", cache) as first:
        wait_for_conversion(cache, first)
        with fresh_cache_server(tmp_path / "second.log", cache) as second:
            first.wait_ready(120)
            second.wait_ready(120)
            assert "Converting" in first.log_text() and "Converting" not in second.log_text()
