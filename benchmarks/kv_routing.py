"""KV-event routing against prefix-hash and one replica, on a multi-tenant shared-prefix workload.

Starts on 127.0.0.1 three real engines (``pagedserve serve``, the embedded model, ``--enable-kv-events``,
a small KV pool and ``--max-num-seqs`` so that two cores cope) and, in turn, three setups, each with its
own tenants' system prompts (a per-setup tag leads them, so no setup finds another's cache):

* ``single``: every request straight to engine 0 (the best hit rate a fleet can hope for);
* ``prefix-hash``: ``pagedserve router --strategy prefix-hash`` in front of the three;
* ``kv-events``: ``pagedserve router --strategy kv-events`` in front of the three.

The workload: ``--tenants`` long system prompts (about ``--prompt-words`` words each), ``--users`` short
questions per tenant, tenants interleaved, ``--concurrency`` streamed chat completions in flight. The fleet
prefix-cache hit rate comes from the engines' own ``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total`` (deltas over the setup's run); TTFT is measured by the client (time
to the first streamed chunk).

    PYTHONSAFEPATH=1 nice .venv/bin/python -m pagedserve.benchmarks.kv_routing [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
from pagedserve.benchmarks.serve import percentile

from pagedserve.testing.processes import ServerProcess, router_process, serve_process

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["billing", "shipping", "warranty", "accounts", "returns", "privacy", "loyalty", "repairs"]


def system_prompt(tag: str, tenant: int, words: int) -> str:
    topic = TOPICS[tenant % len(TOPICS)]
    rules = " ".join(f"Rule {k}: for {topic} questions, be brief and polite." for k in range(words // 9))
    return f"[{tag}] You are the {topic} desk of company number {tenant}. {rules}"


def workload(tag: str, args: argparse.Namespace) -> list[dict]:
    return [
        {
            "model": MODEL,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
            "messages": [
                {"role": "system", "content": system_prompt(tag, tenant, args.prompt_words)},
                {"role": "user", "content": f"I am customer {user * 31 + tenant}. Question {user}?"},
            ],
        }
        for user in range(args.users)
        for tenant in range(args.tenants)
    ]


def fleet_counters(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def has_text(line: str) -> bool:
    """A streamed chunk that carries generated text (the first one only names the role)."""
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line[6:]).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


async def one(client: httpx.AsyncClient, body: dict) -> float:
    """TTFT of one streamed chat completion: to its first chunk of text (its whole stream is read)."""
    started = time.perf_counter()
    ttft = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if ttft is None and has_text(line):
                ttft = time.perf_counter() - started
    return ttft if ttft is not None else time.perf_counter() - started


async def drive(base_url: str, bodies: list[dict], concurrency: int) -> list[float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:

        async def limited(body: dict) -> float:
            async with sem:
                return await one(client, body)

        return await asyncio.gather(*(limited(b) for b in bodies))


def run_setup(name: str, base_url: str, engines: list[str], args: argparse.Namespace) -> dict:
    h0, q0 = fleet_counters(engines)
    started = time.perf_counter()
    ttfts = asyncio.run(drive(base_url, workload(name, args), args.concurrency))
    elapsed = time.perf_counter() - started
    h1, q1 = fleet_counters(engines)
    result = {
        "setup": name,
        "requests": len(ttfts),
        "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
        "ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "ttft_p90_ms": 1000 * percentile(ttfts, 90),
        "duration_s": elapsed,
        "load_average": os.getloadavg()[0],  # the machine may be shared: quote figures with it
    }
    print(
        f"{name:12s} hit rate {result['hit_rate']:.3f}  TTFT p50 {result['ttft_p50_ms']:.0f} ms  "
        f"p90 {result['ttft_p90_ms']:.0f} ms  ({elapsed:.0f} s, load average {result['load_average']:.1f})",
        flush=True,
    )
    return result


def router_for(strategy: str, engines: list[str], tokenizer: str, logdir: Path, env: dict) -> ServerProcess:
    flags = ["--tokenizer", tokenizer, "--model-name", MODEL, "--strategy", strategy,
             "--health-interval", "0.5", "--log-level", "warning"]  # fmt: skip
    router = router_process(logdir / f"router-{strategy}.log", engines, *flags, env=env).start()
    router.wait_ready(60)
    return router


def wait_synced(router: ServerProcess, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        backends = httpx.get(router.url + "/backends", timeout=10).json()
        if all(b["kv_events_synced"] for b in backends):
            return
        time.sleep(0.25)
    raise RuntimeError("the router's KV event streams did not synchronise")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--users", type=int, default=5)
    p.add_argument("--prompt-words", type=int, default=150, help="words per system prompt (~1.3 tokens each)")
    p.add_argument("--max-tokens", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4)
    # Room for every tenant's system prompt in one engine, so the single replica is the upper bound.
    p.add_argument("--kv-blocks", type=int, default=128, help="KV blocks (16 tokens) per engine")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)

    import pagedserve

    tokenizer = str(pagedserve.default_model())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    engine_flags = ("--enable-kv-events", "--num-gpu-blocks-override", str(args.kv_blocks),
                    "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "1024",
                    "--uvicorn-log-level", "warning", "--disable-access-log")  # fmt: skip
    results = []
    with tempfile.TemporaryDirectory(prefix="kv_routing_") as tmp:
        logdir = Path(tmp)
        engines = [serve_process(logdir / f"engine{i}.log", *engine_flags, env=env).start() for i in range(3)]
        try:
            for engine in engines:
                engine.wait_ready(300)
            urls = [e.url for e in engines]
            results.append(run_setup("single", urls[0], urls, args))
            for strategy in ("prefix-hash", "kv-events"):
                router = router_for(strategy, urls, tokenizer, logdir, env)
                try:
                    if strategy == "kv-events":
                        wait_synced(router)
                    results.append(run_setup(strategy, router.url, urls, args))
                finally:
                    router.stop()
        except Exception:
            for i, engine in enumerate(engines):
                print(f"--- engine{i}:\n{engine.log_tail(2000)}", file=sys.stderr)
            raise
        finally:
            for engine in engines:
                engine.stop()
    by = {r["setup"]: r for r in results}
    kv, ph, single = by["kv-events"]["hit_rate"], by["prefix-hash"]["hit_rate"], by["single"]["hit_rate"]
    print(f"kv-events / prefix-hash: {kv / ph if ph else float('inf'):.3f}; "
          f"kv-events / single replica: {kv / single if single else float('inf'):.3f}")  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
