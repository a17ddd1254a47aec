"""The seeded random checkpoints the tensor- and pipeline-parallel tests split
(pagedserve/testing/tiny_models.py): Llama with 8 query heads over 2 KV heads (each of 2 ranks holds one)
and over 1 (both ranks hold it: replicated); the same with 5 layers, which 2 stages split unevenly
(3 + 2); Phi-3, whose checkpoint ships q/k/v and gate/up fused."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig, Phi3Config

from pagedserve.testing.tiny_models import TINY, tiny_checkpoint


def tiny_llama(folder: Path, num_kv_heads: int, num_layers: int = TINY["num_hidden_layers"]) -> Path:
    config = LlamaConfig(**{**TINY, "num_attention_heads": 8, "num_key_value_heads": num_kv_heads,
                            "num_hidden_layers": num_layers})
    config.architectures = ["LlamaForCausalLM"]
    tiny_checkpoint(config, folder, seed=num_kv_heads)
    return folder


@pytest.fixture(scope="session")
def llama_kv2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama-8q-2kv"), 2)


@pytest.fixture(scope="session")
def llama_5_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama-5-layers"), 2, num_layers=5)


@pytest.fixture(scope="session")
def llama_kv1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama-8q-1kv"), 1)


@pytest.fixture(scope="session")
def phi3_fused(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = Phi3Config(**{**TINY, "num_attention_heads": 8, "num_key_value_heads": 2, "pad_token_id": 0})
    config.architectures = ["Phi3ForCausalLM"]
    folder = tmp_path_factory.mktemp("phi3-fused")
    tiny_checkpoint(config, folder, seed=3)
    return folder
