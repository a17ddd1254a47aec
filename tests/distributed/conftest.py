"""The seeded random Llama checkpoints the tensor-parallel tests split (pagedserve/testing/tiny_models.py):
8 query heads over 2 KV heads (each of 2 ranks holds one) and over 1 (both ranks hold it: replicated)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig

from pagedserve.testing.tiny_models import TINY, tiny_checkpoint


def tiny_llama(folder: Path, num_kv_heads: int) -> Path:
    config = LlamaConfig(**{**TINY, "num_attention_heads": 8, "num_key_value_heads": num_kv_heads})
    config.architectures = ["LlamaForCausalLM"]
    tiny_checkpoint(config, folder, seed=num_kv_heads)
    return folder


@pytest.fixture(scope="session")
def llama_kv2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama-8q-2kv"), 2)


@pytest.fixture(scope="session")
def llama_kv1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama-8q-1kv"), 1)
