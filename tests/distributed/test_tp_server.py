"""Tensor and pipeline parallelism through the real server (`pagedserve serve --tensor-parallel-size N`,
`--pipeline-parallel-size N`, and across two "nodes" of this machine with `--nnodes 2` and a `--headless`
node) and the official openai client: greedy completions equal one rank's token for token; a killed rank
or node ends the server with a clear error within seconds, and a node outlives no leader; a model whose
heads do not split is refused at start.

The embedded SmolLM2 (9 query heads, 3 KV heads) splits across 3 ranks, not 2; the 2-rank cases run on a
seeded random Llama (tests/distributed/conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagedserve import LLM, SamplingParams, default_model
from pagedserve.testing.net import free_port
from pagedserve.testing.processes import (
    ManagedProcess,
    ServerProcess,
    engine_core_pid,
    float_model_args,
    pagedserve_argv,
    serve_process,
    spawn_children,
)

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 240
EXIT_BOUND_S = 20  # a killed rank must end the server within this
# Held out: none of these prompts is used elsewhere in the tensor-parallel tests.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a quiet village by the sea,",
    "Water boils at a temperature of",
]
FLAGS = ["--max-model-len", "256", "--kv-cache-memory-bytes", "64M", "--dtype", "float32"]


def completions(server: ServerProcess, prompts: list[str], max_tokens: int = 16) -> list[str]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    return [
        client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0).choices[0].text
        for p in prompts
    ]


def one_rank(model: str | Path | None, prompts: list[str], max_tokens: int) -> list[str]:
    """The reference: the same engine on one rank, in this process (the server path is the same code as
    tests/server's, and one server start fewer keeps these tests short)."""
    llm = LLM(str(model) if model else None, dtype="float32", device="cpu", max_model_len=256,
              kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [out.outputs[0].text for out in llm.generate(prompts, params)]


def worker_pids(server: ServerProcess) -> list[int]:
    """The engine's other rank processes: spawned by the engine core's process, rank 0."""
    return spawn_children(engine_core_pid(server.pid))


def alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


@pytest.fixture(scope="module")
def tiny_tp2(tmp_path_factory: pytest.TempPathFactory, llama_kv2: Path) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve-tp2") / "server.log"
    with serve_process(log, str(llama_kv2), "--tensor-parallel-size", "2", *FLAGS) as server:
        server.wait_ready(STARTUP_TIMEOUT_S)
        yield server


@pytest.mark.heavy
def test_embedded_model_tp3_equals_tp1(tmp_path: Path) -> None:
    """3 ranks (3 query heads and 1 KV head each) answer as one engine does."""
    with serve_process(tmp_path / "tp3.log", "-tp", "3", *FLAGS) as three:
        three.wait_ready(STARTUP_TIMEOUT_S)
        workers = worker_pids(three)
        assert len(workers) == 2  # ranks 1 and 2, beside rank 0 in the engine process
        assert httpx.get(three.url + "/version").json()["tensor_parallel_size"] == 3
        # The reference runs the same float weights: one rank of the embedded model would otherwise take
        # its GGUF blocks (server/config.py checkpoint_quantization), whose products round differently
        # per CPU (kernels/cpu.py dense_dtype) and part from fp32 at near-ties (CI saw one on " n"/" max").
        assert completions(three, PROMPTS) == one_rank(default_model(), PROMPTS, 16)
        assert three.stop() == 0  # SIGTERM: drained, the ranks stopped, exit 0
    assert not [pid for pid in workers if alive(pid)], "a rank outlived its server"


@pytest.mark.heavy
def test_embedded_model_in_two_stages_of_three_ranks_equals_one_rank(tmp_path: Path) -> None:
    """-tp 3 -pp 2: six ranks (each stage's 15 layers split 3 ways), offline and through the server."""
    expected = one_rank(default_model(), PROMPTS, 16)
    llm = LLM(default_model(), dtype="float32", device="cpu", max_model_len=256,
              kv_cache_memory_bytes=64 << 20, tensor_parallel_size=3, pipeline_parallel_size=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=16)
        assert [out.outputs[0].text for out in llm.generate(PROMPTS, params)] == expected
    finally:
        llm.shutdown()
    split = ("-tp", "3", "-pp", "2")
    with serve_process(tmp_path / "tp3pp2.log", *float_model_args(), *split, *FLAGS) as server:
        server.wait_ready(STARTUP_TIMEOUT_S)
        assert len(worker_pids(server)) == 5
        assert completions(server, PROMPTS) == expected


def test_random_llama_tp2_equals_tp1(tiny_tp2: ServerProcess, llama_kv2: Path) -> None:
    assert len(worker_pids(tiny_tp2)) == 1
    assert completions(tiny_tp2, PROMPTS, max_tokens=12) == one_rank(llama_kv2, PROMPTS, 12)


def test_killed_rank_ends_the_server(tiny_tp2: ServerProcess) -> None:
    """kill -9 of rank 1: the server exits non-zero within seconds, saying which rank died."""
    (worker,) = worker_pids(tiny_tp2)
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    assert tiny_tp2.process is not None
    code = tiny_tp2.process.wait(EXIT_BOUND_S)
    elapsed = time.monotonic() - killed
    assert code != 0
    log = tiny_tp2.log_text()
    assert f"tensor-parallel rank 1 (pid {worker}) exited with code -9" in log, tiny_tp2.log_tail()
    print(f"server exited {elapsed:.1f} s after its rank was killed, code {code}")


def test_ranks_exit_with_a_killed_engine(tmp_path: Path, llama_kv2: Path) -> None:
    """kill -9 of the server: its engine core process sees the pipe close and stops its rank; none is
    left behind."""
    with serve_process(tmp_path / "server.log", str(llama_kv2), "-tp", "2", *FLAGS) as server:
        server.wait_ready(STARTUP_TIMEOUT_S)
        core = engine_core_pid(server.pid)
        (worker,) = spawn_children(core)
        os.kill(server.pid, signal.SIGKILL)
        deadline = time.monotonic() + EXIT_BOUND_S
        while (alive(worker) or alive(core)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(worker), "rank 1 outlived its engine"
        assert not alive(core), "the engine core outlived its server"


@pytest.mark.heavy
def test_two_stages_answer_as_one_rank_and_a_killed_stage_ends_the_server(tmp_path: Path,
                                                                       llama_kv2: Path) -> None:
    """``-pp 2``: one layer per stage; the second stage's rank killed ends the server, naming it."""
    with serve_process(tmp_path / "pp2.log", str(llama_kv2), "-pp", "2", *FLAGS) as server:
        server.wait_ready(STARTUP_TIMEOUT_S)
        assert httpx.get(server.url + "/version").json()["pipeline_parallel_size"] == 2
        assert completions(server, PROMPTS, max_tokens=12) == one_rank(llama_kv2, PROMPTS, 12)
        (worker,) = worker_pids(server)
        os.kill(worker, signal.SIGKILL)
        assert server.process is not None
        assert server.process.wait(EXIT_BOUND_S) != 0
        log = server.log_text()
        assert f"rank 1 (pipeline stage 1) (pid {worker}) exited with code -9" in log, server.log_tail()


def _two_node_ports() -> tuple[int, int]:
    """(API port, master port) with the link port after the master port free as well."""
    while True:
        master = free_port()
        with contextlib.suppress(OSError), socket.create_server(("", master + 1)):
            return free_port(), master


def _two_nodes(tmp_path: Path, model: Path) -> tuple[ServerProcess, ManagedProcess]:
    """A 2-stage engine whose stage 1 runs on "node 1": its own `serve --headless` process (both started
    by `with`)."""
    port, master = _two_node_ports()
    nodes = ["-pp", "2", "--nnodes", "2", "--master-port", str(master), *FLAGS]
    leader = serve_process(tmp_path / "node0.log", str(model), *nodes, port=port)
    argv = pagedserve_argv("serve", str(model), *nodes, "--node-rank", "1", "--headless")
    other = ManagedProcess(argv=argv, log_path=tmp_path / "node1.log")
    return leader, other


@pytest.mark.heavy
def test_two_nodes_answer_as_one_rank_and_a_lost_node_ends_the_server(tmp_path: Path,
                                                                      llama_kv2: Path) -> None:
    leader, other = _two_nodes(tmp_path, llama_kv2)
    with leader, other:
        leader.wait_ready(STARTUP_TIMEOUT_S)
        assert completions(leader, PROMPTS, max_tokens=12) == one_rank(llama_kv2, PROMPTS, 12)
        assert leader.process is not None and other.process is not None
        (rank,) = spawn_children(other.pid)
        other.kill()  # the node's process and its rank, as a pod's deletion does
        assert leader.process.wait(EXIT_BOUND_S) != 0
        log = leader.log_text()
        assert "node 1 (ranks 1..1) lost its link to the leader" in log, leader.log_tail()
        assert not alive(rank)


@pytest.mark.heavy
def test_a_node_stops_with_its_leader(tmp_path: Path, llama_kv2: Path) -> None:
    """SIGTERM to the leader: its stop command ends the node's rank, and the node exits 0; kill -9 of the
    leader's whole process group instead (its machine gone): the link closes, and the node stops its rank
    and exits 1."""
    for how, code in (("SIGTERM", 0), ("kill", 1)):
        leader, other = _two_nodes(tmp_path / how, llama_kv2)
        with leader, other:
            leader.wait_ready(STARTUP_TIMEOUT_S)
            (rank,) = spawn_children(other.pid)
            if how == "kill":
                leader.kill()
            else:
                os.kill(leader.pid, signal.SIGTERM)
            assert other.process is not None
            assert other.process.wait(EXIT_BOUND_S) == code, other.log_tail()
            assert not alive(rank)


def test_heads_that_do_not_split_are_refused_at_start(tmp_path: Path) -> None:
    """The embedded model's 9 query and 3 KV heads do not split across 2 ranks: exit 2, no rank started."""
    log = tmp_path / "tp2.log"
    with ManagedProcess(argv=pagedserve_argv("serve", "--port", "0", "-tp", "2"), log_path=log) as process:
        assert process.process is not None
        assert process.process.wait(120) == 2
    text = log.read_text()
    assert "9 query heads and 3 KV heads" in text, text[-2000:]
