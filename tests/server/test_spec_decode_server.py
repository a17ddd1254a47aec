"""A real `pagedserve serve --speculative-config ...` process, by n-gram and by a draft model (the embedded
model drafting for itself): greedy completions (whole and streamed) identical to the engine without
speculation, and vLLM's spec-decode counters in /metrics. Both serve the float32 weights: in gguf mode a
batch's row count picks the kernel (kernels/cpu.py ``GGUF_DENSE_ROWS``), so a verification batch of k + 1
rows rounds differently from a one-row decode step, as any engine whose kernels depend on the shape."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from pagedserve import LLM, SamplingParams, default_model
from pagedserve.testing.processes import ServerProcess, float_model_args, serve_process

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SPECS = {
    "ngram": NGRAM,
    "draft": {"method": "draft_model", "model": str(default_model()), "num_speculative_tokens": 4},
}
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "Copy this list exactly: apples, pears, plums, cherries, grapes, lemons.\nCopy: apples, pears,",
    "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n",
    "Tell me about your favourite season.",
]
MAX_TOKENS = 40


# The draft model's server runs under `make test-heavy`.
DRAFT_HEAVY = [pytest.param(name, marks=[pytest.mark.heavy] if name == "draft" else []) for name in SPECS]


@pytest.fixture(scope="module", params=DRAFT_HEAVY)
def spec(request: pytest.FixtureRequest) -> dict:
    return SPECS[request.param]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, spec: dict) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with serve_process(log, *float_model_args(), "--max-model-len", "512", "--speculative-config",
                       json.dumps(spec)) as srv:
        srv.wait_ready(240)
        yield srv


@pytest.fixture(scope="module")
def expected() -> list[tuple[str, int]]:
    """Each prompt's greedy text and token count from an engine without speculation."""
    llm = LLM(str(default_model()))
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in outputs]


def metric_samples(server: ServerProcess, name: str) -> dict[str, float]:
    """Every sample of ``name``: its label text -> value."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {line.split("{", 1)[1].rsplit("}", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(name + "{")}


def test_greedy_completions_match_the_engine_without_speculation(
    server: ServerProcess, expected: list[tuple[str, int]]
) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    for prompt, (want_text, num_tokens) in zip(PROMPTS, expected, strict=True):
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          logprobs=0)
        streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True)
        text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
        assert whole.choices[0].text == text == want_text
        assert whole.usage is not None and whole.usage.completion_tokens == num_tokens
        assert whole.choices[0].logprobs is not None
        assert len(whole.choices[0].logprobs.tokens or []) == num_tokens


def test_version_shows_the_speculative_config(server: ServerProcess, spec: dict) -> None:
    shown = httpx.get(f"{server.url}/version", timeout=10).json()["speculative_config"]
    assert {k: shown[k] for k in spec} == spec


def test_spec_decode_metrics(server: ServerProcess) -> None:
    drafts = metric_samples(server, "vllm:spec_decode_num_drafts_total")
    draft_tokens = metric_samples(server, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric_samples(server, "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = metric_samples(server, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    (num_drafts,), (num_draft_tokens,) = drafts.values(), draft_tokens.values()
    (num_accepted,) = accepted.values()
    assert 0 < num_drafts <= num_draft_tokens <= 4 * num_drafts
    assert 0 < num_accepted <= num_draft_tokens
    assert len(per_pos) == 4 and all(f'position="{p}"' in "".join(per_pos) for p in range(4))
    by_position = [v for _, v in sorted(per_pos.items(), key=lambda kv: kv[0].split('position="')[1])]
    assert sum(by_position) == num_accepted
    assert by_position == sorted(by_position, reverse=True)  # position i+1 is accepted only after i
