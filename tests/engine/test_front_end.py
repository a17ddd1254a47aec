"""The engine's front end on the embedded model: output kinds agree, a stop string frees its blocks in
the core at once, and the step thread never touches the tokenizer."""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any

import pytest
from pagedserve.server.engine.async_engine import AsyncEngine
from pagedserve.server.engine.llm_engine import LLMEngine
from pagedserve.server.engine.processor import make_processor
from pagedserve.server.outputs import RequestOutput
from pagedserve.server.sampling_params import RequestOutputKind

from pagedserve import EngineConfig, SamplingParams, default_model

PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(default_model())))


def run(engine: LLMEngine, request_id: str, params: SamplingParams) -> list[RequestOutput]:
    engine.core.kv.pool.reset_prefix_cache()  # the same computation for every kind: nothing cached
    engine.add_request(request_id, PROMPT, params)
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def summary(output: RequestOutput) -> list[dict[str, Any]]:
    return [
        {
            "index": c.index,
            "text": c.text,
            "token_ids": c.token_ids,
            "finish": c.finish_reason,
            "stop_reason": c.stop_reason,
            "cumulative_logprob": c.cumulative_logprob,
            "logprobs": [
                {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in step.items()}
                for step in c.logprobs or []
            ],
        }
        for c in output.outputs
    ]


def test_deltas_concatenate_to_the_cumulative_output(engine: LLMEngine) -> None:
    """Stop strings (one sample stops on one, text is held back until decided), n > 1 and logprobs."""
    common: dict[str, Any] = {
        "n": 3,
        "seed": 11,
        "temperature": 1.0,
        "max_tokens": 40,
        "logprobs": 2,
        "stop": [" the", "."],
    }
    by_kind = {
        kind: run(engine, kind.name, SamplingParams(output_kind=kind, **common)) for kind in RequestOutputKind
    }

    cumulative = by_kind[RequestOutputKind.CUMULATIVE]
    for before, after in itertools.pairwise(cumulative):
        for old, new in zip(before.outputs, after.outputs, strict=True):
            assert new.text.startswith(old.text) and new.token_ids[: len(old.token_ids)] == old.token_ids

    deltas = by_kind[RequestOutputKind.DELTA]
    assert len(deltas) > 1 and all(not o.finished for o in deltas[:-1]) and deltas[-1].finished
    for delta in deltas:
        assert all(c.text or c.finish_reason for c in delta.outputs)  # nothing empty is sent
    folded = deltas[0]
    for delta in deltas[1:]:
        folded.add(delta)

    (final,) = by_kind[RequestOutputKind.FINAL_ONLY]
    assert summary(folded) == summary(cumulative[-1]) == summary(final)
    assert any(c.finish_reason == "stop" and isinstance(c.stop_reason, str) for c in final.outputs)
    assert all(len(c.logprobs or []) == len(c.token_ids) for c in final.outputs)


def test_stop_string_aborts_in_the_core(engine: LLMEngine) -> None:
    (greedy,) = run(
        engine,
        "greedy",
        SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        ),
    )
    word = greedy.outputs[0].text.split()[3]
    engine.add_request(
        "stopped", PROMPT, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, stop=[word])
    )
    pool = engine.core.kv.pool
    while True:
        (output,) = engine.step()
        if output.finished:
            break
        assert pool.num_free_blocks < pool.num_blocks
    (completion,) = output.outputs
    assert completion.finish_reason == "stop" and completion.stop_reason == word
    assert len(completion.token_ids) < 200 and word not in completion.text
    # Right after the step that matched it, with max_tokens far from reached: gone from the core.
    assert "stopped" not in engine.core.requests and not engine.has_unfinished()
    assert pool.num_free_blocks == pool.num_blocks


class ThreadRecordingTokenizer:
    """Wraps a tokenizer and records the thread of every call made through it."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.threads: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._tokenizer, name)
        if not callable(value):
            return value

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.threads.add(threading.current_thread().name)
            return value(*args, **kwargs)

        return recorded

    def __len__(self) -> int:
        return len(self._tokenizer)


async def test_step_thread_never_calls_the_tokenizer(engine: LLMEngine) -> None:
    tokenizer = ThreadRecordingTokenizer(engine.tokenizer)
    async_engine = AsyncEngine(engine.core, tokenizer, make_processor(engine.core, tokenizer))
    await async_engine.start()
    try:
        params = SamplingParams(
            n=2,
            seed=5,
            temperature=1.0,
            max_tokens=24,
            logprobs=3,
            stop=["."],
            output_kind=RequestOutputKind.DELTA,
        )

        async def collect() -> list[RequestOutput]:
            return [o async for o in async_engine.generate(PROMPT, params, "recorded")]

        outputs = await asyncio.wait_for(collect(), timeout=120)
        assert outputs[-1].finished
        assert async_engine._thread is not None and async_engine._thread.name == "engine-loop"
        assert tokenizer.threads == {threading.current_thread().name}  # the event loop's thread only
        for _ in range(100):
            if async_engine.stats().kv_cache_usage == 0.0:
                break
            await asyncio.sleep(0.02)
        assert async_engine.stats().kv_cache_usage == 0.0
    finally:
        await async_engine.shutdown(grace_seconds=0)
