"""The engine on the embedded model: greedy parity with HF Transformers under every scheduling regime,
prefix caching, sampling semantics, bad input, and no leaked blocks after any of it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pagedserve.kernels import reference
from pagedserve.server.engine.llm_engine import StepError

from pagedserve import LLM, SamplingParams
from pagedserve.testing.leaks import assert_no_leak

NEW_TOKENS = 32
TEXT = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines were "
    "programmed by rewiring panels; later, stored programs let the same hardware run different tasks. "
    "Compilers, operating systems and networks each hid a layer of detail so that people could think "
    "about bigger problems. "
)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    """Eight prompts from 1 to over 300 tokens."""
    long_ids = llm.get_tokenizer().encode(TEXT * 8)
    assert len(long_ids) > 310
    lengths = [1, 5, 17, 40, 64, 121, 200, 310]
    return [long_ids[i * 3 : i * 3 + n] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def hf_greedy(model_path: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    model.eval()
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
            )
            results.append(out[0, len(ids):].tolist())
    return results


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


def run_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_batch_matches_hf(llm: LLM, prompts: list[list[int]], hf_greedy: list[list[int]]) -> None:
    assert run_greedy(llm, prompts) == hf_greedy
    assert_no_leak(llm.engine)


def test_greedy_one_by_one_matches_hf(llm: LLM, prompts: list[list[int]], hf_greedy: list[list[int]]) -> None:
    llm.engine.core.kv.pool.reset_prefix_cache()
    for ids, expected in zip(prompts, hf_greedy, strict=True):
        assert run_greedy(llm, [ids]) == [expected]
    assert_no_leak(llm.engine)


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({"max_num_batched_tokens": 64}, id="chunked-64"),
        pytest.param({"enable_prefix_caching": False}, id="no-prefix-cache"),
        # 40 blocks of 16 hold ~2 of the longer sequences at once: the rest must be preempted.
        pytest.param({"num_gpu_blocks_override": 40, "max_model_len": 640}, id="preemption"),
    ],
)
def test_greedy_under_scheduling_regimes(
    model_path: str, prompts: list[list[int]], hf_greedy: list[list[int]], engine_args: dict[str, Any]
) -> None:
    llm = LLM(model_path, **engine_args)
    assert run_greedy(llm, prompts) == hf_greedy
    if "num_gpu_blocks_override" in engine_args:
        assert llm.engine.core.scheduler.num_preemptions > 0
    assert_no_leak(llm.engine)


def test_greedy_with_the_pure_torch_backend(
    model_path: str, prompts: list[list[int]], hf_greedy: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The references alone (the oracle of the C++ and Triton kernels) give the same tokens too."""
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "torch")
    llm = LLM(model_path)
    assert llm.engine.core.executor.runner.model.attention_layers()[0].kernels is reference
    assert run_greedy(llm, prompts) == hf_greedy


@pytest.fixture
def computed_tokens(llm: LLM) -> Iterator[list[int]]:
    """Tokens the model actually runs per step, recorded around the runner."""
    runner = llm.engine.core.executor.runner
    original = runner.launch
    counts: list[int] = []

    def recording(scheduled: Any, block_ids: Any, *rest: Any) -> Any:
        counts.append(sum(s.num_new_tokens for s in scheduled))
        return original(scheduled, block_ids, *rest)

    runner.launch = recording  # type: ignore[method-assign]
    yield counts
    runner.launch = original  # type: ignore[method-assign]


def test_shared_prefix_is_served_from_cache(llm: LLM, prompts: list[list[int]],
                                            computed_tokens: list[int]) -> None:
    prefix = prompts[-1][:200]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate({"prompt_token_ids": [*prefix, 11, 12, 13]}, params)
    computed_tokens.clear()
    (second,) = llm.generate({"prompt_token_ids": [*prefix, 21, 22, 23, 24]}, params)
    assert second.num_cached_tokens >= 192
    assert sum(computed_tokens) == 204 - second.num_cached_tokens
    assert_no_leak(llm.engine)


def test_parallel_samples_share_prompt_blocks(llm: LLM, prompts: list[list[int]]) -> None:
    engine = llm.engine
    engine.core.kv.pool.reset_prefix_cache()
    prompt = prompts[-1]
    engine.add_request("shared", {"prompt_token_ids": prompt}, SamplingParams(n=3, max_tokens=4, seed=1))
    engine.step()
    block_sets = [set(engine.core.kv.block_ids(f"shared#{i}")) for i in range(3)]
    shared = block_sets[0] & block_sets[1] & block_sets[2]
    assert len(shared) == len(prompt) // 16
    while engine.has_unfinished():
        engine.step()
    assert_no_leak(engine)


def test_seeds_top_k_stop_and_length(llm: LLM, prompts: list[list[int]]) -> None:
    prompt = {"prompt_token_ids": prompts[3]}

    def sample(**kwargs: Any) -> Any:
        return llm.generate(prompt, SamplingParams(max_tokens=24, **kwargs))[0].outputs[0]

    a, b, c = (sample(temperature=1.0, seed=seed) for seed in (7, 7, 8))
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    greedy = sample(temperature=0.0, min_tokens=24)
    assert sample(temperature=1.0, top_k=1, min_tokens=24).token_ids == greedy.token_ids
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 24
    word = greedy.text.split()[2]
    stopped = sample(temperature=0.0, stop=[word])
    assert stopped.finish_reason == "stop" and stopped.stop_reason == word
    assert word not in stopped.text and greedy.text.startswith(stopped.text)
    with_stop = sample(temperature=0.0, stop=[word], include_stop_str_in_output=True)
    assert with_stop.text.endswith(word)
    assert_no_leak(llm.engine)


def test_n_samples_and_logprobs(llm: LLM) -> None:
    (out,) = llm.generate("Once upon a time", SamplingParams(n=2, max_tokens=8, seed=3, logprobs=3))
    assert [c.index for c in out.outputs] == [0, 1]
    for completion in out.outputs:
        assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
        for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            assert token_id in entry and len(entry) >= 3
            assert all(lp.logprob <= 0.0 for lp in entry.values())
    assert_no_leak(llm.engine)


def test_answers_paris(llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    (out,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=24))
    assert "Paris" in out.outputs[0].text


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: ("", SamplingParams()), "prompt"),
        (lambda: ({"prompt_token_ids": [5] * 9000}, SamplingParams()), "max_model_len"),
        (lambda: ("hi", SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda: ("hi", SamplingParams(temperature=-0.5)), "temperature"),
        (lambda: ("hi", SamplingParams(top_p=0.0)), "top_p"),
        (lambda: ("hi", SamplingParams(top_p=1.5)), "top_p"),
        (lambda: ("hi", SamplingParams(n=0)), "n"),
    ],
)
def test_bad_input_is_a_value_error_and_engine_keeps_serving(llm: LLM, make: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        prompt, params = make()
        llm.generate(prompt, params)
    (ok,) = llm.generate("Hello", SamplingParams(max_tokens=2))
    assert len(ok.outputs[0].token_ids) >= 1
    assert_no_leak(llm.engine)


def test_unknown_model_names_it() -> None:
    with pytest.raises((ValueError, FileNotFoundError), match="no-such-org/no-such-model"):
        LLM("no-such-org/no-such-model")


def test_abort_mid_run_frees_blocks(llm: LLM, prompts: list[list[int]]) -> None:
    engine = llm.engine
    for i, ids in enumerate(prompts):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=12))
    for _ in range(3):
        engine.step()
    for i in range(0, len(prompts), 2):
        engine.abort_request(f"abort-{i}")
    while engine.has_unfinished():
        engine.step()
    assert_no_leak(engine)


def test_failed_step_aborts_its_batch_and_engine_goes_on(llm: LLM) -> None:
    engine = llm.engine
    original = engine.core.executor.runner.launch

    def broken(*args: Any) -> Any:
        raise RuntimeError("injected failure")

    engine.add_request("doomed", "A doomed request", SamplingParams(max_tokens=4))
    engine.core.executor.runner.launch = broken  # type: ignore[method-assign]
    try:
        with pytest.raises(StepError) as info:
            engine.step()
    finally:
        engine.core.executor.runner.launch = original  # type: ignore[method-assign]
    assert info.value.request_ids == ["doomed"]
    assert_no_leak(engine)
    (ok,) = llm.generate("Hello again", SamplingParams(max_tokens=3))
    assert ok.finished
