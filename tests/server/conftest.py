"""Fixtures of the in-process API tests (pagedserve/testing/api_fakes.py holds the fake engine and
the client helper)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pagedserve.server.sampling_params import SamplingParams

from pagedserve.testing.api_fakes import FakeEngine


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine()
    yield engine
    await engine.shutdown(grace_seconds=0)


@pytest.fixture
def sent(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> list[SamplingParams]:
    """The SamplingParams of every request the server hands the engine. The scripted core follows its
    script whatever the constraint, so the engine gets the request without it (the grammar compiler
    needs a real tokenizer; tests with the embedded model compile and enforce it)."""
    params: list[SamplingParams] = []
    add_request = engine.add_request

    async def recording(request_id: str, prompt: Any, sampling: SamplingParams, lora: Any = None) -> Any:
        params.append(sampling)
        sampling = dataclasses.replace(sampling, structured_outputs=None)
        return await add_request(request_id, prompt, sampling, lora)

    monkeypatch.setattr(engine, "add_request", recording)
    return params
