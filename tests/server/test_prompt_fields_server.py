"""The prompt-side vLLM fields through a real `pagedserve serve` and the official openai client: echo with
logprobs (lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0) equal to HF
Transformers on the same weights, prompt_logprobs on completion choices and beside chat choices, and
cache_salt in the usage's cached tokens."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedserve import default_model
from pagedserve.testing.processes import ServerProcess, float_model_args, serve_process

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ATOL = 2e-3  # fp32 on CPU, our kernels vs HF's eager attention
PROMPT = "The quick brown fox jumps over the lazy dog. Then it runs into the forest and disappears."
LONG = "A long shared prefix that several tenants send, spanning many KV blocks of sixteen tokens. " * 5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with serve_process(log, *float_model_args(), "--max-model-len", "512") as srv:
        srv.wait_ready(240)
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    return AutoTokenizer.from_pretrained(str(default_model())).encode(PROMPT)


@pytest.fixture(scope="module")
def hf_logprobs(prompt_ids: list[int]) -> torch.Tensor:
    """HF's log-softmax at each prompt position ``[len, vocab]``."""
    model = AutoModelForCausalLM.from_pretrained(str(default_model()), dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)


def hf_token_logprobs(prompt_ids: list[int], hf_logprobs: torch.Tensor) -> list[float]:
    return [float(hf_logprobs[i, token]) for i, token in enumerate(prompt_ids[1:])]


def test_echo_logprobs_with_max_tokens_zero_match_hf(
    client: openai.OpenAI, prompt_ids: list[int], hf_logprobs: torch.Tensor
) -> None:
    """lm-evaluation-harness's loglikelihood request: only the prompt comes back, with its logprobs."""
    result = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0, temperature=0
    )
    choice = result.choices[0]
    assert choice.text == PROMPT
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.token_logprobs) == len(prompt_ids) and logprobs.token_logprobs[0] is None
    assert "".join(logprobs.tokens) == PROMPT
    expected = hf_token_logprobs(prompt_ids, hf_logprobs)
    assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=ATOL)
    assert logprobs.top_logprobs is not None and logprobs.top_logprobs[0] is None
    assert all(top is not None and len(top) >= 2 for top in logprobs.top_logprobs[1:])
    assert result.usage is not None and result.usage.prompt_tokens == len(prompt_ids)


def test_echo_logprobs_then_the_completion_streamed_or_not(
    client: openai.OpenAI, prompt_ids: list[int], hf_logprobs: torch.Tensor
) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 4}
    choice = client.completions.create(temperature=0, **kwargs).choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == len(prompt_ids) + 4
    assert logprobs.token_logprobs[0] is None and None not in logprobs.token_logprobs[1:]
    assert logprobs.token_logprobs[1 : len(prompt_ids)] == pytest.approx(
        hf_token_logprobs(prompt_ids, hf_logprobs), abs=ATOL
    )
    streamed_logprobs: list[float | None] = []
    streamed_text = ""
    for chunk in client.completions.create(temperature=0, stream=True, **kwargs):
        for streamed in chunk.choices:
            streamed_text += streamed.text
            if streamed.logprobs is not None and streamed.logprobs.token_logprobs is not None:
                streamed_logprobs += streamed.logprobs.token_logprobs
    assert streamed_text == choice.text
    assert streamed_logprobs[0] is None and streamed_logprobs[1:] == pytest.approx(
        logprobs.token_logprobs[1:], abs=1e-4
    )


def test_prompt_logprobs_on_completion_and_chat(
    client: openai.OpenAI, prompt_ids: list[int], hf_logprobs: torch.Tensor
) -> None:
    choice = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 3}
    ).choices[0]
    prompt_logprobs = choice.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for position, (token_id, entry) in enumerate(zip(prompt_ids[1:], prompt_logprobs[1:], strict=True)):
        assert len(entry) >= 3
        want = float(hf_logprobs[position, token_id])
        assert entry[str(token_id)]["logprob"] == pytest.approx(want, abs=ATOL)
        assert all({"logprob", "rank", "decoded_token"} == set(lp) for lp in entry.values())

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    chat_logprobs = chat.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert chat.usage is not None and len(chat_logprobs) == chat.usage.prompt_tokens
    assert chat_logprobs[0] is None and all(len(entry) == 1 for entry in chat_logprobs[1:])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": PROMPT, "max_tokens": 0}, None),
        ({"prompt": PROMPT, "cache_salt": ""}, None),
    ],
)
def test_prompt_fields_refused(server: ServerProcess, body: dict[str, Any], param: str | None) -> None:
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param is None or error["param"] == param


def test_cache_salt_separates_cached_prefixes(client: openai.OpenAI) -> None:
    def cached(salt: str) -> int:
        result = client.completions.create(
            model=MODEL, prompt=LONG, max_tokens=1, extra_body={"cache_salt": salt}
        )
        details = result.usage.prompt_tokens_details if result.usage else None
        assert details is not None and details.cached_tokens is not None
        return details.cached_tokens

    first = cached("tenant-a")
    assert cached("tenant-a") > first
    assert cached("tenant-b") == 0
