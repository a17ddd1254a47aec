"""The CPU KV tier (issue 21, vLLM's --kv-offloading-size): the torch-free bookkeeping
(server/core/host_tier.py; server/core/offloading_connector.py, the KV manager's connector), then the
engine on the embedded model with a device pool too small for the workload's shared prefixes: the same
greedy tokens as recompute, hits from the tier, fewer tokens computed, exact K/V after a round trip, and
no leaked blocks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pagedserve.server.config import GIB, EngineConfig
from pagedserve.server.core.host_tier import HostTier, KVTransfers
from pagedserve.server.core.kv_cache_manager import KVCacheManager
from pagedserve.server.core.kv_connector import MultiConnector
from pagedserve.server.core.kv_events import BlockStored
from pagedserve.server.core.offloading_connector import OffloadingConnector
from pagedserve.server.core.scheduler import Scheduler
from pagedserve.server.outputs import RequestMetrics
from pagedserve.server.request import Request
from pagedserve.server.sampling_params import SamplingParams

from pagedserve import LLM
from pagedserve.testing.leaks import assert_no_leak as assert_engine_clean

BLOCK = 4


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id=request_id, prompt_token_ids=tokens, params=SamplingParams(), max_tokens=8,
                   eos_token_ids=frozenset(), metrics=RequestMetrics(0.0))  # fmt: skip


class Tiered:
    """A KV manager with the CPU tier as its connector, admitting requests as the scheduler does
    (server/core/scheduler.py ``_schedule_waiting`` and ``load_kv``)."""

    def __init__(self, num_blocks: int, num_host_blocks: int, **kw: Any) -> None:
        self.tier = OffloadingConnector(num_host_blocks, BLOCK, lambda r: self.kv.full_block_hashes(r))
        self.kv = KVCacheManager(num_blocks, BLOCK, True, hash_seed="m", on_evict=self.tier.on_block_evicted,
                                 **kw)
        self.host = self.tier.tier

    def admit(self, request: Request) -> tuple[list, int] | None:
        """Schedule the whole prompt; its device hits and the tokens loaded from the tier (None: no room)."""
        cached = self.kv.find_cached_prefix(request)
        num_local = len(cached) * BLOCK
        num_external = self.tier.get_num_new_matched_tokens(request, num_local)
        if not self.kv.allocate(request, request.num_tokens - num_local, cached, cache=not num_external):
            return None
        self.tier.update_state_after_alloc(request, self.kv.block_ids(request.request_id), num_local,
                                           num_external)
        request.num_computed_tokens = request.num_tokens
        self.kv.cache_blocks(request)
        return cached, num_external

    def take_transfers(self) -> KVTransfers:
        return self.tier.build_connector_meta() or KVTransfers()


# ---------------------------------------------------------------------------------- the host tier alone
def test_host_tier_is_lru_and_bounded() -> None:
    tier = HostTier(2)
    assert tier.store(b"a", 10) and tier.store(b"b", 11)
    assert tier.take_transfers() == KVTransfers(stores=[(10, 0), (11, 1)])
    assert not tier.store(b"a", 12)  # already there: no copy, but now the most recently used
    assert tier.store(b"c", 13)  # evicts b, the least recently used
    assert b"b" not in tier and b"a" in tier and b"c" in tier
    assert tier.take_transfers().stores == [(13, 1)]
    assert len(tier.slots) == tier.num_blocks and tier.usage() == 1.0
    assert (tier.num_stored, tier.num_loaded) == (3, 0)


def test_a_block_busy_in_the_step_is_never_reused_in_it() -> None:
    tier = HostTier(2)
    tier.store(b"a", 1)
    tier.store(b"b", 2)
    tier.take_transfers()
    assert tier.pin(b"a")
    tier.load(b"a", 5)
    assert tier.store(b"c", 3)  # takes b's block: a's is read this step
    assert not tier.store(b"d", 4)  # both busy: dropped, not overwritten
    assert tier.take_transfers() == KVTransfers(stores=[(3, 1)], loads=[(0, 5)])
    assert tier.store(b"d", 4)  # a new step: the least recently used goes
    assert set(tier.slots) == {b"c", b"d"}


def test_reset_forgets_everything() -> None:
    tier = HostTier(3)
    tier.store(b"a", 1)
    tier.reset()
    assert not tier.slots and not tier.transfers and sorted(tier.free) == [0, 1, 2]


# ------------------------------------------------------------------- the tier as the KV manager's connector
def test_evicted_prefix_is_stored_then_loaded_back() -> None:
    t = Tiered(4, 8)
    first = make_request("a", list(range(9)))  # 2 full blocks + 1 token: 3 blocks
    t.admit(first)
    t.kv.free(first)
    assert not t.take_transfers()  # nothing evicted yet
    other = make_request("b", list(range(100, 116)))  # 4 blocks: evicts a's two cached blocks
    t.admit(other)
    stores = t.take_transfers().stores
    assert len(stores) == 2 and len(t.host.slots) == 2
    t.kv.free(other)
    again = make_request("c", [*range(9), 50])
    assert t.kv.find_cached_prefix(again) == []
    assert t.tier.get_num_new_matched_tokens(again, 0) == 2 * BLOCK
    assert t.tier.hits == 0  # counted once the loads are planned
    assert t.admit(again) == ([], 2 * BLOCK)
    loads = t.take_transfers().loads
    device = t.kv.block_ids("c")[:2]
    assert [d for _, d in loads] == device
    # Each block's own host copy comes back (the pool evicted, so stored, the tail first).
    assert [h for h, _ in loads] == [t.host.slots[h] for h in t.kv.req_hashes["c"][:2]]
    assert sorted(h for h, _ in loads) == sorted(h for _, h in stores)
    assert t.tier.hits == 2 * BLOCK and t.kv.prefix_hits == 0
    assert [t.kv.pool.lookup(h).block_id for h in t.kv.req_hashes["c"][:2]] == device  # device-cached again


def test_device_hits_then_host_hits_and_the_last_token_computed() -> None:
    t = Tiered(6, 8)
    prompt = list(range(12))  # 3 full blocks
    first = make_request("a", [*prompt, 99])  # 4 blocks
    t.admit(first)
    t.kv.free(first)
    t.take_transfers()
    # The pool evicts the least recently freed first; a request frees its tail first, so the head stays.
    filler = make_request("f", list(range(200, 220)))  # 5 blocks: 2 never used, a's partial one, a's 3rd, 2nd
    t.admit(filler)
    assert len(t.take_transfers().stores) == 2
    t.kv.free(filler)
    cached, num_external = t.admit(make_request("b", prompt))  # exactly 3 blocks: the last is computed
    assert len(cached) == 1 and num_external == BLOCK


def test_a_failed_allocation_plans_no_copy_and_leaks_nothing() -> None:
    t = Tiered(3, 4)
    first = make_request("a", list(range(9)))
    t.admit(first)
    t.kv.free(first)
    hog = make_request("hog", list(range(100, 112)))  # all 3 blocks: a's are stored
    t.admit(hog)
    t.take_transfers()
    again = make_request("b", [*range(8), 7])
    assert t.admit(again) is None  # no free device block for the loads
    assert not t.take_transfers() and t.kv.blocks_of("b") == [] and t.tier.hits == 0
    t.kv.free(hog)
    assert t.admit(again) == ([], 2 * BLOCK)
    assert len(t.take_transfers().loads) == 2
    t.kv.free(again)
    assert t.kv.pool.num_free_blocks == t.kv.pool.num_blocks and not t.host.busy


def test_loaded_blocks_are_stored_events_again() -> None:
    t = Tiered(3, 4, enable_kv_events=True)
    first = make_request("a", list(range(9)))
    t.admit(first)
    t.kv.free(first)
    hog = make_request("hog", list(range(100, 112)))
    t.admit(hog)
    t.kv.free(hog)
    t.kv.pool.take_events()
    t.admit(make_request("b", [*range(8), 7]))
    stored = [e for e in t.kv.pool.take_events() if isinstance(e, BlockStored)]
    assert stored and stored[0].block_hashes == t.kv.req_hashes["b"][:2]


def test_sliding_window_loads_the_prefix_then_frees_what_falls_behind() -> None:
    t = Tiered(6, 8, sliding_window=8)  # the null block takes one
    prompt = list(range(16))
    first = make_request("a", [*prompt, 1])
    t.admit(first)
    t.kv.free(first)
    hog = make_request("hog", list(range(100, 120)))  # 5 blocks: every cached block of a goes to host
    t.admit(hog)
    t.kv.free(hog)
    t.take_transfers()
    again = make_request("b", [*prompt, 2])
    assert t.admit(again) == ([], 4 * BLOCK)
    # vLLM's rule: a connector's tokens continue the device's hits, so all four blocks come back; the two
    # behind the window of the next token go back to the pool at its next allocation.
    assert len(t.take_transfers().loads) == 4
    assert t.kv.allocate(again, 1)
    assert t.kv.block_ids("b")[:2] == [t.kv.null_block.block_id] * 2


def test_reset_prefix_cache_clears_both_tiers() -> None:
    t = Tiered(3, 4)
    scheduler = Scheduler(t.kv, 4, 64, connector=MultiConnector([t.tier]))
    first = make_request("a", list(range(9)))
    t.admit(first)
    t.kv.free(first)
    t.admit(make_request("hog", list(range(100, 112))))
    assert t.host.slots
    scheduler.reset_prefix_cache()
    assert not t.host.slots and not t.kv.pool.cached


def test_prefix_caching_off_means_no_tier() -> None:
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_offloading_size=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offloading_backend"):
        EngineConfig(kv_offloading_size=1.0, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="kv_offloading_size"):
        EngineConfig(kv_offloading_size=-1.0)
    config = EngineConfig(kv_offloading_size=0.5)
    assert config.kv_offloading_backend == "native" and config.kv_offload_bytes == GIB // 2


def test_server_flags_reach_the_engine_config() -> None:
    import argparse

    from pagedserve.server.api.cli import add_arguments, engine_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    gib = engine_config(parser.parse_args(["--kv-offloading-size", "2", "--kv-offloading-backend", "native"]))
    assert gib.kv_offload_bytes == 2 * GIB and gib.kv_offloading_backend == "native"
    assert engine_config(parser.parse_args(["--kv-offload-bytes", "512MiB"])).kv_offload_bytes == 512 << 20
    assert engine_config(parser.parse_args([])).kv_offload_bytes == 0
    with pytest.raises(SystemExit):  # one size, in GiB or in bytes
        parser.parse_args(["--kv-offloading-size", "1", "--kv-offload-bytes", "1G"])


def offloading_connector(**extra: Any) -> str:
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": extra})


def test_vllm_offloading_connector_spelling_is_the_same_tier() -> None:
    import argparse

    from pagedserve.server.api.cli import add_arguments, engine_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = engine_config(parser.parse_args(
        ["--kv-transfer-config", offloading_connector(cpu_bytes_to_use=512 << 20)]))
    assert config.kv_offload_bytes == 512 << 20 and config.kv_offloading_backend == "native"
    assert config.kv_transfer_config is None  # no prefill/decode connector: the tier's setting alone
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        EngineConfig(kv_transfer_config=offloading_connector(num_cpu_blocks=10))
    one_gib = offloading_connector(cpu_bytes_to_use=GIB)
    with pytest.raises(ValueError, match="asked for twice"):
        EngineConfig(kv_offloading_size=1.0, kv_transfer_config=one_gib)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_transfer_config=one_gib, enable_prefix_caching=False)


# ------------------------------------------------------------------------------- the engine, end to end
DEVICE_BLOCKS = 24  # of 16 tokens: fewer than the workload's prefixes
HOST_BLOCKS = 64
PREFIX_TOKENS = 96  # 6 blocks each; 5 of them exceed the device pool
SUFFIX = [[11, 12, 13], [21, 22], [31, 32, 33, 34]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def block_bytes(llm: LLM) -> int:
    return llm.engine.core.executor.block_bytes


@pytest.fixture(scope="module")
def prefixes(llm: LLM) -> list[list[int]]:
    text = " ".join(f"Rule {i}: answer in the voice of character number {i}." for i in range(200))
    ids = llm.get_tokenizer().encode(text)
    assert len(ids) >= 5 * PREFIX_TOKENS
    return [ids[i * PREFIX_TOKENS : (i + 1) * PREFIX_TOKENS] for i in range(5)]


def workload(prefixes: list[list[int]]) -> list[list[int]]:
    """Every prefix, then each again twice (after the others pushed it out of the device pool)."""
    order = [0, 1, 2, 3, 4] * 3
    return [[*prefixes[p], *SUFFIX[k % 3], 40 + k] for k, p in enumerate(order)]


def make_llm(model_path: str, tier: bool, **kw: Any) -> LLM:
    """On CPU, whatever the machine: there the tier is a second pool, and blocks have a known size."""
    if tier:
        kw["kv_offloading_size"] = HOST_BLOCKS * 737_280 / GIB  # the embedded model's float32 block
    return LLM(model_path, device="cpu", num_gpu_blocks_override=DEVICE_BLOCKS, max_model_len=256, **kw)


@pytest.fixture(scope="module")
def tier_llm(model_path: str) -> LLM:
    llm = make_llm(model_path, tier=True)
    assert llm.engine.core.executor.num_host_blocks == HOST_BLOCKS
    return llm


def run_one_by_one(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids for p in prompts]


@pytest.fixture
def computed_tokens(tier_llm: LLM) -> Iterator[list[int]]:
    runner = tier_llm.engine.core.executor.runner
    original = runner.launch
    counts: list[int] = []

    def recording(scheduled: Any, *rest: Any) -> Any:
        counts.append(sum(s.num_new_tokens for s in scheduled))
        return original(scheduled, *rest)

    runner.launch = recording  # type: ignore[method-assign]
    yield counts
    runner.launch = original  # type: ignore[method-assign]


def tier_of(llm: LLM) -> OffloadingConnector:
    tier = llm.engine.core.scheduler.connector.find(OffloadingConnector)
    assert tier is not None
    return tier


def assert_no_leak(llm: LLM) -> None:
    """The engine's check (pagedserve/testing/leaks.py), and the host tier's: nothing pinned or moving."""
    assert_engine_clean(llm.engine)
    host = tier_of(llm).tier
    assert not host.busy and not host.transfers
    assert len(host.slots) <= host.num_blocks and len(set(host.slots.values())) == len(host.slots)


def test_greedy_tokens_equal_recompute_with_hits_from_the_tier(
    model_path: str, tier_llm: LLM, prefixes: list[list[int]], computed_tokens: list[int]
) -> None:
    prompts = workload(prefixes)
    recompute = make_llm(model_path, tier=False)
    expected = run_one_by_one(recompute, prompts)
    roomy = LLM(model_path, device="cpu", max_model_len=256)  # everything stays on the device
    assert run_one_by_one(roomy, prompts) == expected
    core = tier_llm.engine.core
    core.scheduler.reset_prefix_cache()
    device_hits = core.stats().prefix_cache_hits
    before = core.stats().kv_offload
    assert run_one_by_one(tier_llm, prompts) == expected
    device_hits = core.stats().prefix_cache_hits - device_hits
    after = core.stats().kv_offload
    assert after is not None and before is not None
    hits = after.hits - before.hits
    # The 10 revisits find their prefix's 6 blocks on the device or, most of them, on the host (which
    # holds all 30 prefix blocks: only they are full blocks).
    revisited = 10 * PREFIX_TOKENS
    assert hits + device_hits == revisited
    assert hits >= revisited // 2
    assert after.load_bytes - before.load_bytes == hits // 16 * block_bytes(tier_llm)
    assert after.store_bytes > before.store_bytes
    decodes = len(prompts) * (GREEDY.max_tokens - 1)
    assert sum(computed_tokens) == sum(len(p) for p in prompts) - revisited + decodes
    assert recompute.engine.core.stats().prefix_cache_hits < hits
    assert_no_leak(tier_llm)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_round_trip_brings_back_the_exact_bytes(
    model_path: str, prefixes: list[list[int]], kv_cache_dtype: str
) -> None:
    llm = make_llm(model_path, tier=True, kv_cache_dtype=kv_cache_dtype)
    core = llm.engine.core
    prompt = [*prefixes[0], 5, 6]
    run_one_by_one(llm, [prompt])
    hashes = _prompt_hashes(core, prompt)
    layers = core.executor.model.attention_layers()

    def block_kv(block_hash: bytes) -> list[torch.Tensor]:
        block_id = core.kv.pool.lookup(block_hash).block_id
        return [t[block_id].clone() for layer in layers for t in (layer.k_cache, layer.v_cache)]

    original = [block_kv(h) for h in hashes]
    run_one_by_one(llm, [[*p, 5, 6] for p in prefixes[1:]])  # pushes prefix 0 out to the host
    host = tier_of(llm).tier
    assert all(core.kv.pool.lookup(h) is None and h in host for h in hashes)
    loaded_before = host.num_loaded
    (output,) = llm.generate({"prompt_token_ids": [*prefixes[0], 7]}, GREEDY)
    assert host.num_loaded - loaded_before == len(hashes)
    assert output.num_cached_tokens == len(hashes) * 16  # vLLM counts a connector's tokens as cached
    for block_hash, want in zip(hashes, original, strict=True):
        got = block_kv(block_hash)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for layer, (host_k, _) in zip(layers, core.executor.kv_workers["offloading"].host_caches, strict=True):
        assert host_k.dtype == layer.k_cache.dtype and host_k.shape[1:] == layer.k_cache.shape[1:]
    assert_no_leak(llm)


def _prompt_hashes(core: Any, prompt: list[int]) -> list[bytes]:
    from pagedserve.common.block_hash import chain_hashes

    return chain_hashes(prompt, 16, core.kv.root_hash)[: (len(prompt) - 1) // 16]


@pytest.mark.heavy  # ~19 s; the tier's greedy parity stays in make test
def test_aborts_and_preemption_leave_no_block_behind(
    model_path: str, prefixes: list[list[int]]
) -> None:
    llm = make_llm(model_path, tier=True, max_num_seqs=4)
    engine = llm.engine
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    run_one_by_one(llm, [[*p, 3] for p in prefixes])  # the host tier holds the early prefixes
    for i, prefix in enumerate(prefixes[:4]):
        engine.add_request(f"r{i}", {"prompt_token_ids": [*prefix, 9, i]}, long)
    for _ in range(3):
        engine.step()
    engine.abort_request("r1")
    while engine.has_unfinished():
        engine.step()
    core = engine.core
    assert core.scheduler.num_preemptions > 0  # 4 x (6 + 4) blocks do not fit in 24
    assert tier_of(llm).hits > 0
    assert_no_leak(llm)
    recompute = make_llm(model_path, tier=False, max_num_seqs=4)
    prompts = [{"prompt_token_ids": [*p, 9, i]} for i, p in enumerate(prefixes[:4])]
    want = [o.outputs[0].token_ids for o in recompute.generate(prompts, long)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, long)]
    assert got == want
    assert_no_leak(llm)


def test_speculative_decoding_with_the_tier(model_path: str, prefixes: list[list[int]]) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    prompts = workload(prefixes)[:8]
    want = run_one_by_one(make_llm(model_path, tier=False), prompts)
    llm = make_llm(model_path, tier=True, speculative_config=spec)
    assert run_one_by_one(llm, prompts) == want
    assert tier_of(llm).hits > 0
    assert_no_leak(llm)
