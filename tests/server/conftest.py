"""Fixtures of the in-process API tests (api_fakes.py holds the fake engine and the client helper)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from api_fakes import FakeEngine


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine()
    yield engine
    await engine.shutdown(grace_seconds=0)
