"""Prefill/decode disaggregation between tensor-parallel engines (issue 41: the KV moves per rank): a
prefill engine and a decode engine of the embedded model's float weights, each over 3 ranks (each core in
a process of its own, since one process holds one torch.distributed group), give one rank's greedy
tokens; every decode rank reads its shard of the blocks from the prefill rank of its number. A decode
engine split otherwise (one rank) cannot read them and computes the prompt: the same tokens, a failed
read counted."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from pagedserve.server.sampling_params import SamplingParams

from pagedserve import LLM, default_model

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda (pagedserve[pd])",
                    exc_type=ImportError)
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20}
PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n",
    "Tide tables list, for every harbour along the coast, the times at which the water",
]


def connector(role: str) -> str:
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role, "kv_port": 0})


@pytest.fixture(scope="module")
def prefill() -> Iterator[LLM]:
    llm = LLM(str(default_model()), core_process=True, tensor_parallel_size=3,
              kv_transfer_config=connector("kv_producer"), **ENGINE)
    yield llm
    llm.shutdown()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, **kw)


def prefill_params(prefill: LLM) -> list[dict]:
    outputs = prefill.generate(PROMPTS, greedy(kv_transfer_params={"do_remote_decode": True}))
    params = [o.kv_transfer_params for o in outputs]
    assert all(p is not None and len(p["remote_ranks"]) == 3 for p in params)
    return params  # type: ignore[return-value]


def decode_tokens(decode: LLM, params: list[dict]) -> list[list[int]]:
    outputs = decode.generate(PROMPTS, [greedy(kv_transfer_params=p) for p in params])
    return [o.outputs[0].token_ids for o in outputs]


def one_rank() -> list[list[int]]:
    llm = LLM(str(default_model()), **ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]


def test_three_rank_engines_move_each_ranks_shard(prefill: LLM) -> None:
    decode = LLM(str(default_model()), core_process=True, tensor_parallel_size=3,
                 kv_transfer_config=connector("kv_consumer"), **ENGINE)
    try:
        assert decode_tokens(decode, prefill_params(prefill)) == one_rank()
        transfer = decode.engine.stats().kv_transfer
        assert transfer is not None and transfer.num_transfers == len(PROMPTS) and transfer.num_failed == 0
        assert transfer.hits > 0
    finally:
        decode.shutdown()


def test_a_decode_engine_split_otherwise_computes_the_prompt(prefill: LLM) -> None:
    decode = LLM(str(default_model()), kv_transfer_config=connector("kv_consumer"), **ENGINE)
    assert decode_tokens(decode, prefill_params(prefill)) == one_rank()
    transfer = decode.engine.stats().kv_transfer
    assert transfer is not None and transfer.num_failed == len(PROMPTS) and transfer.bytes_received == 0
