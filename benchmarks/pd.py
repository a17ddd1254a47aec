"""Colocated against prefill/decode disaggregation on the same cores, in one run.

Starts on 127.0.0.1, in turn:

* ``colocated``: one engine (``pagedserve serve``, the embedded model) on every core of ``--cpus``;
* ``pd``: a prefill engine (``--kv-transfer-config`` kv_producer) on the first half of the cores, a decode
  engine (kv_consumer) on the other half, and ``pagedserve router --strategy pd`` in front of them.

Each setup gets the same workload from ``pagedserve bench serve`` (benchmarks/serve.py): long random
prompts (``--input-len``) arriving at ``--request-rate`` per second, each streaming ``--output-len``
tokens, and the table prints TTFT and ITL (p50, p99) and output tokens/s side by side. On a CPU the split
shows as ITL stability: a colocated engine runs each new prompt's chunks in the same steps as the running
decodes, so their inter-token gaps stretch by a prefill chunk's time; the decode engine of the pair only
ever computes one token per request (and reads the prompt's KV first), while the prefill engine's half of
the cores bounds how fast prompts get through (TTFT). The decode engine's /metrics confirm what it read.

    PYTHONSAFEPATH=1 nice .venv/bin/python -m pagedserve.benchmarks.pd [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pagedserve.testing.processes import ServerProcess, pagedserve_argv, router_process, serve_process
from pagedserve.testing.prometheus_text import metric_value, scrape

ENGINE_FLAGS = ["--max-model-len", "4096", "--max-num-seqs", "32"]
STARTUP_TIMEOUT_S = 300


def connector(role: str) -> str:
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role, "kv_port": 0})


def engine(log: Path, cpus: set[int], *flags: str) -> ServerProcess:
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cpus))}  # torch's threads: one per core it is given
    return serve_process(log, *ENGINE_FLAGS, *flags, cpus=cpus, env=env, lifetime_s=3600)


def bench(url: str, args: argparse.Namespace, out: Path, label: str) -> dict[str, Any]:
    argv = pagedserve_argv(
        "bench", "serve", "--base-url", url, "--dataset", "random", "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--request-rate", str(args.request_rate), "--seed", "0", "--metric-percentiles", "50,99",
        "--label", label, "--result-json", str(out), "--disable-tqdm",
    )
    subprocess.run(argv, check=True, timeout=3600)
    return json.loads(out.read_text())


def sums(url: str, names: tuple[str, ...]) -> dict[str, float]:
    text = scrape(url)
    return {name: metric_value(text, name) for name in names}


def run_colocated(args: argparse.Namespace, work: Path, cpus: set[int]) -> dict[str, Any]:
    with engine(work / "colocated.log", cpus) as server:
        server.wait_ready(STARTUP_TIMEOUT_S)
        return bench(server.url, args, work / "colocated.json", "colocated")


def run_pd(args: argparse.Namespace, work: Path, cpus: set[int]) -> dict[str, Any]:
    ordered = sorted(cpus)
    prefill_cpus, decode_cpus = set(ordered[: len(ordered) // 2]), set(ordered[len(ordered) // 2:])
    prefill = engine(work / "prefill.log", prefill_cpus, "--kv-transfer-config", connector("kv_producer"))
    decode = engine(work / "decode.log", decode_cpus, "--kv-transfer-config", connector("kv_consumer"))
    with prefill as pre, decode as dec:
        pre.wait_ready(STARTUP_TIMEOUT_S)
        dec.wait_ready(STARTUP_TIMEOUT_S)
        with router_process(work / "router.log", [dec.url], "--strategy", "pd", "--prefill-backend", pre.url,
                            lifetime_s=3600) as router:
            router.wait_ready(60)
            result = bench(router.url, args, work / "pd.json", "pd")
            result["decode_engine"] = sums(dec.url, (
                "vllm:kv_transfers_total", "vllm:kv_transfer_failures_total", "vllm:kv_transfer_bytes_total",
                "vllm:kv_transfer_seconds_total", "vllm:external_prefix_cache_hits_total",
            ))
            result["router"] = sums(router.url, ("pagedserve_router_pd_requests_total",
                                                   "pagedserve_router_pd_fallbacks_total"))
            return result


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [("TTFT p50 (ms)", "median_ttft_ms"), ("TTFT p99 (ms)", "p99_ttft_ms"),
            ("ITL p50 (ms)", "median_itl_ms"), ("ITL p99 (ms)", "p99_itl_ms"),
            ("TPOT mean (ms)", "mean_tpot_ms"), ("output tok/s", "output_throughput"),
            ("failed requests", "failed")]
    lines = [f"{'':18}" + "".join(f"{name:>14}" for name in results)]
    for title, key in rows:
        lines.append(f"{title:18}" + "".join(f"{float(r.get(key, 0)):>14.1f}" for r in results.values()))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-len", type=int, default=1500)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--request-rate", type=float, default=0.5)
    parser.add_argument("--cpus", default=None, help="cores to use, e.g. 0,1 (default: this process's)")
    parser.add_argument("--json", default=None, help="write both setups' results here")
    args = parser.parse_args()
    cpus = {int(c) for c in args.cpus.split(",")} if args.cpus else os.sched_getaffinity(0)
    if len(cpus) < 2:
        print("error: the P/D pair needs at least two cores", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pd-bench-") as tmp:
        work = Path(tmp)
        results = {"colocated": run_colocated(args, work, cpus), "pd": run_pd(args, work, cpus)}
    print(f"{args.num_prompts} prompts of {args.input_len} tokens at {args.request_rate}/s, "
          f"{args.output_len} streamed tokens each, cores {sorted(cpus)}")
    print(table(results))
    print("decode engine:", json.dumps(results["pd"]["decode_engine"]))
    print("router:", json.dumps(results["pd"]["router"]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
