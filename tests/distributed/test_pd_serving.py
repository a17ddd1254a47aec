"""Prefill/decode disaggregation through real processes (issue 41's acceptance): a prefill engine
(`--kv-transfer-config` kv_producer), a decode engine (kv_consumer) and `pagedserve router --strategy pd`
in front of them answer 100 mixed requests (completions and chat, streamed and not, shared prefixes and
not) with the same greedy text as one colocated engine; the decode engine's own metrics show it computed
only each prompt's last token; a prefill engine killed mid-load loses no request (the router's fallbacks
count them, and the requests already prefilled there fall back on the decode engine).

The KV moves over Mooncake's transfer engine on 127.0.0.1 (TCP).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedserve.testing.processes import ServerProcess, float_model_args, router_process, serve_process
from pagedserve.testing.prometheus_text import metric_value, scrape

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda (pagedserve[pd])",
                    exc_type=ImportError)
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

STARTUP_TIMEOUT_S = 240
FLAGS = ["--max-model-len", "1024", "--kv-cache-memory-bytes", "192M", "--dtype", "float32",
         "--max-num-seqs", "16"]
NUM_REQUESTS = 100
CONCURRENCY = 8


def connector(role: str) -> str:
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role, "kv_port": 0})


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    logs = tmp_path_factory.mktemp("pd")
    model = float_model_args()
    servers = {
        "prefill": serve_process(logs / "prefill.log", *model, *FLAGS,
                                 "--kv-transfer-config", connector("kv_producer")),
        "decode": serve_process(logs / "decode.log", *model, *FLAGS,
                                "--kv-transfer-config", connector("kv_consumer")),
        "colocated": serve_process(logs / "colocated.log", *model, *FLAGS),
    }
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_ready(STARTUP_TIMEOUT_S)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def pd_router(log: Path, engines: dict[str, ServerProcess]) -> ServerProcess:
    return router_process(log, [engines["decode"].url], "--strategy", "pd",
                          "--prefill-backend", engines["prefill"].url, "--health-interval", "0.2")


def mixed_requests(model: str, tag: str) -> list[tuple[str, dict[str, Any]]]:
    """(path, body) pairs: four kinds in turn, prompts from a few words to several hundred tokens, every
    third one sharing a long opening with others (the prefill engine's prefix cache)."""
    shared = " ".join(f"Clause {k}: the {tag} contract binds to clause {k + 1}." for k in range(20))
    requests = []
    for i in range(NUM_REQUESTS):
        body_text = " ".join(f"item {i}-{k} weighs {k * 7 % 13} grams" for k in range(1 + (i * 37) % 40))
        text = f"{shared} Now {body_text}." if i % 3 == 0 else f"[{tag} {i}] {body_text}. Summary:"
        common = {"model": model, "temperature": 0, "max_tokens": 4 + i % 9, "stream": i % 2 == 1}
        if (i // 2) % 2 == 0:
            requests.append(("/v1/completions", {**common, "prompt": text}))
        else:
            messages = [{"role": "user", "content": text}]
            requests.append(("/v1/chat/completions", {**common, "messages": messages}))
    return requests


async def answer(client: httpx.AsyncClient, base: str, path: str, body: dict[str, Any]) -> str:
    """The generated text, streamed or not."""
    if not body["stream"]:
        response = await client.post(base + path, json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]
    parts = []
    async with client.stream("POST", base + path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


async def answer_all(base: str, requests: list[tuple[str, dict[str, Any]]]) -> list[str]:
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=180) as client:
        async def one(path: str, body: dict[str, Any]) -> str:
            async with gate:
                return await answer(client, base, path, body)

        return await asyncio.gather(*(one(path, body) for path, body in requests))


def computed_prompt_tokens(text: str) -> float:
    prompt = metric_value(text, "vllm:prompt_tokens_total")
    return (prompt - metric_value(text, "vllm:prefix_cache_hits_total")
            - metric_value(text, "vllm:external_prefix_cache_hits_total"))


def model_name(server: ServerProcess) -> str:
    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_pd_pair_answers_100_mixed_requests_as_one_colocated_engine(
    engines: dict[str, ServerProcess], tmp_path: Path
) -> None:
    requests = mixed_requests(model_name(engines["decode"]), "alpha")
    expected = asyncio.run(answer_all(engines["colocated"].url, requests))
    decode_before = scrape(engines["decode"].url)
    with pd_router(tmp_path / "router.log", engines) as router:
        router.wait_ready(60)
        got = asyncio.run(answer_all(router.url, requests))
        routed = scrape(router.url)
    assert got == expected
    decode_after = scrape(engines["decode"].url)
    assert metric_value(routed, "pagedserve_router_pd_requests_total") == NUM_REQUESTS
    assert metric_value(routed, "pagedserve_router_pd_fallbacks_total") == 0
    reads = "vllm:kv_transfers_total"
    assert metric_value(decode_after, reads) - metric_value(decode_before, reads) == NUM_REQUESTS
    assert metric_value(decode_after, "vllm:kv_transfer_failures_total") == 0
    # Every prompt token came from the prefill engine (or the decode engine's own cache) but the last.
    computed = computed_prompt_tokens(decode_after) - computed_prompt_tokens(decode_before)
    assert computed == NUM_REQUESTS
    assert metric_value(decode_after, "vllm:kv_transfer_bytes_total") > 0


def test_a_prefill_engine_killed_mid_load_loses_no_request(
    engines: dict[str, ServerProcess], tmp_path: Path
) -> None:
    requests = mixed_requests(model_name(engines["decode"]), "beta")
    expected = asyncio.run(answer_all(engines["colocated"].url, requests))
    with pd_router(tmp_path / "router.log", engines) as router:
        router.wait_ready(60)

        async def load_and_kill() -> list[str]:
            answers = asyncio.ensure_future(answer_all(router.url, requests))
            while metric_value(scrape(router.url), "pagedserve_router_pd_requests_total") < NUM_REQUESTS // 4:
                await asyncio.sleep(0.1)
            engines["prefill"].kill()
            return await answers

        got = asyncio.run(load_and_kill())
        routed = scrape(router.url)
    assert got == expected
    assert metric_value(routed, "pagedserve_router_pd_fallbacks_total") > 0
    decode = scrape(engines["decode"].url)
    assert metric_value(decode, "vllm:num_requests_running") == 0
