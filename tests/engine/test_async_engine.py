"""The asyncio front: concurrent streams, abort when the consumer leaves, bad requests isolated."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pagedserve.server.engine.async_engine import AsyncEngine, RequestStream
from pagedserve.server.engine.processor import ProcessedRequest
from pagedserve.server.sampling_params import RequestOutputKind

from pagedserve import EngineConfig, SamplingParams, default_model


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    engine = AsyncEngine.from_config(EngineConfig(model=str(default_model())))
    await engine.start()
    yield engine
    await engine.shutdown(grace_seconds=0)


async def collect(engine: AsyncEngine, prompt: str, request_id: str, **params: object) -> list[int]:
    final = None
    async for output in engine.generate(prompt, SamplingParams(**params), request_id):  # type: ignore[arg-type]
        final = output
    assert final is not None and final.finished
    return final.outputs[0].token_ids


async def wait_idle(engine: AsyncEngine) -> None:
    for _ in range(200):
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.stats()}")


async def test_concurrent_streams_match_sequential(engine: AsyncEngine) -> None:
    prompts = [f"Write a list of {i} fruits:" for i in range(2, 8)]
    sequential = [await collect(engine, p, f"seq-{i}", temperature=0.0, max_tokens=12)
                  for i, p in enumerate(prompts)]
    concurrent = await asyncio.gather(*[
        collect(engine, p, f"con-{i}", temperature=0.0, max_tokens=12) for i, p in enumerate(prompts)
    ])
    assert list(concurrent) == sequential
    await wait_idle(engine)


async def test_consumer_leaving_aborts_request(engine: AsyncEngine) -> None:
    stream = engine.generate("Count from one to a thousand:", SamplingParams(max_tokens=500, ignore_eos=True),
                             "leaver")
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 3:
            break
    await stream.aclose()
    await wait_idle(engine)
    assert engine.stats().kv_cache_usage == 0.0


async def test_bad_request_fails_alone(engine: AsyncEngine) -> None:
    good = asyncio.create_task(collect(engine, "Tell me a story.", "good", max_tokens=16, ignore_eos=True))
    with pytest.raises(ValueError, match="max_model_len"):
        await collect(engine, "hello " * 20, "bad", max_tokens=10**6)
    assert len(await good) == 16
    assert engine.is_healthy()


async def test_a_slow_grammar_compile_leaves_the_loop_free(engine: AsyncEngine) -> None:
    """Nested counted repetitions take about a second to compile (and are refused past the deadline):
    meanwhile the event loop keeps turning, so other streams are not held up."""
    from pagedserve.server.exceptions import InvalidRequestError
    from pagedserve.server.sampling_params import StructuredOutputsParams

    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(x{1000}){1000}"))
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        stream = await engine.add_request("slow-grammar", "Say x:", params)
        await stream.aclose()
    except InvalidRequestError:
        pass  # past the compile deadline on a slow machine: refused, which is fine here
    finally:
        elapsed = loop.time() - started
        ticker.cancel()
    # Held on the loop, the compile would leave at most a tick or two for the whole wait.
    assert elapsed < 0.2 or ticks >= elapsed / 0.01 / 4, (ticks, elapsed)


class _Released:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def _release(self, request_id: str, abort: bool) -> None:
        self.calls.append((request_id, abort))


def _delta(index: int, text: str, token: int, finish: str | None = None) -> Any:
    from pagedserve.server.outputs import CompletionOutput, RequestOutput

    return RequestOutput("r", None, [1], 0, [CompletionOutput(index, text, [token], None, None, finish)],
                         finished=finish is not None)


def _stream(kind: RequestOutputKind) -> tuple[RequestStream, _Released]:
    request = ProcessedRequest("r", None, [1], SamplingParams(output_kind=kind), 8, [])
    owner = _Released()
    return RequestStream(owner, request), owner  # type: ignore[arg-type]


async def test_a_stream_behind_gets_the_deltas_that_piled_up_as_one() -> None:
    """vLLM V1's RequestOutputCollector: what a slow consumer missed comes folded into one output; an
    end or an error queued behind it is not lost."""
    stream, owner = _stream(RequestOutputKind.DELTA)
    for i, text in enumerate(["Hel", "lo", ","]):
        stream.queue.put_nowait(_delta(0, text, 10 + i))
    stream.queue.put_nowait(None)  # the end of an aborted stream
    first = await stream.__anext__()
    assert (first.outputs[0].text, first.outputs[0].token_ids) == ("Hello,", [10, 11, 12])
    assert not first.finished
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    assert owner.calls == [("r", False)]

    stream, _ = _stream(RequestOutputKind.DELTA)
    stream.queue.put_nowait(_delta(0, "a", 1))
    stream.queue.put_nowait(_delta(0, "b", 2, finish="length"))
    stream.queue.put_nowait(RuntimeError("never reached"))
    last = await stream.__anext__()
    assert (last.outputs[0].text, last.outputs[0].finish_reason, last.finished) == ("ab", "length", True)

    stream, _ = _stream(RequestOutputKind.DELTA)
    stream.queue.put_nowait(_delta(0, "a", 1))
    stream.queue.put_nowait(ValueError("step failed"))
    assert (await stream.__anext__()).outputs[0].text == "a"
    with pytest.raises(ValueError, match="step failed"):
        await stream.__anext__()


async def test_a_cumulative_stream_behind_gets_the_latest_output() -> None:
    stream, _ = _stream(RequestOutputKind.CUMULATIVE)
    stream.queue.put_nowait(_delta(0, "a", 1))
    stream.queue.put_nowait(_delta(0, "ab", 2))
    assert (await stream.__anext__()).outputs[0].text == "ab"
