"""Prefill/decode disaggregation in the engine (issue 41): a prefill engine keeps a finished prompt's KV
blocks and says where they are (``kv_transfer_params``); a decode engine reads them over Mooncake's
transfer engine (TCP, on this machine) and computes only the prompt's last token. Three offline engines of
the embedded model's float weights in this process: the prefill one, the decode one and a colocated one,
whose greedy tokens the pair must equal. Reads that fail, or that do not fit the prompt, fall back to
computing the prompt on the decode engine, and every held block goes back to its pool."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pagedserve.server.config import EngineConfig
from pagedserve.server.core.mooncake_connector import MooncakeConnector
from pagedserve.server.core.scheduler import Scheduler
from pagedserve.server.exceptions import InvalidRequestError
from pagedserve.server.kv_transfer_config import KVTransferConfig
from pagedserve.server.sampling_params import SamplingParams

from pagedserve import LLM
from pagedserve.testing.leaks import assert_no_leak

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda (pagedserve[pd])",
                    exc_type=ImportError)

HOLD_SECONDS = 5.0
ENGINE = {"kv_cache_memory_bytes": 48 << 20}
BLOCK = 16


def mooncake_of(scheduler: Scheduler) -> MooncakeConnector:
    connector = scheduler.connector.find(MooncakeConnector)
    assert connector is not None
    return connector


def connector(role: str) -> str:
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role, "kv_port": 0,
                       "kv_connector_extra_config": {"hold_seconds": HOLD_SECONDS}})


@pytest.fixture(scope="module")
def prefill(model_path: str) -> Iterator[LLM]:
    llm = LLM(model_path, kv_transfer_config=connector("kv_producer"), **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def decode(model_path: str) -> Iterator[LLM]:
    llm = LLM(model_path, kv_transfer_config=connector("kv_consumer"), **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def colocated(model_path: str) -> LLM:
    return LLM(model_path, **ENGINE)


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def prompt_of(llm: LLM, num_tokens: int, seed: int) -> list[int]:
    """A prompt of exactly ``num_tokens`` ids: plain words, so the model's continuation is ordinary."""
    text = " ".join(f"word{seed}x{i} is the number {i}," for i in range(200))
    return llm.get_tokenizer()(text)["input_ids"][:num_tokens]


def prefill_params(prefill: LLM, prompts: list[list[int]]) -> list[dict[str, Any]]:
    outputs = prefill.generate([{"prompt_token_ids": p} for p in prompts],
                               greedy(1, kv_transfer_params={"do_remote_decode": True}))
    params = [o.kv_transfer_params for o in outputs]
    assert all(p is not None and p["do_remote_prefill"] for p in params)
    return params  # type: ignore[return-value]


def decoded(decode: LLM, prompts: list[list[int]], params: list[dict[str, Any]], max_tokens: int) -> list:
    sampling = [greedy(max_tokens, kv_transfer_params=p) for p in params]
    outputs = decode.generate([{"prompt_token_ids": p} for p in prompts], sampling)
    return [o.outputs[0].token_ids for o in outputs]


def colocated_tokens(colocated: LLM, prompts: list[list[int]], max_tokens: int) -> list:
    return [o.outputs[0].token_ids for o in colocated.generate([{"prompt_token_ids": p} for p in prompts],
                                                                greedy(max_tokens))]


def wait_released(prefill: LLM, timeout: float = 10.0) -> None:
    """The prefill engine frees what its reader released (offline, nothing steps it: free by hand)."""
    scheduler = prefill.engine.core.scheduler
    deadline = time.monotonic() + timeout
    while mooncake_of(scheduler).held and time.monotonic() < deadline:
        time.sleep(0.05)
        scheduler.free_released_kv()
    assert not mooncake_of(scheduler).held, "the prefill engine still holds blocks its reader released"


def test_decode_engine_continues_from_the_read_prompt(prefill: LLM, decode: LLM, colocated: LLM) -> None:
    # Around block edges: the last prompt token alone in its block, a full last block, one token
    lengths = [BLOCK + 1, 2 * BLOCK, 3 * BLOCK - 1, 5 * BLOCK + 7, 2, 1]
    prompts = [prompt_of(decode, n, seed) for seed, n in enumerate(lengths)]
    before = decode.engine.stats()
    tokens = decoded(decode, prompts, prefill_params(prefill, prompts), max_tokens=12)
    assert tokens == colocated_tokens(colocated, prompts, max_tokens=12)
    after = decode.engine.stats()
    transfer = after.kv_transfer
    # A one-token prompt has nothing to read: its prefill engine is told at once to free its block.
    assert transfer is not None and transfer.num_failed == 0 and transfer.num_transfers == len(prompts) - 1
    read = transfer.hits - before.kv_transfer.hits
    assert read == sum(n - 1 for n in lengths)  # every prompt token but the last came from the prefill engine
    computed = (after.prompt_tokens - before.prompt_tokens) - read - (
        after.prefix_cache_hits - before.prefix_cache_hits)
    assert computed == len(prompts)  # the decode engine computed only each prompt's last token
    assert transfer.bytes_received > 0
    wait_released(prefill)
    assert_no_leak(prefill.engine)
    assert_no_leak(decode.engine)


def test_a_decode_engine_reads_only_past_its_own_cached_prefix(prefill: LLM, decode: LLM,
                                                                colocated: LLM) -> None:
    shared = prompt_of(decode, 3 * BLOCK, seed=40)
    decode.generate([{"prompt_token_ids": shared}], greedy(1))  # now cached on the decode engine
    prompt = shared + prompt_of(decode, 2 * BLOCK + 5, seed=41)
    hits = decode.engine.stats().kv_transfer.hits
    assert decoded(decode, [prompt], prefill_params(prefill, [prompt]), 8) == \
        colocated_tokens(colocated, [prompt], 8)
    # Its first 3 blocks were its own (the last one given up for the last token's logits is not here)
    assert decode.engine.stats().kv_transfer.hits - hits == len(prompt) - 1 - 3 * BLOCK
    wait_released(prefill)


def test_a_failed_read_computes_the_prompt_on_the_decode_engine(prefill: LLM, decode: LLM,
                                                                 colocated: LLM) -> None:
    prompt = prompt_of(decode, 2 * BLOCK + 3, seed=50)
    (params,) = prefill_params(prefill, [prompt])
    # Nothing listens at the transfer session: the read fails at once (the side channel still answers)
    gone = {**params, "remote_ranks": [{**params["remote_ranks"][0], "session": "127.0.0.1:1"}]}
    failed = decode.engine.stats().kv_transfer.num_failed
    assert decoded(decode, [prompt], [gone], 8) == colocated_tokens(colocated, [prompt], 8)
    assert decode.engine.stats().kv_transfer.num_failed == failed + 1
    wait_released(prefill)  # told anyway: the prefill engine frees its blocks
    assert_no_leak(decode.engine)


def test_the_cpu_tier_and_the_transfer_connector_run_together(model_path: str, prefill: LLM,
                                                             colocated: LLM) -> None:
    """Both connectors in one engine (server/core/kv_connector.py MultiConnector): a remote prefill's
    prompt is read from the prefill engine, and a prefix the small device pool lost comes back from the
    CPU tier, each counted by its own connector, with the colocated engine's tokens."""
    block_bytes = colocated.engine.core.executor.block_bytes
    decode = LLM(model_path, kv_transfer_config=connector("kv_consumer"), num_gpu_blocks_override=12,
                 kv_offloading_size=32 * block_bytes / (1 << 30), max_model_len=8 * BLOCK)
    try:
        names = [c.name for c in decode.engine.core.scheduler.connector.connectors]
        assert names == ["mooncake", "offloading"]
        shared = prompt_of(decode, 5 * BLOCK, seed=110)
        first, second = [*shared, 11, 12], [*shared, 21, 22, 23]
        assert decoded(decode, [first], prefill_params(prefill, [first]), 4) == \
            colocated_tokens(colocated, [first], 4)
        filler = [prompt_of(decode, 6 * BLOCK, seed=111 + i) for i in range(2)]  # push shared out
        decode.generate([{"prompt_token_ids": p} for p in filler], greedy(2))
        before = decode.engine.stats()
        assert colocated_tokens(decode, [second], 4) == colocated_tokens(colocated, [second], 4)
        after = decode.engine.stats()
        assert after.kv_offload.hits - before.kv_offload.hits == 5 * BLOCK  # the tier's, not recomputed
        assert after.kv_transfer.num_transfers == 1 and after.kv_transfer.num_failed == 0
        wait_released(prefill)
        assert_no_leak(decode.engine)
    finally:
        decode.shutdown()


def test_an_fp8_cache_moves_as_it_is(model_path: str) -> None:
    """FP8 K/V blocks are read byte for byte: the pair's greedy tokens equal one FP8 engine's, and the bytes
    read are the blocks' FP8 bytes (one per element)."""
    fp8 = {**ENGINE, "kv_cache_dtype": "fp8"}
    engines = [LLM(model_path, kv_transfer_config=connector(role), **fp8)
               for role in ("kv_producer", "kv_consumer")]
    prefill, decode = engines
    try:
        alone = LLM(model_path, **fp8)
        prompts = [prompt_of(decode, n, seed=120 + n) for n in (3 * BLOCK + 2, 4 * BLOCK)]
        want = colocated_tokens(alone, prompts, 8)
        assert decoded(decode, prompts, prefill_params(prefill, prompts), 8) == want
        transfer = decode.engine.stats().kv_transfer
        blocks = sum(-(-(len(p) - 1) // BLOCK) for p in prompts)
        block_bytes = decode.engine.core.executor.block_bytes
        assert transfer.num_failed == 0 and transfer.bytes_received == blocks * block_bytes
        assert decode.engine.core.executor.kv_cache_dtype.itemsize == 1
        wait_released(prefill)
        assert_no_leak(decode.engine)
    finally:
        for llm in engines:
            llm.shutdown()


def test_cached_tokens_count_what_was_read(prefill: LLM, decode: LLM) -> None:
    """vLLM's num_cached_tokens (usage's cached_tokens) counts a connector's tokens: a read prompt's all but
    its last; a read that failed, none."""
    prompts = [prompt_of(decode, 2 * BLOCK + 3, seed=130), prompt_of(decode, 2 * BLOCK + 3, seed=131)]
    read, lost = prefill_params(prefill, prompts)
    lost = {**lost, "remote_ranks": [{**lost["remote_ranks"][0], "session": "127.0.0.1:1"}]}
    outputs = decode.generate([{"prompt_token_ids": p} for p in prompts],
                              [greedy(2, kv_transfer_params=params) for params in (read, lost)])
    assert [o.num_cached_tokens for o in outputs] == [len(prompts[0]) - 1, 0]
    wait_released(prefill)
    assert_no_leak(decode.engine)


def test_params_of_another_prompt_are_not_read(prefill: LLM, decode: LLM, colocated: LLM) -> None:
    prompt = prompt_of(decode, 2 * BLOCK, seed=60)
    (params,) = prefill_params(prefill, [prompt_of(decode, 2 * BLOCK + 1, seed=61)])
    transfers = decode.engine.stats().kv_transfer.num_transfers
    assert decoded(decode, [prompt], [params], 6) == colocated_tokens(colocated, [prompt], 6)
    assert decode.engine.stats().kv_transfer.num_transfers == transfers  # computed, not read
    wait_released(prefill)
    assert_no_leak(decode.engine)


def test_blocks_no_decode_engine_reads_are_freed_when_their_hold_ends(prefill: LLM, decode: LLM,
                                                                      colocated: LLM) -> None:
    prompt = prompt_of(prefill, 40, seed=70)
    (params,) = prefill_params(prefill, [prompt])
    scheduler = prefill.engine.core.scheduler
    assert len(mooncake_of(scheduler).held) == 1
    expired = mooncake_of(scheduler).num_expired
    time.sleep(HOLD_SECONDS + 0.2)
    scheduler.free_released_kv()
    assert mooncake_of(scheduler).num_expired == expired + 1
    assert_no_leak(prefill.engine)
    # A late decode engine is told the blocks are gone (they may be reused): it computes the prompt
    before = decode.engine.stats().kv_transfer
    assert decoded(decode, [prompt], [params], 6) == colocated_tokens(colocated, [prompt], 6)
    after = decode.engine.stats().kv_transfer
    assert after.num_failed == before.num_failed + 1 and after.bytes_received == before.bytes_received


def test_held_blocks_make_room_for_new_requests(prefill: LLM) -> None:
    """More prefills than the pool holds, none read: the oldest holds are given up (their readers would
    be told so and compute), never a request refused or stalled."""
    core = prefill.engine.core
    expired = mooncake_of(core.scheduler).num_expired
    prompts = [prompt_of(prefill, 15 * BLOCK, seed=90 + i) for i in range(8)]
    assert core.kv.pool.num_blocks < 8 * 15
    assert all(p is not None for p in prefill_params(prefill, prompts))
    held = mooncake_of(core.scheduler).held
    assert mooncake_of(core.scheduler).num_expired - expired == 8 - len(held) > 0
    for request_id in list(held):  # released as a decode engine would
        core.kv.release(held.pop(request_id).blocks)
    assert_no_leak(prefill.engine)


def test_an_aborted_or_stopped_prefill_holds_nothing_beyond_its_answer(prefill: LLM) -> None:
    # A prefill request that asks for more than one token still holds its blocks once (the router asks 1)
    outputs = prefill.generate([{"prompt_token_ids": prompt_of(prefill, 20, seed=80)}],
                               greedy(3, kv_transfer_params={"do_remote_decode": True}))
    assert outputs[0].kv_transfer_params["remote_num_tokens"] == 20
    scheduler = prefill.engine.core.scheduler
    for request_id in list(mooncake_of(scheduler).held):  # released as a decode engine would
        scheduler.kv.release(mooncake_of(scheduler).held.pop(request_id).blocks)
    assert_no_leak(prefill.engine)


def test_a_read_copies_exactly_the_named_blocks() -> None:
    """Two transfer engines in this process: 150 blocks of 3 layers, in runs and alone, more spans than
    one batch takes; every named block lands where asked and nothing else is written."""
    from pagedserve.server.kv_transfer.mooncake_agent import MAX_SPANS_PER_BATCH, KVTransferAgent

    shape = (200, 4, 2, 8)
    source = [(torch.randn(shape), torch.randn(shape)) for _ in range(3)]
    target = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(3)]
    owner, reader = KVTransferAgent("127.0.0.1"), KVTransferAgent("127.0.0.1")
    layout = owner.register(source)
    reader.register(target)
    remote = [*range(0, 60), *range(100, 190, 2)]  # a run, then blocks apart
    local = [*range(140, 200), *range(0, 45)]  # the run stays one (one span a layer's K or V)
    assert MAX_SPANS_PER_BATCH < 2 * 3 * (1 + 45)
    assert reader.read_blocks(layout, remote, local) == len(remote) * 2 * 3 * source[0][0][0].numel() * 4
    untouched = sorted(set(range(200)) - set(local))
    for (k, v), (k_read, v_read) in zip(source, target, strict=True):
        assert torch.equal(k_read[local], k[remote]) and torch.equal(v_read[local], v[remote])
        assert not k_read[untouched].any() and not v_read[untouched].any()


# ---------------------------------------------------------------------------------- refusals and parsing
def test_malformed_params_are_a_clear_error(decode: LLM) -> None:
    prompt = {"prompt_token_ids": [1, 2, 3]}
    cases = {
        "must be an object": [1, 2],
        "do_remote_prefill needs remote_ranks": {"do_remote_prefill": True},
        "cannot both be true": {"do_remote_prefill": True, "do_remote_decode": True},
        "remote_block_ids must be a list of non-negative integers": {
            "do_remote_prefill": True, "remote_block_ids": [-1], "remote_request_id": "r",
            "remote_ranks": [{"session": "h:1", "k_addrs": [1], "v_addrs": [2], "block_bytes": 4}],
        },
        "must name the same layers": {
            "do_remote_prefill": True, "remote_block_ids": [1], "remote_request_id": "r",
            "remote_num_tokens": 3,
            "remote_ranks": [{"session": "h:1", "k_addrs": [1, 3], "v_addrs": [2], "block_bytes": 4}],
        },
    }
    for message, params in cases.items():
        with pytest.raises(InvalidRequestError, match=message) as raised:
            decode.generate([prompt], greedy(2, kv_transfer_params=params))
        assert raised.value.param == "kv_transfer_params"
    with pytest.raises(InvalidRequestError, match="needs n = 1"):
        decode.generate([prompt], SamplingParams(n=2, max_tokens=2,
                                                 kv_transfer_params={"do_remote_decode": True}))
    with pytest.raises(InvalidRequestError, match="needs a prefill engine; this one's kv_role is kv_"):
        decode.generate([prompt], greedy(2, kv_transfer_params={"do_remote_decode": True}))
    assert_no_leak(decode.engine)


def test_an_engine_without_a_connector_runs_p_d_requests_as_ordinary_ones(colocated: LLM) -> None:
    (output,) = colocated.generate([{"prompt_token_ids": [5, 6, 7]}],
                                   greedy(2, kv_transfer_params={"do_remote_decode": True}))
    assert output.kv_transfer_params is None  # the router then decodes colocated


@pytest.mark.parametrize(("config", "message"), [
    ('{"kv_connector": "NixlConnector"}', "kv_connector must be one of"),
    ('{"kv_role": "kv_decoder"}', "kv_role must be one of"),
    ('{"kv_buffer_size": 1}', "takes kv_connector, .*not kv_buffer_size"),
    ("not json", "not valid JSON"),
    ('{"kv_connector_extra_config": {"hold_seconds": 0}}', "hold_seconds must be > 0"),
])  # fmt: skip
def test_bad_kv_transfer_configs_are_refused(config: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.parse(config)


def test_a_connector_across_nodes_is_refused() -> None:
    with pytest.raises(ValueError, match=r"does not support kv_transfer_config .* across nodes"):
        EngineConfig(kv_transfer_config="{}", tensor_parallel_size=2, nnodes=2, master_port=29500)
