"""One validation: the offline LLM and the HTTP server refuse the same bad input with the same message,
param and code, because both go through server/engine/processor.py (and SamplingParams)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from pagedserve.server.exceptions import InvalidRequestError

from pagedserve import LLM, SamplingParams, default_model

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(default_model()), max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS)


CASES = [
    pytest.param([], {}, id="empty-prompt"),
    pytest.param([10**6], {}, id="token-out-of-vocab"),
    pytest.param([5] * MAX_MODEL_LEN, {}, id="prompt-too-long"),
    pytest.param([5] * 10, {"max_tokens": MAX_MODEL_LEN}, id="max-tokens-too-many"),
    pytest.param([5] * 10, {"stop_token_ids": [-1]}, id="stop-token-id"),
    pytest.param([5] * 10, {"logit_bias": {999999: 5.0}}, id="logit-bias-id"),
    pytest.param([5] * 10, {"allowed_token_ids": [5, 999999]}, id="allowed-token-id"),
    pytest.param([5] * 10, {"allowed_token_ids": []}, id="allowed-token-ids-empty"),
    pytest.param([5] * 10, {"bad_words": ["fine", " "]}, id="bad-words-blank"),
    pytest.param([5] * 10, {"n": MAX_NUM_SEQS + 1}, id="n-over-max-num-seqs"),
    pytest.param([5] * 10, {"max_tokens": 2, "min_tokens": 5}, id="min-over-max-tokens"),
]


@pytest.mark.parametrize(("prompt_ids", "fields"), CASES)
async def test_llm_and_server_refuse_alike(
    llm: LLM, client: httpx.AsyncClient, prompt_ids: list[int], fields: dict[str, Any]
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(**fields))
    response = await client.post("/v1/completions", json={"prompt": prompt_ids, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    expected = refused.value
    assert (error["message"], error["param"], error["code"]) == (
        expected.message,
        expected.param,
        expected.code,
    )
    assert isinstance(expected, ValueError) and expected.param
