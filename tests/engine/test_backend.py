"""The kernel backend (server/backend.py): chosen once, from device, dtype and name; the engine's
choice in its start-up log line and in ``/version``."""

from __future__ import annotations

import logging

import httpx
import pytest
import torch
from pagedserve.common.engine_args import settings
from pagedserve.kernels import cpu, reference
from pagedserve.server.backend import BACKEND_ENV, select_backend
from pagedserve.server.config import EngineConfig
from pagedserve.server.worker.cuda_graphs import DecodeGraphs

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_env_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)


def test_default_is_the_cpu_kernels_on_a_cpu() -> None:
    backend = select_backend(CPU, torch.float32)
    # CI and development machines have g++ and ninja: no build means a bug, not the fallback.
    assert backend.name == "cpu" and backend.kernels is cpu
    assert not backend.supports_cuda_graphs


def test_name_and_environment_override(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_backend(CPU, torch.float32, "torch").kernels is reference
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert select_backend(CPU, torch.float32).name == "torch"
    assert select_backend(CPU, torch.float32, "cpu").name == "cpu"  # the argument wins over the variable


def test_unknown_name_is_refused() -> None:
    with pytest.raises(ValueError, match="triton, cpu, torch"):
        select_backend(CPU, torch.float32, "cuda")


def test_cpu_kernels_for_another_dtype_fall_back_to_the_references() -> None:
    backend = select_backend(CPU, torch.bfloat16, "cpu")
    assert backend.name == "torch" and backend.kernels is reference


def test_triton_on_a_cpu_needs_the_interpreter() -> None:
    pytest.importorskip("triton")
    from pagedserve.kernels._triton_utils import interpreter_active

    if interpreter_active():
        backend = select_backend(CPU, torch.float32, "triton")
        assert backend.name == "triton" and not backend.supports_cuda_graphs
    else:
        with pytest.raises(ValueError, match="needs a CUDA device"):
            select_backend(CPU, torch.float32, "triton")


def test_decode_graphs_refuse_a_backend_without_them() -> None:
    with pytest.raises(ValueError, match="cannot run in CUDA graphs"):
        DecodeGraphs(torch.nn.Identity(), select_backend(CPU, torch.float32, "torch"), 4, 64, 16, CPU)


@pytest.fixture(scope="module")
def engine():
    from pagedserve.server.engine.async_engine import AsyncEngine

    return AsyncEngine.from_config(
        EngineConfig(device="cpu", attention_backend="torch", kv_cache_memory_bytes=1 << 24)
    )


async def test_version_names_the_backend(engine) -> None:
    from pagedserve.server.api.app import build_app

    app = build_app(engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        body = (await client.get("/version")).json()
    assert body["backend"] == "torch" and body["version"]
    # every engine setting in force, by its declared name (common/engine_args.py)
    assert list(body["engine_args"]) == [declared.name for declared, _ in settings()]
    assert body["engine_args"]["attention_backend"] == "torch"
    assert body["engine_args"]["kv_cache_memory_bytes"] == 1 << 24


def test_start_up_log_names_the_backend(caplog: pytest.LogCaptureFixture) -> None:
    from pagedserve.server.engine.llm_engine import LLMEngine

    with caplog.at_level(logging.INFO, logger="pagedserve.engine"):
        engine = LLMEngine(EngineConfig(device="cpu", kv_cache_memory_bytes=1 << 24))
    assert engine.core.executor.model.attention_layers()[0].kernels is cpu  # the model runs these kernels
    assert any("engine ready" in r.message and "backend=cpu" in r.message for r in caplog.records)
