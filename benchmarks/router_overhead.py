"""The router's own cost: added latency (p50, p99) and the requests/s it sustains.

Starts on 127.0.0.1 a fast stand-in backend (pagedserve/testing/fake_openai.py: answers a chat
completion at once) and the router in front of it (``pagedserve router``, default strategy prefix-hash,
so every request is rendered with the chat template, tokenized and hashed), then drives both with a lean
keep-alive HTTP/1.1 client:

1. latency: requests one at a time, direct to the backend and through the router; the router's added
   latency is the difference of the percentiles.
2. throughput: ``--concurrency`` connections for ``--duration`` seconds through the router (and direct,
   for reference).

The request is a chat completion with a system prompt of about ``--prompt-words`` words and a short
user turn (a new user turn per request, so the hash chain changes every time).

    .venv/bin/python -m pagedserve.benchmarks.router_overhead [--router-cpus 0,1] [--json out.json]

``--router-cpus`` pins the router (taskset-style) to those cores; the backend and the client then run on
``--other-cpus`` if given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pagedserve.testing.processes import cpu_seconds, fake_openai_process, router_process


def cpu_list(text: str | None) -> set[int] | None:
    if not text:
        return None
    out: set[int] = set()
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out.update(range(int(a), int(b) + 1))
        elif part:
            out.add(int(part))
    return out


def default_tokenizer() -> str:
    """The embedded model's folder if it has been built, else a tiny byte-level tokenizer."""
    try:
        from pagedserve import default_model

        return str(default_model())
    except Exception as exc:
        print(
            f"# default model unavailable ({type(exc).__name__}); using the tiny test tokenizer",
            file=sys.stderr,
        )
    from pagedserve.testing.tiny_tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer(Path(tempfile.mkdtemp()) / "tok")


# --- a lean keep-alive HTTP/1.1 client ----------------------------------------------------------------
class Conn:
    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def request(self, raw: bytes) -> int:
        assert self.reader is not None and self.writer is not None
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = None
        chunked = False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if length is not None:
            await self.reader.readexactly(length)
        elif chunked:
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        return status


STREAM = False  # --stream: the stand-in answers with 4 SSE chunks (its 4 tokens) instead of one JSON body


def make_request(port: int, i: int, system_prompt: str) -> bytes:
    body = json.dumps(
        {
            "model": "bench",
            "stream": STREAM,  # no max_tokens: the stand-in generates its default 4 tokens
            "messages": [
                {"role": "system", "content": system_prompt},
                {"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"},
            ],
        }
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer bench\r\nContent-Length: %d\r\n\r\n" % (port, len(body))
    ) + body


async def latency_run(port: int, n: int, system_prompt: str) -> list[float]:
    conn = Conn(port)
    await conn.open()
    reqs = [make_request(port, i, system_prompt) for i in range(n)]
    out = []
    for raw in reqs:
        t0 = time.perf_counter()
        status = await conn.request(raw)
        out.append(time.perf_counter() - t0)
        if status != 200:
            raise RuntimeError(f"status {status}")
    return out


async def throughput_run(port: int, concurrency: int, duration: float, system_prompt: str) -> dict:
    reqs = [make_request(port, i, system_prompt) for i in range(512)]
    done = 0
    errors = 0
    stop_at = 0.0

    async def worker(w: int) -> None:
        nonlocal done, errors
        conn = Conn(port)
        await conn.open()
        i = w
        while time.perf_counter() < stop_at:
            status = await conn.request(reqs[i % len(reqs)])
            i += concurrency
            if status == 200:
                done += 1
            else:
                errors += 1

    stop_at = time.perf_counter() + 1.0
    await asyncio.gather(*(worker(w) for w in range(concurrency)))  # warm-up: connections, pools
    warmup = done
    done = errors = 0
    t0 = time.perf_counter()
    stop_at = t0 + duration
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - t0
    return {
        "requests": done,
        "errors": errors,
        "seconds": elapsed,
        "rps": done / elapsed,
        "warmup_requests": warmup,
    }


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=None, help="model folder for the router (default: embedded model)")
    p.add_argument("--strategy", default="prefix-hash")
    p.add_argument("--requests", type=int, default=2000, help="sequential requests per latency run")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--router-cpus", default=None, help="e.g. 0,1")
    p.add_argument("--other-cpus", default=None, help="cores for the backend and this client, e.g. 2-5")
    p.add_argument("--stream", action="store_true", help="streamed (SSE) responses instead of JSON")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args()
    global STREAM
    STREAM = a.stream

    other = cpu_list(a.other_cpus)
    if other:
        os.sched_setaffinity(0, other)
    tokenizer = a.tokenizer or default_tokenizer()
    system_prompt = " ".join(f"rule{k % 37} is important;" for k in range(a.prompt_words // 3))

    logs = Path(tempfile.mkdtemp(prefix="router-overhead-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with contextlib.ExitStack() as running:  # stops the router, then the backend, whatever happens
        backend = running.enter_context(
            fake_openai_process(logs / "backend.log", "--no-record", "--tokens", "4", env=env, cpus=other)
        )
        backend.wait_ready(60)
        flags = ["--tokenizer", tokenizer, "--model-name", "bench", "--strategy", a.strategy]
        flags += ["--log-level", "warning"]
        router_cpus = cpu_list(a.router_cpus)
        router = running.enter_context(
            router_process(logs / "router.log", [backend.url], *flags, env=env, cpus=router_cpus)
        )
        router.wait_ready(60)

        direct = asyncio.run(latency_run(backend.port, a.requests, system_prompt))
        routed = asyncio.run(latency_run(router.port, a.requests, system_prompt))
        tp_direct = asyncio.run(throughput_run(backend.port, a.concurrency, a.duration, system_prompt))
        cpu0 = cpu_seconds(router.pid)
        tp_router = asyncio.run(throughput_run(router.port, a.concurrency, a.duration, system_prompt))
        # Includes the 1 s warm-up: CPU per request is over all requests the router served in the run.
        tp_router["router_cpu_seconds"] = cpu_seconds(router.pid) - cpu0

    ms = 1000.0
    served = tp_router["requests"] + tp_router.get("warmup_requests", 0)
    cpu_per_req = tp_router["router_cpu_seconds"] / max(1, served)
    tp_router["router_cpu_ms_per_request"] = cpu_per_req * 1000
    tp_router["rps_per_router_core"] = 1.0 / cpu_per_req if cpu_per_req else None
    res = {
        "cpus_visible": os.cpu_count(),
        "router_cpus": a.router_cpus,
        "strategy": a.strategy,
        "stream": a.stream,
        "load_average": os.getloadavg(),
        "tokenizer": tokenizer,
        "prompt_chars": len(system_prompt),
        "latency_ms": {
            "direct_p50": pct(direct, 0.5) * ms,
            "direct_p99": pct(direct, 0.99) * ms,
            "router_p50": pct(routed, 0.5) * ms,
            "router_p99": pct(routed, 0.99) * ms,
            "added_p50": (pct(routed, 0.5) - pct(direct, 0.5)) * ms,
            "added_p99": (pct(routed, 0.99) - pct(direct, 0.99)) * ms,
            "router_mean": statistics.fmean(routed) * ms,
        },
        "throughput": {"concurrency": a.concurrency, "direct": tp_direct, "router": tp_router},
    }
    print(json.dumps(res, indent=2))
    lat = res["latency_ms"]
    print(
        f"added latency p50 {lat['added_p50']:.3f} ms, p99 {lat['added_p99']:.3f} ms; "
        f"router {tp_router['rps']:.0f} req/s at concurrency {a.concurrency} "
        f"(direct {tp_direct['rps']:.0f}); "
        f"router CPU {tp_router['router_cpu_ms_per_request']:.3f} ms/request = "
        f"{tp_router['rps_per_router_core']:.0f} req/s per core"
    )
    print(
        f"targets: added p50 < 2 ms: {'met' if lat['added_p50'] < 2 else 'MISSED'}; >= 1000 req/s: "
        f"{'met' if tp_router['rps'] >= 1000 else 'MISSED'} (load average {os.getloadavg()[0]:.1f})"
    )
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
