"""prompt_logprobs on the embedded model: equal to HF Transformers' log-softmax of the prompt's logits,
whole, in chunks, after preemption, and never served from the prefix cache."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pagedserve.server.engine.core_output import EngineCoreOutput
from pagedserve.server.engine.output_processor import OutputProcessor
from pagedserve.server.outputs import RequestMetrics, RequestOutput, SampledToken
from pagedserve.server.sampling_params import RequestOutputKind

from pagedserve import LLM, SamplingParams

TOP_K = 3
ATOL = 2e-3  # fp32 on CPU, our kernels vs HF's eager attention
TEXT = (
    "Rivers carve valleys over millions of years; the water finds the softest rock and follows it, "
    "while floods move boulders that a quiet summer stream could never shift. "
)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    ids = llm.get_tokenizer().encode(TEXT * 4)
    return [ids[:150], ids[7:60], ids[20:21], ids[3:120]]


@pytest.fixture(scope="module")
def hf_logprobs(model_path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, HF's log-softmax at every position ``[len, vocab]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1) for ids in prompts]


def assert_matches_hf(output: RequestOutput, ids: list[int], expected: torch.Tensor) -> None:
    got = output.prompt_logprobs
    assert got is not None and len(got) == len(ids) and got[0] is None
    for position, (token_id, entry) in enumerate(zip(ids[1:], got[1:], strict=True)):
        assert entry is not None
        row = expected[position]
        want = float(row[token_id])
        assert entry[token_id].logprob == pytest.approx(want, abs=ATOL)
        rank = entry[token_id].rank  # HF's rank, give or take tokens within ATOL of this one
        assert rank is not None
        assert int((row > want + ATOL).sum()) < rank <= int((row > want - ATOL).sum()) + 1
        top = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= TOP_K),
                     key=lambda lp: lp.rank or 0)
        assert len(top) == TOP_K and all(lp.decoded_token is not None for lp in top)
        torch.testing.assert_close(
            torch.tensor([lp.logprob for lp in top]), row.topk(TOP_K).values, atol=ATOL, rtol=0
        )


def generate(llm: LLM, prompts: list[list[int]], **kwargs: Any) -> list[RequestOutput]:
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 2, "prompt_logprobs": TOP_K, **kwargs})
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def test_prompt_logprobs_match_hf(
    llm: LLM, prompts: list[list[int]], hf_logprobs: list[torch.Tensor]
) -> None:
    for output, ids, expected in zip(generate(llm, prompts), prompts, hf_logprobs, strict=True):
        assert_matches_hf(output, ids, expected)
    assert prompts[2] and len(prompts[2]) == 1  # a one-token prompt has only the leading None


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({"max_num_batched_tokens": 32}, id="chunked-32"),
        # 14 blocks of 16 tokens cannot hold the four prompts and their outputs at once: some are preempted.
        pytest.param({"num_gpu_blocks_override": 14, "max_model_len": 200}, id="preemption"),
    ],
)
def test_prompt_logprobs_across_steps(
    model_path: str, prompts: list[list[int]], hf_logprobs: list[torch.Tensor], engine_args: dict[str, Any]
) -> None:
    llm = LLM(model_path, **engine_args)
    outputs = generate(llm, prompts, max_tokens=40, min_tokens=40)
    for output, ids, expected in zip(outputs, prompts, hf_logprobs, strict=True):
        assert_matches_hf(output, ids, expected)
    if "num_gpu_blocks_override" in engine_args:
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_prompt_logprobs_skip_prefix_cache_hits(
    llm: LLM, prompts: list[list[int]], hf_logprobs: list[torch.Tensor]
) -> None:
    """A cached prompt is still computed whole for prompt logprobs; the others keep hitting the cache."""
    ids = {"prompt_token_ids": prompts[0]}
    llm.generate(ids, SamplingParams(max_tokens=1))
    (warm,) = llm.generate(ids, SamplingParams(max_tokens=1))
    assert warm.num_cached_tokens > 0 and warm.prompt_logprobs is None
    (asked,) = generate(llm, [prompts[0]])
    assert asked.num_cached_tokens == 0
    assert_matches_hf(asked, prompts[0], hf_logprobs[0])


def test_prompt_logprobs_once_per_request_with_n(llm: LLM, prompts: list[list[int]],
                                                 hf_logprobs: list[torch.Tensor]) -> None:
    (output,) = generate(llm, [prompts[1]], n=3, seed=1, temperature=1.0)
    assert len(output.outputs) == 3
    assert_matches_hf(output, prompts[1], hf_logprobs[1])
    core = llm.engine.core
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks


def test_prompt_logprobs_bounded_like_logprobs() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_no_output_before_the_prompt_logprobs(llm: LLM) -> None:
    """A second sample that runs ahead of the first (which computes the prompt logprobs) waits for them, so
    a streamed echo never shows a choice without its prompt's logprobs; they come once, then deltas."""
    engine = llm.engine
    params = SamplingParams(n=2, max_tokens=4, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA)
    outputs = OutputProcessor(engine.tokenizer)
    outputs.add_request(engine.process_inputs("r", {"prompt_token_ids": [11, 12, 13]}, params))
    prompt_logprobs = [SampledToken(12, -1.0, 1, [12], [-1.0]), SampledToken(13, -2.0, 2, [7], [-0.5])]

    def step(*core_outputs: EngineCoreOutput) -> list[RequestOutput]:
        return outputs.process_outputs(list(core_outputs)).request_outputs

    def token(core_id: str, token_id: int, **kwargs: Any) -> EngineCoreOutput:
        return EngineCoreOutput(core_id, [token_id], None, None, None, 0, RequestMetrics(0.0), **kwargs)

    assert step(token("r#1", 42)) == []
    (first,) = step(token("r#0", 43, prompt_logprobs=prompt_logprobs))
    assert first.prompt_logprobs is not None and first.prompt_logprobs[0] is None
    assert first.prompt_logprobs[2] is not None and set(first.prompt_logprobs[2]) == {13, 7}
    assert sorted(c.index for c in first.outputs) == [0, 1]
    (second,) = step(token("r#0", 44), token("r#1", 45))
    assert second.prompt_logprobs is None and len(second.outputs) == 2
