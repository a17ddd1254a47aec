"""Seeded PEFT adapters of the embedded model (pagedserve/testing/lora.py) and their HF + peft greedy
references, made once per session; the offline engine with LoRA enabled, one per module."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from pagedserve import LLM, LoRARequest, SamplingParams, default_model
from pagedserve.testing.lora import ALL_LINEAR, ATTENTION, QV, make_peft_adapter, peft_greedy

MAX_TOKENS = 8
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
# (name, rank, target modules, seed): several ranks and target sets, q/v alone up to every projection
ADAPTERS = [
    ("qv4", 4, QV, 1),
    ("attn8", 8, ATTENTION, 2),
    ("all16", 16, ALL_LINEAR, 3),
    ("all8", 8, ALL_LINEAR, 4),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@dataclass
class Adapter:
    request: LoRARequest
    expected: list[list[int]]  # HF + peft's greedy tokens per prompt of PROMPTS


@dataclass
class LoRAFixture:
    base_dir: str
    prompt_ids: list[list[int]]
    base_expected: list[list[int]]
    adapters: dict[str, Adapter]


@pytest.fixture(scope="session")
def lora_setup(tmp_path_factory: pytest.TempPathFactory) -> LoRAFixture:
    from transformers import AutoTokenizer

    base_dir = str(default_model())
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    prompt_ids = [list(tokenizer.encode(p)) for p in PROMPTS]
    root = tmp_path_factory.mktemp("adapters")
    adapters = {}
    for index, (name, rank, targets, seed) in enumerate(ADAPTERS, start=1):
        path = make_peft_adapter(base_dir, root / name, rank, targets, seed)
        expected = peft_greedy(base_dir, path, prompt_ids, MAX_TOKENS)
        adapters[name] = Adapter(LoRARequest(name, index, str(path)), expected)
    base_expected = peft_greedy(base_dir, None, prompt_ids, MAX_TOKENS)
    return LoRAFixture(base_dir, prompt_ids, base_expected, adapters)


@pytest.fixture(scope="module")
def lora_llm(lora_setup: LoRAFixture) -> LLM:
    """An engine with two LoRA slots and a CPU cache of three: four adapters must take turns."""
    return LLM(lora_setup.base_dir, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=3)


def token_prompts(setup: LoRAFixture) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": ids} for ids in setup.prompt_ids]


def copy_adapter(source: str | Path, target: Path, **config_changes: object) -> Path:
    """A copy of an adapter folder whose adapter_config.json has ``config_changes``."""
    import json
    import shutil

    shutil.copytree(source, target)
    config_file = target / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(config_changes)
    config_file.write_text(json.dumps(config))
    return target
