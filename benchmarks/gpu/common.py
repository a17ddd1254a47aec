"""Timing helpers shared by the GPU benchmarks."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def cuda_time(fn: Callable[[], Any], iters: int = 50, warmup: int = 5) -> float:
    """Mean seconds per call of ``fn`` on the current stream, by CUDA events, after warm-up calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def graph_time(calls: list[Callable[[], Any]], replays: int = 10) -> float:
    """Mean GPU seconds per call of ``calls``, run back to back in one CUDA graph, replayed.

    Leaves out the host's cost of each launch (Python, Triton's launcher, torch's dispatch), which a
    short kernel timed by ``cuda_time`` can hide behind: the engine's decode step replays graphs too.
    Each call must be capturable: no host synchronization, no allocation that changes size."""
    for call in calls:  # compiles Triton kernels outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    seconds = cuda_time(graph.replay, iters=replays, warmup=2)
    del graph
    return seconds / len(calls)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    buffers = [src, torch.empty_like(src)]
    del src
    seconds = cuda_time(lambda: buffers[1].copy_(buffers[0]), iters=20)
    buffers.clear()
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def device_info() -> dict[str, Any]:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def write_result(name: str, result: dict[str, Any], out_dir: str | None = None, echo: bool = True) -> Path:
    """``result`` as ``<out_dir or $OUT or benchmarks/results/gpu>/<name>.json``; printed too (``echo``).
    A benchmark that writes as it goes leaves what it measured when a deadline cuts it."""
    folder = Path(out_dir or os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "results" / "gpu")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(result, indent=1))
    if echo:
        print(json.dumps(result, indent=1))
    return path


if __name__ == "__main__":  # run_all.sh's setup: what the run ran on, for benchmarks/gpu/report.py
    write_result("environment", device_info())
