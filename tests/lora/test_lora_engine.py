"""LoRA in the offline engine: greedy output with each adapter equals HF Transformers + peft token for
token, a mixed batch gives each request its own output, four adapters share two slots without loss,
bad adapters are refused with their reason, and nothing leaks."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import GREEDY, MAX_TOKENS, LoRAFixture, copy_adapter, token_prompts
from pagedserve.server.api.metrics import EngineStatsCollector
from pagedserve.server.core.kv_cache_manager import KVCacheManager
from pagedserve.server.lora_request import LoRALoadError, LoRAModulePath
from pagedserve.server.outputs import RequestMetrics
from pagedserve.server.request import Request
from prometheus_client import CollectorRegistry, generate_latest

from pagedserve import LLM, EngineConfig, LoRARequest, SamplingParams
from pagedserve.testing.leaks import assert_no_leak

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("name", ["qv4", "attn8", "all16", "all8"])
def test_each_adapter_equals_hf_peft(lora_llm: LLM, lora_setup: LoRAFixture, name: str) -> None:
    adapter = lora_setup.adapters[name]
    assert adapter.expected != lora_setup.base_expected  # the adapter really changes the output
    outputs = lora_llm.generate(token_prompts(lora_setup), GREEDY, lora_request=adapter.request)
    assert tokens(outputs) == adapter.expected
    assert_no_leak(lora_llm.engine)


def test_base_model_unchanged_with_lora_enabled(lora_llm: LLM, lora_setup: LoRAFixture) -> None:
    assert tokens(lora_llm.generate(token_prompts(lora_setup), GREEDY)) == lora_setup.base_expected


def test_mixed_batch_of_base_and_four_adapters_with_two_slots(lora_llm: LLM, lora_setup: LoRAFixture) -> None:
    """Base + 4 adapters in flight at once with max_loras=2 (and a CPU cache of 3): the scheduler lets
    two adapters run at a time, nobody is dropped, each request gets the output it gets alone."""
    names = [None, "qv4", "attn8", "all16", "all8"]
    prompts, loras, expected = [], [], []
    for name in names:
        for i, prompt in enumerate(token_prompts(lora_setup)):
            prompts.append(prompt)
            adapter = lora_setup.adapters[name] if name else None
            loras.append(adapter.request if adapter else None)
            expected.append(adapter.expected[i] if adapter else lora_setup.base_expected[i])
    outputs = lora_llm.generate(prompts, GREEDY, lora_request=loras)
    assert tokens(outputs) == expected
    assert all(o.finished for o in outputs)
    assert_no_leak(lora_llm.engine)
    manager = lora_llm.engine.core.executor.lora
    assert len(manager.slots) == 2 and len(manager.cpu_cache) <= 3


def test_scheduler_never_runs_more_adapters_than_max_loras(lora_llm: LLM, lora_setup: LoRAFixture) -> None:
    engine = lora_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for adapter in lora_setup.adapters.values():
        if adapter.request not in lora_llm.list_loras():
            lora_llm.add_lora(adapter.request)
    for i, name in enumerate(["qv4", "attn8", "all16", "all8"]):
        engine.add_request(f"cap-{i}", token_prompts(lora_setup)[0], params,
                           lora_request=lora_setup.adapters[name].request)
    engine.step()
    # vllm:lora_requests_info names the adapters running and those waiting for a slot
    collector = EngineStatsCollector(SimpleNamespace(stats=engine.core.stats), ["m", "0"], {})
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'running_lora_adapters="attn8,qv4"' in text and 'waiting_lora_adapters="all16,all8"' in text
    assert 'max_lora="2"' in text
    seen = 0
    while engine.has_unfinished():
        engine.step()
        running = {r.lora_int_id for r in engine.core.scheduler.running}
        assert len(running) <= 2
        seen = max(seen, len(running))
    assert seen == 2
    assert_no_leak(lora_llm.engine)
    finished = engine.core.stats().lora.requests_finished
    assert all(finished[name] >= 1 for name in ("qv4", "attn8", "all16", "all8"))


def test_prefix_cache_is_per_adapter() -> None:
    """Same prompt under base, adapter A, adapter B: no block is shared; the same adapter again hits."""
    kv = KVCacheManager(num_blocks=64, block_size=16, enable_caching=True, hash_seed="m")
    prompt = list(range(100, 150))
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")

    def request(rid: str, lora: LoRARequest | None) -> Request:
        return Request(rid, prompt, SamplingParams(), 4, frozenset(), RequestMetrics(0.0), lora_request=lora)

    first = {}
    for rid, lora in [("base", None), ("a", a), ("b", b)]:
        req = request(rid, lora)
        assert kv.find_cached_prefix(req) == []  # nothing computed under another adapter is reused
        assert kv.allocate(req, req.num_tokens)
        first[rid] = req
    again = request("a2", a)
    hits = kv.find_cached_prefix(again)
    assert len(hits) == 3 and hits == kv.blocks_of("a")[:3]
    salted = request("a3", LoRARequest("a", 1, "/a"))
    salted.cache_salt = "s"
    assert kv.find_cached_prefix(salted) == []


def _bad(tmp_path: Path, source: str, **changes: object) -> str:
    return str(copy_adapter(source, tmp_path / "bad", **changes))


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"peft_type": "PROMPT_TUNING"}, "not a PEFT LoRA adapter"),
        ({"r": 32}, "greater than max_lora_rank 16"),
        ({"target_modules": ["q_proj", "fc9"]}, "fc9"),
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ],
)
def test_bad_adapter_is_refused_with_its_reason(
    lora_llm: LLM, lora_setup: LoRAFixture, tmp_path: Path, changes: dict, reason: str
) -> None:
    path = _bad(tmp_path, lora_setup.adapters["qv4"].request.lora_path, **changes)
    with pytest.raises(LoRALoadError, match=reason):
        lora_llm.generate(token_prompts(lora_setup), GREEDY, lora_request=LoRARequest("bad", 99, path))
    assert "bad" not in lora_llm.engine.processor.lora_requests
    assert_no_leak(lora_llm.engine)


def test_not_a_peft_folder(lora_llm: LLM, tmp_path: Path) -> None:
    with pytest.raises(LoRALoadError, match=r"no adapter_config\.json"):
        lora_llm.add_lora(LoRARequest("empty", 98, str(tmp_path)))
    config = '{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}'
    (tmp_path / "adapter_config.json").write_text(config)
    with pytest.raises(LoRALoadError, match="adapter_model"):
        lora_llm.add_lora(LoRARequest("empty", 98, str(tmp_path)))


def test_unloaded_adapter_fails_waiting_requests_alone(lora_llm: LLM, lora_setup: LoRAFixture) -> None:
    """An adapter unloaded while its request waits: that request fails with the reason; the others run."""
    engine = lora_llm.engine
    lora = LoRARequest("gone", 50, lora_setup.adapters["attn8"].request.lora_path)
    lora_llm.add_lora(lora)
    prompt = token_prompts(lora_setup)[0]
    engine.add_request("keep", prompt, GREEDY)
    engine.add_request("doomed", prompt, GREEDY, lora_request=lora)
    lora_llm.remove_lora("gone")
    with pytest.raises(Exception, match="unloaded") as failure:
        engine.step()
    assert failure.value.request_ids == ["doomed"]
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finished["keep"].outputs[0].token_ids) == lora_setup.base_expected[0]
    with pytest.raises(ValueError, match="does not exist"):
        engine.add_request("late", prompt, GREEDY, lora_request=lora)
    assert_no_leak(lora_llm.engine)


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="needs enable_lora"):
        EngineConfig(lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(enable_lora=True, max_loras=0)
    config = EngineConfig(enable_lora=True, max_loras=2, lora_modules=["a=/x", '{"name": "b", "path": "/y"}'])
    assert config.max_cpu_loras == 2
    assert config.lora_modules == [LoRAModulePath("a", "/x"), LoRAModulePath("b", "/y")]


async def test_adapter_endpoints_need_the_env_switch(lora_llm: LLM) -> None:
    """Without VLLM_ALLOW_RUNTIME_LORA_UPDATING there is no load/unload route (vLLM's)."""
    import httpx
    from pagedserve.server.api.app import ServerSettings, build_app
    from pagedserve.server.engine.async_engine import AsyncEngine

    engine = AsyncEngine(lora_llm.engine.core, lora_llm.engine.tokenizer, lora_llm.engine.processor)
    for allowed, status in [(False, 404), (True, 400)]:
        app = build_app(engine, ServerSettings(access_log=False, allow_runtime_lora_updating=allowed))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"lora_name": "x", "lora_path": "/no/such/folder"}
            response = await client.post("/v1/load_lora_adapter", json=body)
        assert response.status_code == status, response.text
    assert "x" not in lora_llm.engine.processor.lora_requests


def test_bin_weights_and_rslora_scaling(lora_llm: LLM, lora_setup: LoRAFixture, tmp_path: Path) -> None:
    """adapter_model.bin instead of .safetensors, and rsLoRA's alpha / sqrt(r) scaling, as peft reads them."""
    import torch
    from safetensors.torch import load_file

    from pagedserve.testing.lora import peft_greedy

    path = copy_adapter(lora_setup.adapters["attn8"].request.lora_path, tmp_path / "rs", use_rslora=True)
    weights = path / "adapter_model.safetensors"
    torch.save(load_file(str(weights)), path / "adapter_model.bin")
    weights.unlink()
    expected = peft_greedy(lora_setup.base_dir, path, lora_setup.prompt_ids, MAX_TOKENS)
    assert expected != lora_setup.adapters["attn8"].expected  # sqrt(8) != 8: the scaling differs
    lora = LoRARequest("rslora-bin", 60, str(path))
    assert tokens(lora_llm.generate(token_prompts(lora_setup), GREEDY, lora_request=lora)) == expected
    lora_llm.remove_lora("rslora-bin")
    assert_no_leak(lora_llm.engine)
