"""generation_config.json's sampling values as request defaults, as vLLM's ``--generation-config``
(server/loader/generation_config.py; issue 14 item 4)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import pytest
from pagedserve.server.api import cli
from pagedserve.server.config import EngineConfig
from pagedserve.server.loader import sampling_defaults

from pagedserve import LLM, SamplingParams

PROMPT = "The capital of France is"
# top_k 1 makes the model's default sampling greedy, so the defaults show in the output itself.
RECOMMENDED = {"do_sample": True, "temperature": 0.7, "top_k": 1, "top_p": 0.9, "max_new_tokens": 5}


def model_folder(target: Path, source: Path, generation_config: dict) -> Path:
    """The embedded model's files, linked, with our own generation_config.json."""
    target.mkdir()
    for path in source.iterdir():
        if path.name != "generation_config.json" and not path.name.startswith("."):
            (target / path.name).symlink_to(path)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **generation_config}))
    return target


@pytest.fixture(scope="module")
def recommending_model(tmp_path_factory: pytest.TempPathFactory, default_model_path: str) -> Path:
    return model_folder(tmp_path_factory.mktemp("models") / "recommending", Path(default_model_path),
                        RECOMMENDED)


@pytest.fixture(scope="module")
def llm(recommending_model: Path) -> LLM:
    return LLM(str(recommending_model), max_model_len=256)


@pytest.fixture(scope="module")
def greedy_tokens(llm: LLM) -> list[int]:
    (out,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12))
    return out.outputs[0].token_ids


def test_sampling_defaults_read_as_vllm_does(recommending_model: Path, default_model_path: str,
                                             tmp_path: Path) -> None:
    expected = {"temperature": 0.7, "top_k": 1, "top_p": 0.9, "max_tokens": 5}
    assert sampling_defaults(recommending_model, "auto") == expected
    assert sampling_defaults(recommending_model, "vllm") == {}
    assert sampling_defaults(Path(default_model_path), str(recommending_model)) == expected
    # The embedded model recommends nothing: the greedy parity tests run on the neutral defaults.
    assert sampling_defaults(Path(default_model_path), "auto") == {}
    broken = model_folder(tmp_path / "broken", Path(default_model_path), {"top_p": 0.0})
    with pytest.raises(ValueError, match=r"generation_config\.json"):
        sampling_defaults(broken)


def test_generation_config_setting_is_checked_and_reaches_the_engine(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="generation_config"):
        EngineConfig(generation_config=str(tmp_path))  # no generation_config.json there
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.engine_config(parser.parse_args([])).generation_config == "auto"
    assert cli.engine_config(parser.parse_args(["--generation-config", "vllm"])).generation_config == "vllm"


def test_offline_defaults_when_no_sampling_params(llm: LLM, greedy_tokens: list[int]) -> None:
    (out,) = llm.generate(PROMPT)
    assert out.outputs[0].token_ids == greedy_tokens[:5]
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.7, 1, 0.9)
    # A caller's own SamplingParams are its own (vLLM), except max_tokens=None: the model's default.
    (own,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
    assert own.outputs[0].token_ids == greedy_tokens[:8]
    (unset,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=None))
    assert unset.outputs[0].token_ids == greedy_tokens[:5]


async def test_server_requests_get_the_model_defaults(
    llm: LLM, greedy_tokens: list[int], client: httpx.AsyncClient
) -> None:
    expected = llm.get_tokenizer().decode(greedy_tokens[:5])
    unset = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": None})
    assert unset.status_code == 200, unset.text
    assert unset.json()["usage"]["completion_tokens"] == 5
    assert unset.json()["choices"][0]["text"] == expected
    own = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8})  # its own wins
    assert own.json()["choices"][0]["text"] == llm.get_tokenizer().decode(greedy_tokens[:8])
    chat = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Name a colour."}],
    })
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 5
