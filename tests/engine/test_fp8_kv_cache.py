"""The engine with an FP8 KV cache (``kv_cache_dtype="fp8"``): block count, greedy agreement with the
model-dtype cache on the embedded model, scales from the first prefill, the config's refusals, and the
server with ``--kv-cache-dtype fp8``.

Scale 1.0 suits the embedded model: its K/V magnitudes (measured over prompts of prose, code and
numbers) reach at most 21.2 (K) and 12.4 (V), far below e4m3's 448, so nothing saturates; what FP8
costs is rounding, a relative error of at most 2**-4 per element.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from pagedserve.server.config import EngineConfig
from pagedserve.server.worker.model_runner import ModelRunner

from pagedserve import LLM, SamplingParams
from pagedserve.testing.processes import DEMO_ANSWER, DEMO_QUESTION, ServerProcess, serve_process

KV_BYTES = 1 << 27  # the same budget for both caches
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):\n    ",
    "List three fruits that are red:",
    "Explain photosynthesis to a ten-year-old.",
    "1, 2, 3, 5, 8, 13,",
    "Translate 'good morning' into Spanish:",
    "The quick brown fox jumps over the lazy dog. " * 12 + "Summarise the text above:",
    "What is the boiling point of water in Fahrenheit?",
    "Once upon a time, in a small village,",
    "import numpy as np\n\n# compute the mean of a list\n",
    "Give me a recipe for pancakes.",
]
MAX_TOKENS = 48
# Floors for these 12 prompts x 48 greedy tokens, float32 model, cpu backend. Measured on this x86 CPU:
# - teacher-forced (each of the float32 cache's greedy tokens fed back as the prompt, FP8's top-1 at
#   every position compared with it, so one disagreement does not derail the rest): 96.7% (557/576);
#   97.0% with calculate_kv_scales. The floor allows about twice the measured disagreements.
# - free-running greedy: 3 of 12 prompts identical over 48 tokens; 44% of all tokens come before the
#   first disagreement. A 135M model's greedy path meets near-ties early (the 4th prompt's first token:
#   top-2 logprobs -2.34 and -2.42 with the float32 cache) and diverges for good after any flip, so
#   this floor is loose.
MIN_TEACHER_FORCED_AGREEMENT = 0.93
MIN_PREFIX_FRACTION = 0.25


@pytest.fixture(scope="module")
def auto_llm(model_path: str) -> LLM:
    return LLM(model_path, kv_cache_memory_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def fp8_llm(model_path: str) -> LLM:
    return LLM(model_path, kv_cache_memory_bytes=KV_BYTES, kv_cache_dtype="fp8")


def test_bytes_per_block_follow_the_cache_dtype():
    shape = (30, 16, 3, 64)  # the embedded model's layers, a block, its KV heads and head_dim
    fp8 = ModelRunner.bytes_per_block(*shape, torch.float8_e4m3fn)
    assert ModelRunner.bytes_per_block(*shape, torch.bfloat16) == 2 * fp8
    assert ModelRunner.bytes_per_block(*shape, torch.float32) == 4 * fp8


def test_fp8_cache_holds_four_times_the_float32_blocks(auto_llm: LLM, fp8_llm: LLM):
    auto_core, fp8_core = auto_llm.engine.core.executor, fp8_llm.engine.core.executor
    assert auto_core.backend.name == fp8_core.backend.name == "cpu"  # the C++ reads FP8 itself
    assert fp8_core.num_blocks == 4 * auto_core.num_blocks  # float32 on CPU: 4 bytes an element, FP8 1
    for layer in fp8_core.model.attention_layers():
        assert layer.k_cache.dtype == layer.v_cache.dtype == torch.float8_e4m3fn
        assert layer.k_cache.shape[0] == fp8_core.num_blocks
        assert layer.k_scale.item() == layer.v_scale.item() == 1.0


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def agreed_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def teacher_forced_agreement(llm: LLM, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """The fraction of ``continuations``' tokens that are ``llm``'s top-1 given everything before them."""
    agreed = 0
    for prompt, continuation in zip(prompts, continuations, strict=True):
        ids = prompt + continuation
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        agreed += sum(out.prompt_logprobs[i][ids[i]].rank == 1 for i in range(len(prompt), len(ids)))
    return agreed / sum(len(c) for c in continuations)


def test_greedy_agreement_with_the_model_dtype_cache(auto_llm: LLM, fp8_llm: LLM):
    expected, actual = greedy(auto_llm), greedy(fp8_llm)
    prefixes = [agreed_prefix(e, a) for e, a in zip(expected, actual, strict=True)]
    identical = sum(p == MAX_TOKENS for p in prefixes)
    prefix_fraction = sum(prefixes) / (MAX_TOKENS * len(PROMPTS))
    prompt_ids = [auto_llm.get_tokenizer().encode(p) for p in PROMPTS]
    forced = teacher_forced_agreement(fp8_llm, prompt_ids, expected)
    print(f"fp8 KV cache vs float32: teacher-forced top-1 agreement {forced:.1%}; free-running: "
          f"{identical} of {len(PROMPTS)} prompts identical, {prefix_fraction:.1%} of tokens before the "
          "first disagreement")
    assert forced >= MIN_TEACHER_FORCED_AGREEMENT
    assert prefix_fraction >= MIN_PREFIX_FRACTION


def test_calculate_kv_scales_maps_the_first_prefill_amax_to_448(model_path: str):
    llm = LLM(model_path, kv_cache_memory_bytes=KV_BYTES // 8, kv_cache_dtype="fp8", calculate_kv_scales=True)
    layers = llm.engine.core.executor.model.attention_layers()
    assert all(layer.calculate_kv_scales for layer in layers)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    for layer in layers:
        assert not layer.calculate_kv_scales  # once
        for cache, scale in ((layer.k_cache, layer.k_scale), (layer.v_cache, layer.v_scale)):
            # The prefill's largest |x| became 448 (later tokens saturate there at most); on this model
            # every amax is below 448, so every scale is below 1.
            assert 0 < scale.item() < 1.0
            assert cache.float().abs().max().item() == 448.0


def test_config_accepts_vllm_names_and_refuses_the_rest():
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").torch_kv_cache_dtype == torch.float8_e4m3fn
    assert EngineConfig(kv_cache_dtype="fp8").torch_kv_cache_dtype == torch.float8_e4m3fn
    assert EngineConfig(device="cpu").torch_kv_cache_dtype == torch.float32  # auto: the model's
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="calculate_kv_scales needs an fp8 kv_cache_dtype"):
        EngineConfig(calculate_kv_scales=True)


def test_triton_backend_refuses_fp8_below_compute_capability_8_9(monkeypatch):
    """Triton has no e4m3 conversions before Ada/Hopper: such a GPU is refused at start-up, by name. (The
    capability is the one faked part: this machine has no GPU.)"""
    from pagedserve.server.backend import select_backend

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"kv_cache_dtype fp8 needs a GPU of compute capability 8\.9"):
        select_backend(torch.device("cuda"), torch.bfloat16, "triton", torch.float8_e4m3fn)


# ------------------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def fp8_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve-fp8") / "server.log"
    with serve_process(log, "--max-model-len", "256", "--kv-cache-dtype", "fp8") as server:
        server.wait_ready(240)
        yield server


@pytest.mark.slow
def test_server_with_fp8_cache_answers_and_says_so(fp8_server: ServerProcess):
    client = openai.OpenAI(base_url=f"{fp8_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    result = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": DEMO_QUESTION}],
        max_tokens=24,
        temperature=0,
    )
    assert DEMO_ANSWER in (result.choices[0].message.content or "")
    assert "kv_cache_dtype=torch.float8_e4m3fn" in fp8_server.log_text()
    metrics = httpx.get(f"{fp8_server.url}/metrics", timeout=10).text
    info = next(line for line in metrics.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'cache_dtype="fp8"' in info
    assert httpx.get(f"{fp8_server.url}/version", timeout=10).json()["kv_cache_dtype"] == "fp8"
