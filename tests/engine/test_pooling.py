"""The pooling runner: embeddings of tiny random decoders equal sentence-transformers' (which runs the
same checkpoint through HF Transformers) within 1e-5 cosine distance, for last-token, mean and CLS
pooling, batched and one at a time, in chunks, after preemption and on prefix-cache hits; the requests'
checks; nothing leaks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pagedserve.common.engine_args import EngineArgs, add_cli_arguments, from_cli
from pagedserve.server.exceptions import InvalidRequestError
from pagedserve.server.pooling_params import PoolingParams
from pagedserve.server.sampling_params import SamplingParams

from pagedserve import LLM
from pagedserve.testing.leaks import assert_no_leak
from pagedserve.testing.tiny_models import TINY_ENGINE, tiny_embedding_checkpoint

TEXTS = [
    "hello world",
    "paged attention keeps the KV cache in blocks; " * 4,  # ~180 tokens: several 32-token chunks
    "x",
    "continuous batching mixes prefills and decodes",
]
MAX_COSINE_DISTANCE = 1e-5


def sentence_transformers_embeddings(folder: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, convert_to_numpy=True, batch_size=len(texts))


def assert_close(ours: list[list[float]], reference: np.ndarray) -> None:
    got = np.asarray(ours, dtype=np.float64)
    assert got.shape == reference.shape
    cosine = (got * reference).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, axis=1)
    assert (1 - cosine).max() <= MAX_COSINE_DISTANCE, 1 - cosine
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(reference, axis=1), rtol=1e-4)


def embeddings(llm: LLM, texts: list[str], params: PoolingParams | None = None) -> list[list[float]]:
    return [o.outputs.embedding for o in llm.embed(texts, params)]


@pytest.fixture(scope="module", params=[("lasttoken", False), ("mean_tokens", True), ("cls_token", False)],
                ids=["last-token", "mean-base-model", "cls"])
def embedder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sentence-transformers folder per pooling mode; the mean one saved as a base model (Qwen3Model,
    no LM head), which ``--runner auto`` must run as a pooling model too."""
    pooling, base_model = request.param
    folder = tmp_path_factory.mktemp(pooling)
    return tiny_embedding_checkpoint(folder, pooling=pooling, base_model=base_model)


@pytest.mark.parametrize("engine_args", [
    pytest.param({}, id="whole-prompts"),
    pytest.param({"max_num_batched_tokens": 32}, id="chunked-32"),
    # 14 blocks of 16 tokens hold one long prompt at a time: the others wait for its blocks.
    pytest.param({"num_gpu_blocks_override": 14, "max_num_batched_tokens": 64, "max_model_len": 200},
                 id="few-blocks"),
])  # fmt: skip
def test_embeddings_equal_sentence_transformers(embedder: Path, engine_args: dict) -> None:
    reference = sentence_transformers_embeddings(embedder, TEXTS)
    llm = LLM(str(embedder), **TINY_ENGINE, **engine_args)
    assert llm.engine.core.config.runner == "pooling"  # --runner auto: modules.json says so
    assert_close(embeddings(llm, TEXTS), reference)  # batched
    assert_close([embeddings(llm, [text])[0] for text in TEXTS], reference)  # one at a time
    if "num_gpu_blocks_override" in engine_args:
        texts = [f"{i} " + TEXTS[1] for i in range(4)]
        assert_close(embeddings(llm, texts), sentence_transformers_embeddings(embedder, texts))
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_a_prompt_computed_again_pools_afresh(pooling_type: str) -> None:
    """A preempted request runs its prompt again from position 0 (server/core/scheduler.py _preempt): the
    chunks before the preemption must not count twice."""
    import torch
    from pagedserve.server.outputs import RequestMetrics
    from pagedserve.server.request import Request
    from pagedserve.server.worker.pooler import PoolingRows, pool

    hidden = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    request = Request("r", list(range(10)), SamplingParams(), 1, frozenset(), RequestMetrics(0.0),
                      pooling=PoolingParams(pooling_type=pooling_type, normalize=False))
    assert pool(hidden[:4], PoolingRows(request, 0, 0, 4)) is None
    assert pool(hidden[4:7], PoolingRows(request, 0, 4, 3)) is None  # then preempted
    assert pool(hidden[:6], PoolingRows(request, 0, 0, 6)) is None  # computed again
    vector = pool(hidden[6:], PoolingRows(request, 0, 6, 4))
    expected = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
    torch.testing.assert_close(vector, expected)


def test_last_token_pooling_reuses_cached_prefixes(tmp_path: Path) -> None:
    """LAST reads only the final position, so a repeated prompt hits the prefix cache; MEAN computes every
    position again (a hit would leave the sum without them)."""
    folder = tiny_embedding_checkpoint(tmp_path, pooling="lasttoken")
    reference = sentence_transformers_embeddings(folder, [TEXTS[1]])
    llm = LLM(str(folder), **TINY_ENGINE)
    first = embeddings(llm, [TEXTS[1]])
    hits_before = llm.engine.stats().prefix_cache_hits
    assert_close(embeddings(llm, [TEXTS[1]]), reference)
    assert llm.engine.stats().prefix_cache_hits > hits_before
    assert_close(first, reference)
    mean = LLM(str(folder), **TINY_ENGINE, pooler_config={"pooling_type": "MEAN"})
    embeddings(mean, [TEXTS[1]])
    embeddings(mean, [TEXTS[1]])
    assert mean.engine.stats().prefix_cache_hits == 0
    assert_no_leak(llm.engine)


def test_pooler_config_overrides_the_checkpoint(tmp_path: Path) -> None:
    folder = tiny_embedding_checkpoint(tmp_path, pooling="lasttoken", normalize=True)
    mean_folder = tiny_embedding_checkpoint(tmp_path / "mean", pooling="mean_tokens", normalize=False)
    override = json.dumps({"pooling_type": "MEAN", "normalize": False})
    llm = LLM(str(folder), **TINY_ENGINE, pooler_config=override)
    # the same random weights (seed 0) saved with mean pooling and no Normalize module
    assert_close(embeddings(llm, TEXTS), sentence_transformers_embeddings(mean_folder, TEXTS))
    unit = embeddings(llm, TEXTS, PoolingParams(normalize=True))
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, rtol=1e-5)


def test_matryoshka_dimensions(tmp_path: Path) -> None:
    folder = tiny_embedding_checkpoint(tmp_path / "m", matryoshka_dimensions=[16, 32, 64])
    llm = LLM(str(folder), **TINY_ENGINE)
    full = np.asarray(embeddings(llm, TEXTS, PoolingParams(normalize=False)))
    cut = np.asarray(embeddings(llm, TEXTS, PoolingParams(dimensions=32)))
    expected = full[:, :32] / np.linalg.norm(full[:, :32], axis=1, keepdims=True)  # cut, then normalized
    np.testing.assert_allclose(cut, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidRequestError, match="one of 16, 32, 64") as refused:
        llm.embed("x", PoolingParams(dimensions=20))
    assert refused.value.param == "dimensions"
    plain = LLM(str(tiny_embedding_checkpoint(tmp_path / "plain")), **TINY_ENGINE)
    with pytest.raises(InvalidRequestError, match="matryoshka"):
        plain.embed("x", PoolingParams(dimensions=32))


def test_each_runner_takes_only_its_requests(tmp_path: Path) -> None:
    folder = tiny_embedding_checkpoint(tmp_path)
    pooling = LLM(str(folder), **TINY_ENGINE)
    with pytest.raises(InvalidRequestError, match="pooling runner"):
        pooling.generate("hello", SamplingParams(max_tokens=2))
    # the same Qwen3ForCausalLM checkpoint, sampled
    generating = LLM(str(folder), **TINY_ENGINE, runner="generate")
    assert len(generating.generate("hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2
    with pytest.raises(InvalidRequestError, match="generate runner"):
        generating.embed("hello")
    base = tiny_embedding_checkpoint(tmp_path / "base", base_model=True)
    with pytest.raises(ValueError, match="base model without an LM head"):
        LLM(str(base), **TINY_ENGINE, runner="generate")


def test_a_prompt_as_long_as_the_context_is_pooled(tmp_path: Path) -> None:
    """A pooling request generates nothing, so its prompt may fill max_model_len (not one more)."""
    llm = LLM(str(tiny_embedding_checkpoint(tmp_path)), **TINY_ENGINE, max_model_len=64)
    assert len(embeddings(llm, [{"prompt_token_ids": list(range(64))}])[0]) == 64
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        llm.embed({"prompt_token_ids": list(range(65))})
    assert_no_leak(llm.engine)


def test_unsupported_sentence_transformers_modules_are_refused(tmp_path: Path) -> None:
    folder = tiny_embedding_checkpoint(tmp_path)
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense"):
        LLM(str(folder), **TINY_ENGINE)


def test_score_is_the_cosine_of_the_embeddings(tmp_path: Path) -> None:
    folder = tiny_embedding_checkpoint(tmp_path)
    llm = LLM(str(folder), **TINY_ENGINE)
    vectors = np.asarray(embeddings(llm, TEXTS))
    scores = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS)]
    np.testing.assert_allclose(scores, vectors @ vectors[0], rtol=1e-5, atol=1e-6)
    pairwise = [o.outputs.score for o in llm.score(TEXTS[:2], TEXTS[2:])]
    np.testing.assert_allclose(pairwise, [vectors[0] @ vectors[2], vectors[1] @ vectors[3]], rtol=1e-5)
    with pytest.raises(InvalidRequestError, match="one text_1, or as many"):
        llm.score(TEXTS[:2], TEXTS[:3])


def test_task_embed_is_the_runner_flag_older_spelling() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    assert from_cli(parser.parse_args(["--task", "embed"]))["runner"] == "pooling"
    assert from_cli(parser.parse_args(["--runner", "pooling"]))["runner"] == "pooling"
    with pytest.raises(SystemExit):
        parser.parse_args(["--task", "classify"])
    with pytest.raises(ValueError, match="pooler_config needs the pooling runner"):
        EngineArgs(runner="generate", pooler_config='{"pooling_type": "MEAN"}')
