"""LoRA through `pagedserve serve --enable-lora --lora-modules ...` (a real server process): the request's
model names the adapter and the output equals HF Transformers + peft; /v1/models lists adapters; the
runtime load/unload endpoints (VLLM_ALLOW_RUNTIME_LORA_UPDATING) refuse bad adapters with their reason
without disturbing a request in flight; the LoRA metrics carry vLLM's labels."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import MAX_TOKENS, LoRAFixture, copy_adapter
from transformers import AutoTokenizer

from pagedserve.testing.processes import ServerProcess, float_model_args, serve_process

pytestmark = pytest.mark.slow

BASE = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, lora_setup: LoRAFixture) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    qv4, attn8 = lora_setup.adapters["qv4"].request, lora_setup.adapters["attn8"].request
    flags = [
        *float_model_args(),  # HF + peft's weights: the float32 ones
        "--max-model-len", "256", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-modules", f"qv4={qv4.lora_path}", json.dumps({"name": "attn8", "path": attn8.lora_path}),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    with serve_process(log, *flags, env=env) as srv:
        srv.wait_ready(STARTUP_TIMEOUT_S)
        yield srv


@pytest.fixture(scope="module")
def tokenizer(lora_setup: LoRAFixture):
    return AutoTokenizer.from_pretrained(lora_setup.base_dir)


def complete(server: ServerProcess, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS
             ) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def assert_error(response: httpx.Response, status: int, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    for word in words:
        assert word in error["message"], error


def test_models_lists_adapters_with_parent(server: ServerProcess, lora_setup: LoRAFixture) -> None:
    cards = {card["id"]: card for card in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert set(cards) == {BASE, "qv4", "attn8"}
    assert cards["qv4"]["parent"] == BASE and cards["attn8"]["parent"] == BASE
    assert cards["qv4"]["root"] == lora_setup.adapters["qv4"].request.lora_path
    assert cards[BASE]["parent"] is None
    version = httpx.get(f"{server.url}/version").json()
    assert version["enable_lora"] is True and version["max_loras"] == 2


@pytest.mark.parametrize("name", ["qv4", "attn8"])
def test_completion_with_adapter_equals_hf_peft(
    server: ServerProcess, lora_setup: LoRAFixture, tokenizer, name: str
) -> None:
    for ids, expected in zip(lora_setup.prompt_ids, lora_setup.adapters[name].expected, strict=True):
        response = complete(server, name, ids)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["model"] == name
        assert body["choices"][0]["text"] == tokenizer.decode(expected)
        assert body["usage"]["completion_tokens"] == MAX_TOKENS


def test_chat_names_the_adapter(server: ServerProcess) -> None:
    body = {"model": "attn8", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "attn8"
    base = post(server, "/v1/chat/completions", {**body, "model": BASE})
    assert base.json()["model"] == BASE


def test_unknown_model_is_404(server: ServerProcess) -> None:
    response = complete(server, "no-such-adapter", [1, 2, 3])
    assert_error(response, 404, "no-such-adapter")
    assert response.json()["error"]["code"] == "model_not_found"


async def test_load_and_unload_at_run_time(
    server: ServerProcess, lora_setup: LoRAFixture, tokenizer, tmp_path: Path
) -> None:
    """Bad loads are 400s with the reason, an unknown unload a 404; a request in flight meanwhile
    finishes with the right output; a good adapter, once loaded, serves as HF + peft says."""
    base_prompt = lora_setup.prompt_ids[0]
    body = {"model": BASE, "prompt": base_prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        in_flight = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await asyncio.sleep(0.2)
        source = lora_setup.adapters["all16"].request.lora_path
        too_high = str(copy_adapter(source, tmp_path / "r", r=32))
        unknown_target = str(copy_adapter(source, tmp_path / "t", target_modules=["fc9"]))
        bad = [
            ({"lora_name": "x1", "lora_path": str(tmp_path)}, "not a PEFT adapter"),
            ({"lora_name": "x2", "lora_path": too_high}, "greater than max_lora_rank 16"),
            ({"lora_name": "x3", "lora_path": unknown_target}, "fc9"),
            ({"lora_name": "qv4", "lora_path": source}, "already been loaded"),
        ]
        for request, reason in bad:
            assert_error(await client.post("/v1/load_lora_adapter", json=request), 400, reason)
        assert_error(await client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}), 404, "nope")
        done = await in_flight
    assert done.status_code == 200, done.text
    text = done.json()["choices"][0]["text"]
    assert text.startswith(tokenizer.decode(lora_setup.base_expected[0]))
    assert done.json()["usage"]["completion_tokens"] == 48

    loaded = post(server, "/v1/load_lora_adapter", {"lora_name": "all16", "lora_path": source})
    assert loaded.status_code == 200, loaded.text
    assert "all16" in {card["id"] for card in httpx.get(f"{server.url}/v1/models").json()["data"]}
    expected = lora_setup.adapters["all16"].expected[1]
    response = complete(server, "all16", lora_setup.prompt_ids[1])
    assert response.json()["choices"][0]["text"] == tokenizer.decode(expected)
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "all16"}).status_code == 200
    assert_error(complete(server, "all16", lora_setup.prompt_ids[1]), 404)
    assert "all16" not in {card["id"] for card in httpx.get(f"{server.url}/v1/models").json()["data"]}


def test_lora_metrics(server: ServerProcess, lora_setup: LoRAFixture) -> None:
    assert complete(server, "qv4", lora_setup.prompt_ids[0]).status_code == 200
    text = httpx.get(f"{server.url}/metrics").text
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1
    assert 'max_lora="2"' in info[0]
    assert 'running_lora_adapters=""' in info[0] and 'waiting_lora_adapters=""' in info[0]
    assert float(info[0].rsplit(" ", 1)[1]) > 1e9  # a timestamp, as vLLM's
    counted = [line for line in text.splitlines()
               if line.startswith("pagedserve:lora_requests_total{") and 'lora_name="qv4"' in line]
    assert len(counted) == 1 and f'model_name="{BASE}"' in counted[0] and 'engine="0"' in counted[0]
    assert float(counted[0].rsplit(" ", 1)[1]) >= 1
    usage = [line for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc{")]
    assert float(usage[0].rsplit(" ", 1)[1]) == 0.0  # every finished request's blocks came back
