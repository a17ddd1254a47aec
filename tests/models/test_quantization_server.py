"""`pagedserve serve --quantization int8|gguf` (and `-q`): the server loads the embedded model in that mode
(gguf: the GGUF's own blocks), says so on /version, and answers a completion; an unknown mode stops it
with the known modes named."""

from __future__ import annotations

import os
import subprocess

import httpx
import pytest
from pagedserve.kernels.cpu_features import ISA_LEVELS, cpu_features, emulation_env

from pagedserve.testing.processes import DEMO_ANSWER, DEMO_QUESTION, pagedserve_argv, serve_process

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["int8", "gguf"])
def test_server_serves_quantized(tmp_path, mode: str) -> None:
    with serve_process(tmp_path / "server.log", "-q", mode, "--max-model-len", "512") as server:
        server.wait_ready(240)
        assert httpx.get(f"{server.url}/version").json()["quantization"] == mode
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8,
                "temperature": 0}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 8
        assert "Paris" in reply.json()["choices"][0]["text"]


@pytest.mark.parametrize("level", [None, "avx2"], ids=["this-cpu", "as-avx2"])
def test_the_default_mode_says_which_kernels_run_and_why(tmp_path, level: str | None) -> None:
    """The embedded model with no mode named: gguf, with the reason, the prebuilt kernels of the CPU's best
    ISA level and the dtype of its batched rows' copies on /version, and the demo answer; also as an
    AVX2-only CPU runs it (kernels/cpu_features.py emulation_env), float32 copies there."""
    if level is not None and level == cpu_features().isa:
        pytest.skip(f"this CPU's own level is {level}: the other case runs it")
    env = {**os.environ, **(emulation_env(level) if level else {})}
    with serve_process(tmp_path / "server.log", "--max-model-len", "512", env=env) as server:
        server.wait_ready(240)
        version = httpx.get(f"{server.url}/version").json()
        assert version["quantization"] == "gguf" and "GGUF" in version["quantization_reason"], version
        kernels = version["cpu_kernels"]
        expected_level = level or cpu_features().isa
        assert kernels["level"] == expected_level in ISA_LEVELS and kernels["origin"] == "prebuilt", kernels
        native_bf16 = level is None and cpu_features().native_bf16
        assert kernels["gguf_dense_dtype"] == ("bfloat16" if native_bf16 else "float32"), kernels
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": DEMO_QUESTION}],
                "temperature": 0, "max_tokens": 24}
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        assert DEMO_ANSWER in reply.json()["choices"][0]["message"]["content"], reply.text


def test_server_refuses_an_unknown_quantization() -> None:
    result = subprocess.run(
        pagedserve_argv("serve", "--quantization", "gptq"), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2  # the flag's declared choices (common/engine_args.py), as vLLM's parser
    assert "--quantization/-q: invalid choice: 'gptq'" in result.stderr and "gguf" in result.stderr
