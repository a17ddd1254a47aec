"""What the HTTP server costs: streamed output tokens/s of `pagedserve serve` under N concurrent clients
against the offline engine (`LLM.generate`) on the same workload.

The workload is N prompts of random token ids (the same ids for both sides, fresh ones each repeat so
neither side is helped by the prefix cache of the previous repeat), each generating exactly
--output-len tokens (ignore_eos) greedily. The offline side queues all N at once; the server side sends
them as N concurrent streaming /v1/completions requests (aiohttp, `pagedserve bench serve`'s client) and
counts the server's own usage figures. Throughput = generated tokens / wall time from the first request
to the last token. Offline and HTTP repeats alternate, so drifting machine load hits both alike; the
report gives each side's median and the overhead 1 - http / offline (target: <= 10%). It also reports
CPU seconds per output token (the engine's process; on the HTTP side plus the client's), which a loaded
machine distorts less than wall time.

    python -m pagedserve.benchmarks.http_overhead             # CPU defaults: 32 clients, 64 in, 32 out
    python -m pagedserve.benchmarks.http_overhead --device cuda --output-len 256 --input-len 512
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.datasets import random_token_prompts
from pagedserve.benchmarks.serve import bench_session, send_request

from pagedserve.testing.processes import ServerProcess, cpu_seconds, serve_process


@dataclass
class Run:
    tokens: int
    elapsed: float  # wall seconds, first request to last token
    cpu: float  # CPU seconds spent: the engine's process, plus on the HTTP side the client's

    @property
    def tok_s(self) -> float:
        return self.tokens / self.elapsed

    @property
    def cpu_ms_per_token(self) -> float:
        return 1000.0 * self.cpu / self.tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or hub id (default: the embedded model)")
    p.add_argument("--clients", type=int, default=32, help="concurrent streaming clients (= prompts per run)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--output", default=None, help="write the figures as JSON here")
    return p.parse_args(argv)


def workload(tokenizer: Any, args: argparse.Namespace, seed: int) -> list[list[int]]:
    vocab = len(tokenizer)
    rows = random_token_prompts(
        args.clients,
        (args.input_len, args.input_len),
        (args.output_len,) * 2,
        vocab,
        tokenizer.all_special_ids,
        seed=seed,
    )
    return [ids for ids, _ in rows]


def run_offline(llm: Any, prompts: list[list[int]], output_len: int) -> Run:
    """`LLM.generate` on a worker thread, as the server's engine runs: torch's CPU thread pool behaves
    differently on the main thread (much slower there on a loaded 2-core machine), which would otherwise
    be measured as a difference between the two sides."""
    from pagedserve import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    with ThreadPoolExecutor(1) as pool:
        start, cpu = time.perf_counter(), time.process_time()
        outputs = pool.submit(llm.generate, inputs, params).result()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return Run(sum(len(o.outputs[0].token_ids) for o in outputs), elapsed, cpu)


async def run_http(base_url: str, prompts: list[list[int]], output_len: int, server_pid: int) -> Run:
    url = f"{base_url}/v1/completions"
    cpu = time.process_time() + cpu_seconds(server_pid)
    async with bench_session(600.0) as client:

        def body(ids: list[int]) -> dict[str, Any]:
            return {
                "prompt": ids,
                "max_tokens": output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }

        start = time.perf_counter()
        results = await asyncio.gather(
            *[send_request(client, url, body(ids), {}, chat=False) for ids in prompts]
        )
        elapsed = max(r.end_time for r in results) - start
    cpu = time.process_time() + cpu_seconds(server_pid) - cpu
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
    return Run(sum(r.output_len for r in results), elapsed, cpu)


def describe(run: Run) -> str:
    return f"{run.tok_s:7.1f} tok/s, {run.cpu_ms_per_token:6.1f} CPU ms/token"


def start_server(args: argparse.Namespace) -> ServerProcess:
    flags = ["--device", args.device, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    flags += ["--disable-log-requests", *([args.model] if args.model else [])]
    log = Path(tempfile.mkstemp(prefix="http-overhead-", suffix=".log")[1])
    env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_API_KEY"}
    server = serve_process(log, *flags, env=env, stop_timeout_s=60).start()
    try:
        server.wait_ready(args.startup_timeout)
    except BaseException:
        server.stop()
        raise
    return server


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pagedserve import LLM

    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len)
    tokenizer = llm.get_tokenizer()
    server = start_server(args)
    offline: list[Run] = []
    http: list[Run] = []
    try:
        warm = workload(tokenizer, args, seed=0)[:4]
        run_offline(llm, warm, 4)
        asyncio.run(run_http(server.url, warm, 4, server.pid))
        for repeat in range(1, args.repeats + 1):
            prompts = workload(tokenizer, args, seed=repeat)
            offline.append(run_offline(llm, prompts, args.output_len))
            http.append(asyncio.run(run_http(server.url, prompts, args.output_len, server.pid)))
            assert http[-1].tokens == offline[-1].tokens == args.clients * args.output_len
            print(f"repeat {repeat}: offline {describe(offline[-1])}   http {describe(http[-1])}", flush=True)
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)

    def median(runs: list[Run], key: str) -> float:
        return statistics.median(getattr(r, key) for r in runs)

    off, on = median(offline, "tok_s"), median(http, "tok_s")
    off_cpu, on_cpu = median(offline, "cpu_ms_per_token"), median(http, "cpu_ms_per_token")
    figures = {
        "clients": args.clients,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "device": str(llm.engine.device),
        "dtype": str(llm.engine.dtype),
        "offline": [vars(r) for r in offline],
        "http": [vars(r) for r in http],
        "offline_median_tok_s": off,
        "http_median_tok_s": on,
        "overhead": 1.0 - on / off,
        "offline_median_cpu_ms_per_token": off_cpu,
        "http_median_cpu_ms_per_token": on_cpu,
        "cpu_overhead": on_cpu / off_cpu - 1.0,
    }
    print(f"offline engine: {off:.1f} output tok/s, {off_cpu:.1f} CPU ms/token (medians of {args.repeats})")
    print(
        f"HTTP, {args.clients} streaming clients: {on:.1f} output tok/s, {on_cpu:.1f} CPU ms/token "
        "(server + client)"
    )
    print(
        f"HTTP overhead: {100 * figures['overhead']:.1f}% throughput (target <= 10%), "
        f"{100 * figures['cpu_overhead']:.1f}% CPU per token"
    )
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
