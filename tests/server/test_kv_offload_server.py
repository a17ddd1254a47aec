"""A real `pagedserve serve --kv-offload-bytes ...` process with a device pool smaller than its clients'
shared prefixes: prefixes revisited come back from the CPU tier, and /metrics and /version show it
(vLLM's external prefix cache and KV offload metrics)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pagedserve.testing.processes import ServerProcess, serve_process

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# On CPU whatever the machine: the embedded model's float32 blocks (737,280 bytes) are counted below.
FLAGS = ("--device", "cpu", "--max-model-len", "256", "--num-gpu-blocks-override", "24",
         "--kv-offload-bytes", "64MiB")  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with serve_process(log, *FLAGS, "--disable-access-log") as srv:
        srv.wait_ready(240)
        yield srv


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    (value,) = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    return value


def system_prompt(i: int) -> str:
    return " ".join(f"Rule {i}.{k}: reply as assistant number {i} would, in style {k}." for k in range(8))


def test_revisited_prefixes_are_hits_from_the_cpu_tier(server: ServerProcess) -> None:
    assert metric(server, "vllm:external_prefix_cache_hits_total") == 0
    for round_ in range(2):
        for i in range(5):  # ~100 tokens each: five of them overflow the 24 device blocks
            body = {"model": MODEL, "prompt": system_prompt(i) + f"\nQuestion {round_}:", "max_tokens": 4,
                    "temperature": 0}  # fmt: skip
            reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
    hits = metric(server, "vllm:external_prefix_cache_hits_total")
    queries = metric(server, "vllm:external_prefix_cache_queries_total")
    assert 0 < hits < queries
    assert hits % 16 == 0  # whole blocks
    block_bytes = 737_280  # the embedded model's float32 block
    assert metric(server, "vllm:kv_offload_load_bytes_total") == hits // 16 * block_bytes
    assert metric(server, "vllm:kv_offload_store_bytes_total") >= hits // 16 * block_bytes
    assert 0 < metric(server, "vllm:kv_offload_cpu_cache_usage_perc") <= 1
    info = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert f'num_cpu_blocks="{(64 << 20) // block_bytes}"' in info


def test_version_shows_the_tier(server: ServerProcess) -> None:
    version = httpx.get(f"{server.url}/version", timeout=10).json()
    assert version["kv_offloading_size"] == pytest.approx(64 / 1024)
    assert version["kv_offloading_backend"] == "native"
