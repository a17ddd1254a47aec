from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> str:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))
