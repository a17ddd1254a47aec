"""Fixtures of the engine tests: the embedded model's offline engine (``llm``, one per module unless a
module defines its own) and the server in front of it (``served_engine``, ``client``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import httpx
import pytest

from pagedserve import LLM, default_model

if TYPE_CHECKING:
    from pagedserve.server.engine.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(default_model())


@pytest.fixture(scope="module")
def llm(model_path: str) -> LLM:
    """One offline engine per test module, with the default engine arguments."""
    return LLM(model_path)


@pytest.fixture
async def served_engine(llm: LLM) -> AsyncIterator[AsyncEngine]:
    """The server's engine over the module's LLM core, started. Both step the same core, so a test
    that uses this must not run the LLM while a request is in flight."""
    from pagedserve.server.engine.async_engine import AsyncEngine

    engine = AsyncEngine(llm.engine.core, llm.engine.tokenizer, llm.engine.processor)
    await engine.start()
    yield engine
    await engine.shutdown(grace_seconds=0)


@pytest.fixture
async def client(served_engine: AsyncEngine) -> AsyncIterator[httpx.AsyncClient]:
    """The OpenAI server app over ``served_engine``, in process."""
    from pagedserve.server.api.app import ServerSettings, build_app

    app = build_app(served_engine, ServerSettings(access_log=False))  # httpx's transport runs no lifespan
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c
