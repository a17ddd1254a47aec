from __future__ import annotations

import pytest

from pagedserve.testing.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> str:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))
