"""Async scheduling (server/core/scheduler.py ``schedule_ahead``, server/engine/core.py): the next decode
step is launched before the last one's tokens are read back. On the CPU the device is the host, so this
gains nothing here; it is the same code a GPU runs, and these tests check it changes no output, loses
no block and stops where it must, by running every case with it off and on."""

from __future__ import annotations

from typing import Any

import pytest
from pagedserve.server.engine.llm_engine import StepError

from pagedserve import LLM, SamplingParams
from pagedserve.testing.leaks import assert_no_leak

TEXT = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill. " * 6


def make_llm(model_path: str, async_scheduling: bool, **engine_args: Any) -> LLM:
    llm = LLM(model_path, async_scheduling=async_scheduling, **engine_args)
    assert llm.engine.core.async_scheduling is async_scheduling
    return llm


@pytest.fixture(scope="module")
def both(model_path: str) -> dict[bool, LLM]:
    """The embedded model twice: async scheduling off and on."""
    return {mode: make_llm(model_path, mode) for mode in (False, True)}


@pytest.fixture(scope="module")
def prompts(both: dict[bool, LLM]) -> list[list[int]]:
    ids = both[False].get_tokenizer().encode(TEXT)
    return [ids[i : i + n] for i, n in enumerate([1, 4, 9, 23, 40, 77])]


def outputs(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple[Any, ...]]:
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_no_leak(llm.engine)
    return [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason, o.outputs[0].text,
         o.outputs[0].logprobs)
        for o in results
    ]


def mixed_params(eos: int) -> list[SamplingParams]:
    """Greedy and seeded sampling, logprobs, lengths ending at different steps, a stop token, a stop
    string, EOS reached on the way, and a penalty (whose rows keep the step synchronous)."""
    return [
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=17, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24),
        SamplingParams(temperature=0.0, max_tokens=30, stop=[" the"]),
        SamplingParams(temperature=1.0, seed=3, max_tokens=40, stop_token_ids=[eos]),
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3),
    ]


def test_outputs_equal_with_and_without(both: dict[bool, LLM], prompts: list[list[int]]) -> None:
    eos = both[False].get_tokenizer().eos_token_id
    params = mixed_params(eos)
    before = both[True].engine.core.scheduler.num_steps_ahead
    assert outputs(both[True], prompts, params) == outputs(both[False], prompts, params)
    assert both[True].engine.core.scheduler.num_steps_ahead > before
    assert both[False].engine.core.scheduler.num_steps_ahead == 0


def test_every_row_runs_ahead_without_history_dependent_parameters(
    both: dict[bool, LLM], prompts: list[list[int]]
) -> None:
    """All greedy, one length: after the prompts every step is scheduled ahead but the last."""
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * len(prompts)
    scheduler = both[True].engine.core.scheduler
    before = scheduler.num_steps_ahead
    assert outputs(both[True], prompts, params) == outputs(both[False], prompts, params)
    assert scheduler.num_steps_ahead - before == 20 - 2  # the first decode is launched, then 18 ahead


def test_greedy_matches_under_chunking_and_preemption(model_path: str, prompts: list[list[int]]) -> None:
    """Few blocks: the scheduler preempts, which only the synchronous path does; the steps ahead stop
    where the blocks run out and the outputs still equal the synchronous engine's."""
    args = {"num_gpu_blocks_override": 12, "max_num_batched_tokens": 32, "max_model_len": 192}
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)] * len(prompts)
    results, preemptions = {}, {}
    for mode in (False, True):
        llm = make_llm(model_path, mode, **args)
        results[mode] = outputs(llm, prompts, params)
        preemptions[mode] = llm.engine.core.scheduler.num_preemptions
        llm.shutdown()
    assert results[True] == results[False]
    assert preemptions[True] > 0


def test_abort_while_a_step_is_in_flight(both: dict[bool, LLM], prompts: list[list[int]]) -> None:
    engine = both[True].engine
    for i, ids in enumerate(prompts):
        engine.add_request(f"inflight-{i}", {"prompt_token_ids": ids},
                           SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    while engine.core.in_flight is None:
        engine.step()
    for i in range(0, len(prompts), 2):
        engine.abort_request(f"inflight-{i}")
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert sorted(finished) == [f"inflight-{i}" for i in range(1, len(prompts), 2)]
    assert all(len(tokens) == 30 for tokens in finished.values())
    assert_no_leak(engine)


def test_a_request_arriving_mid_decode_waits_for_the_step_in_flight(
    both: dict[bool, LLM], prompts: list[list[int]]
) -> None:
    """A new request stops the run ahead (the ordinary scheduler admits it), and nothing changes."""
    results = {}
    for mode, llm in both.items():
        engine = llm.engine
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        engine.add_request("first", {"prompt_token_ids": prompts[3]}, greedy)
        tokens: dict[str, list[int]] = {"first": [], "late": []}
        for step in range(40):
            if step == 6:
                engine.add_request("late", {"prompt_token_ids": prompts[4]}, greedy)
            for output in engine.step():
                tokens[output.request_id] = output.outputs[0].token_ids
            if not engine.has_unfinished():
                break
        results[mode] = tokens
        assert_no_leak(engine)
    assert results[True] == results[False]
    assert len(results[True]["late"]) == 16


def test_a_failed_step_ahead_fails_its_requests_and_the_engine_goes_on(
    both: dict[bool, LLM], prompts: list[list[int]]
) -> None:
    engine = both[True].engine
    runner = engine.core.executor.runner
    original = runner.launch
    engine.add_request("doomed", {"prompt_token_ids": prompts[2]},
                       SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    while engine.core.in_flight is None:
        engine.step()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected failure")

    runner.launch = broken  # type: ignore[method-assign]
    try:
        with pytest.raises(StepError) as info:
            engine.step()
    finally:
        runner.launch = original  # type: ignore[method-assign]
    assert info.value.request_ids == ["doomed"]
    assert_no_leak(engine)
    (ok,) = both[True].generate("Hello again", SamplingParams(max_tokens=3))
    assert ok.finished
