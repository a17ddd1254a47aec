"""Fixtures of the e2e tests (local processes and images alike)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagedserve.testing.processes import ManagedProcess


@pytest.fixture
def processes() -> Iterator[list[ManagedProcess]]:
    """The processes a test starts, stopped in reverse order at its end."""
    started: list[ManagedProcess] = []
    yield started
    for proc in reversed(started):
        proc.stop()
