"""`pagedserve serve --async-scheduling` (the GPU's default; off on a CPU, where it cannot overlap
anything): concurrent streams through the engine core's process give the same text as the offline
engine without it, and /version says it runs."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pagedserve import LLM, SamplingParams, default_model
from pagedserve.testing.processes import float_model_args, serve_process

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at",
           "The three primary colours are", "In 1969, astronauts"]  # fmt: skip
# (max_tokens, temperature, seed, stop): greedy and seeded rows, lengths ending on different steps
ROWS = [(24, 0.0, None, None), (9, 0.0, None, None), (30, 0.9, 11, None), (17, 0.0, None, ["\n"]),
        (1, 0.0, None, None), (28, 0.7, 5, None)]  # fmt: skip


def test_streams_through_the_core_process_equal_the_synchronous_engine(tmp_path: Path) -> None:
    llm = LLM(str(default_model()), async_scheduling=False)
    expected = [
        o.outputs[0].text
        for o in llm.generate(PROMPTS, [SamplingParams(max_tokens=m, temperature=t, seed=s, stop=stop,
                                                        ignore_eos=True) for m, t, s, stop in ROWS])
    ]
    llm.shutdown()
    model = os.path.basename(str(default_model()))
    with serve_process(tmp_path / "server.log", *float_model_args(), "--async-scheduling",
                       "--max-model-len", "512") as server:
        server.wait_ready(240)
        assert httpx.get(f"{server.url}/version", timeout=10).json()["async_scheduling"] is True

        def complete(i: int) -> str:
            max_tokens, temperature, seed, stop = ROWS[i]
            body = {"model": model, "prompt": PROMPTS[i], "max_tokens": max_tokens,
                    "temperature": temperature, "seed": seed, "stop": stop, "ignore_eos": True}  # fmt: skip
            reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(complete, range(len(PROMPTS))))
    assert texts == expected
    assert "async scheduling=True" in (tmp_path / "server.log").read_text()
