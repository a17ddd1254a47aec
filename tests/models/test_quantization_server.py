"""`pagedserve serve --quantization int8|gguf` (and `-q`): the server loads the embedded model in that mode
(gguf: the GGUF's own blocks), says so on /version, and answers a completion; an unknown mode stops it
with the known modes named."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from pagedserve.testing.processes import pagedserve_argv, serve_process

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


def test_server_refuses_an_unknown_quantization() -> None:
    result = subprocess.run(
        pagedserve_argv("serve", "--quantization", "gptq"), capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "quantization must be one of int8" in result.stderr + result.stdout
