"""Fixtures of the engine tests that run the embedded model."""

from __future__ import annotations

import pytest

from pagedserve import LLM, default_model


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(default_model())


@pytest.fixture(scope="module")
def llm(model_path: str) -> LLM:
    """One offline engine per test module, with the default engine arguments."""
    return LLM(model_path)
