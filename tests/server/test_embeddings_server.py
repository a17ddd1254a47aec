"""The pooling runner behind the API (issue 40): `pagedserve serve` of a tiny random sentence-transformers
embedder, asked through the openai client (base64, its default, and floats) directly and through the
router; vLLM's /pooling, /score and /rerank; the refusals; the metrics; nothing left in the KV cache."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from pagedserve.testing.api_fakes import FakeEngine, app_client, assert_400
from pagedserve.testing.processes import router_process, serve_process
from pagedserve.testing.tiny_models import tiny_embedding_checkpoint

MODEL = "tiny-embed"
TEXTS = ["hello world", "paged attention keeps the KV cache in blocks", "x"]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_embedding_checkpoint(tmp_path_factory.mktemp("embedder"), matryoshka_dimensions=[16, 32, 64])


@pytest.fixture(scope="module")
def reference(folder: Path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)


@pytest.fixture(scope="module")
def urls(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The engine (``--task embed``: vLLM's older spelling of ``--runner pooling``) and a router in front."""
    logs = tmp_path_factory.mktemp("logs")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    flags = ("--model", str(folder), "--served-model-name", MODEL, "--task", "embed",
             "--uvicorn-log-level", "warning", "--disable-access-log")  # fmt: skip
    with serve_process(logs / "engine.log", *flags, env=env) as engine:
        engine.wait_ready(120)
        router_flags = ("--tokenizer", str(folder), "--model-name", MODEL, "--strategy", "least-load",
                        "--health-interval", "0.5", "--log-level", "warning")  # fmt: skip
        with router_process(logs / "router.log", [engine.url], *router_flags, env=env) as router:
            router.wait_ready(60)
            yield {"engine": engine.url, "router": router.url}


def assert_close(got: Any, expected: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float64)
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert (1 - cosine).max() <= 1e-5, 1 - cosine


@pytest.mark.parametrize("via", ["engine", "router"])
def test_the_openai_client_gets_sentence_transformers_embeddings(
    urls: dict[str, str], folder: Path, reference: np.ndarray, via: str
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    client = openai.OpenAI(base_url=urls[via] + "/v1", api_key="x", max_retries=0)
    batch = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in batch.data] == [0, 1, 2] and batch.model == MODEL
    assert_close([d.embedding for d in batch.data], reference)
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert_close([d.embedding for d in floats.data], reference)
    single = client.embeddings.create(model=MODEL, input=TEXTS[1])
    assert_close([single.data[0].embedding], reference[1:2])
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(len(t) for t in TEXTS)  # byte tokens
    token_ids = client.embeddings.create(model=MODEL, input=[tokenizer.encode(TEXTS[0])])
    assert_close([token_ids.data[0].embedding], reference[:1])
    cut = client.embeddings.create(model=MODEL, input=TEXTS, dimensions=32)
    assert {len(d.embedding) for d in cut.data} == {32}
    np.testing.assert_allclose(np.linalg.norm([d.embedding for d in cut.data], axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("via", ["engine", "router"])
def test_pooling_score_and_rerank(urls: dict[str, str], reference: np.ndarray, via: str) -> None:
    unit = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    with httpx.Client(base_url=urls[via], timeout=60) as http:
        pooled = http.post("/pooling", json={"model": MODEL, "input": TEXTS})
        assert pooled.status_code == 200, pooled.text
        assert_close([d["data"] for d in pooled.json()["data"]], reference)
        for path in ("/score", "/v1/score"):
            scored = http.post(path, json={"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS})
            assert scored.status_code == 200, scored.text
            np.testing.assert_allclose([d["score"] for d in scored.json()["data"]], unit @ unit[0], atol=1e-5)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            body = {"model": MODEL, "query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1}
            ranked = http.post(path, json=body)
            assert ranked.status_code == 200, ranked.text
            (best,) = ranked.json()["results"]
            expected = 1 + int(np.argmax(unit[1:] @ unit[0]))
            assert best["document"]["text"] == TEXTS[expected] and best["index"] == expected - 1
            assert best["relevance_score"] == pytest.approx(float(unit[expected] @ unit[0]), abs=1e-5)


def test_refusals_name_the_field(urls: dict[str, str]) -> None:
    with httpx.Client(base_url=urls["engine"], timeout=60) as http:
        assert "one of 16, 32, 64" in assert_400(
            http.post("/v1/embeddings", json={"model": MODEL, "input": "x", "dimensions": 20}), "dimensions"
        )
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        assert "pooling runner" in assert_400(http.post("/v1/chat/completions", json=chat), "model")
        assert_400(http.post("/v1/embeddings", json={"model": MODEL, "input": ""}), "input")
        too_long = http.post("/v1/embeddings", json={"model": MODEL, "input": "y" * 300})
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        body = {"model": MODEL, "input": "y" * 300, "truncate_prompt_tokens": -1}
        kept = http.post("/v1/embeddings", json=body)
        assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] == 256
        assert_400(http.post("/v1/embeddings", json={"model": MODEL, "input": "x", "encoding_format": "hex"}),
                   "encoding_format")
        pairs = {"model": MODEL, "text_1": ["a", "b"], "text_2": ["c"]}
        assert_400(http.post("/score", json=pairs), "text_2")
        assert http.post("/v1/embeddings", json={"model": "other", "input": "x"}).status_code == 404


def test_metrics_count_pooling_requests_and_nothing_stays(urls: dict[str, str]) -> None:
    with httpx.Client(base_url=urls["engine"], timeout=60) as http:
        assert http.get("/version").json()["engine_args"]["runner"] == "pooling"
        assert http.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS}).status_code == 200
        text = http.get("/metrics").text
    success = re.search(r'vllm:request_success_total\{[^}]*finished_reason="stop"[^}]*\} (\S+)', text)
    assert success is not None and float(success.group(1)) >= len(TEXTS)
    prompt_tokens = re.search(r"^vllm:prompt_tokens_total\{[^}]*\} (\S+)", text, re.MULTILINE)
    assert prompt_tokens is not None and float(prompt_tokens.group(1)) >= sum(len(t) for t in TEXTS)
    for gauge in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        value = re.search(rf"^{gauge}\{{[^}}]*\}} (\S+)", text, re.MULTILINE)
        assert value is not None and float(value.group(1)) == 0.0, gauge


async def test_a_generating_model_refuses_pooling_requests() -> None:
    engine = FakeEngine()
    async with await app_client(engine) as http:
        for path, body in (("/v1/embeddings", {"input": "x"}), ("/pooling", {"input": "x"}),
                           ("/score", {"text_1": "a", "text_2": "b"}),
                           ("/rerank", {"query": "a", "documents": ["b"]})):  # fmt: skip
            response = await http.post(path, json=body)
            assert "generate runner" in response.json()["error"]["message"], (path, response.text)
            assert response.status_code == 400
    await engine.shutdown(grace_seconds=0)
