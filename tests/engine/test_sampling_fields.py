"""vLLM's sampling fields on the embedded model, offline and through the server: allowed_token_ids,
bad_words, and a request whose token cannot be sampled failing alone (issue 14 items 1 and 3)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pagedserve.server.engine.async_engine import AsyncEngine
from pagedserve.server.engine.llm_engine import StepError
from pagedserve.server.request import Request
from pagedserve.server.sample import sampler

from pagedserve import LLM, SamplingParams, default_model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(default_model()), max_model_len=256)


def greedy(llm: LLM, max_tokens: int = 8, **fields: Any) -> list[int]:
    (out,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens, **fields))
    return out.outputs[0].token_ids


def contains(tokens: list[int], sequence: list[int]) -> bool:
    return any(tokens[i:i + len(sequence)] == sequence for i in range(len(tokens) - len(sequence) + 1))


def test_allowed_token_ids_offline(llm: LLM) -> None:
    free = greedy(llm)
    allowed = [t for t in range(100, 140) if t not in free]
    assert set(greedy(llm, allowed_token_ids=allowed)) <= set(allowed)
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=8, seed=1, allowed_token_ids=allowed))
    assert set(out.outputs[0].token_ids) <= set(allowed)


async def test_allowed_token_ids_through_the_server(llm: LLM, client: httpx.AsyncClient) -> None:
    token = llm.get_tokenizer().encode(" blue")[0]
    response = await client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "allowed_token_ids": [token],
    })
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == llm.get_tokenizer().decode([token] * 3)


def test_bad_words_are_never_generated(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    free = tokenizer.decode(greedy(llm))
    word = free.split()[0]  # the first word the model says (" Paris")
    banned = [tokenizer.encode(word, add_special_tokens=False),
              tokenizer.encode(" " + word, add_special_tokens=False)]
    assert any(contains(greedy(llm), b) for b in banned)
    tokens = greedy(llm, bad_words=[word])
    assert tokens and not any(contains(tokens, b) for b in banned)


async def test_bad_words_through_the_server(llm: LLM, client: httpx.AsyncClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    free = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    word = free.split()[0]
    response = await client.post("/v1/completions", json={**body, "bad_words": [word]})
    assert response.status_code == 200, response.text
    assert word not in response.json()["choices"][0]["text"].split()


@pytest.fixture
def doomed_row() -> Iterator[None]:
    """Sampling raises for any batch holding a request whose id starts with "doomed": a failure no
    request check can foresee."""
    original = sampler.sample_on_device

    def broken(logits: Any, requests: list[Request], grammar: Any = None) -> Any:
        if any(r.request_id.startswith("doomed") for r in requests):
            raise RuntimeError("injected sampling failure")
        return original(logits, requests, grammar)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampler, "sample_on_device", broken)
        yield


def test_a_request_that_cannot_be_sampled_fails_alone_offline(llm: LLM, doomed_row: None) -> None:
    engine = llm.engine
    alone = greedy(llm, max_tokens=6)
    engine.add_request("doomed", PROMPT, SamplingParams(temperature=0.0, max_tokens=6))
    engine.add_request("ok", PROMPT, SamplingParams(temperature=0.0, max_tokens=6))
    with pytest.raises(StepError) as failed:
        engine.step()
    assert failed.value.request_ids == ["doomed"]
    assert [o.request_id for o in failed.value.outputs] == ["ok"]  # its first token, not lost
    final = failed.value.outputs[0]
    while engine.has_unfinished():
        for output in engine.step():
            final = output
    assert final.request_id == "ok" and final.finished
    assert final.outputs[0].token_ids == alone
    pool = engine.core.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and not engine.output_processor.requests


LONG = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def long_alone(llm: LLM) -> list[int]:
    """LONG's tokens with nothing beside them (module scope: made before a test starts an AsyncEngine
    over the same core, which must never step beside the LLM)."""
    (out,) = llm.generate(PROMPT, LONG)
    return out.outputs[0].token_ids


async def test_a_request_that_cannot_be_sampled_fails_alone_in_the_async_engine(
    long_alone: list[int], served_engine: AsyncEngine, doomed_row: None
) -> None:
    fine = await served_engine.add_request("fine", PROMPT, LONG)
    await anext(fine)  # running now: the doomed request's prefill joins its decode steps
    doomed = await served_engine.add_request("doomed", PROMPT, SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(StepError):
        async for _ in doomed:
            pass
    outputs = [o async for o in fine]
    assert outputs[-1].finished
    assert outputs[-1].outputs[0].token_ids == long_alone
    stats = served_engine.stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_running == 0
