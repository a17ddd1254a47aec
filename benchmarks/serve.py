"""`pagedserve bench serve`: a serving benchmark against any OpenAI-compatible streaming endpoint.

An async client (aiohttp, as vLLM's benchmark uses) sends the prompts of a dataset at a request rate
(``inf`` or Poisson arrivals at N req/s) under an optional concurrency cap, streams every response, and
reports what vLLM's ``vllm bench serve`` reports, under the same headings: successful and failed
requests, duration, request and token throughputs, and mean / median / percentiles of TTFT, TPOT, ITL and
end-to-end latency. Token counts are the server's own (``stream_options.include_usage``); requests ask for
``ignore_eos`` and ``min_tokens`` so that every request generates the tokens asked for.

Definitions (as in vLLM): TTFT is the time from sending a request to its first non-empty streamed
text; ITL the gaps between later streamed chunks; TPOT a request's (latency - TTFT) / (output tokens - 1);
E2EL the time from sending a request to the end of its stream. Duration runs from the first request's
arrival to the last response's end.

The client must cost the server's machine little: at 256 streams on two cores httpx took several times
aiohttp's CPU per streamed token (benchmarks/README.md, "The engine's own host time").

Only aiohttp and tqdm are needed (no torch, no numpy); ``--tokenizer`` (exact prompt lengths) needs
transformers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pagedserve.benchmarks import datasets

METRICS = (  # key, name in the report, header of its section
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
STORED_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


# ---------------------------------------------------------------------------------------------- arguments


def _float_list(text: str) -> list[float]:
    out = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if part in ("inf", "infinity", "none", ""):
            out.append(math.inf)
        else:
            v = float(part)
            if v <= 0:
                raise argparse.ArgumentTypeError("request rate must be > 0 or inf")
            out.append(v)
    return out


def _conc_list(text: str) -> list[int | None]:
    out: list[int | None] = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if part in ("", "none", "inf", "0"):
            out.append(None)
        else:
            v = int(part)
            if v < 1:
                raise argparse.ArgumentTypeError("max concurrency must be >= 1")
            out.append(v)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("endpoint")
    g.add_argument(
        "--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (default: --host/--port)"
    )
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions or /v1/chat/completions",
    )
    g.add_argument(
        "--model", default=None, help="model name sent in requests (default: the first of /v1/models)"
    )
    g.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)"
    )
    g.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")
    g.add_argument(
        "--ready-check-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the endpoint to accept connections before starting",
    )

    g = parser.add_argument_group("workload")
    g.add_argument(
        "--dataset",
        default="random",
        help="random | shared-prefix | PATH.jsonl (lines with 'prompt' or 'messages', optional 'output_len')",
    )
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument(
        "--input-len",
        type=int,
        default=256,
        help="prompt tokens (shared-prefix: each request's own question after the shared prefix)",
    )
    g.add_argument("--output-len", type=int, default=128, help="tokens to generate per request")
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in [len*(1-r), len*(1+r)]",
    )
    g.add_argument(
        "--shared-prefix-groups", type=int, default=8, help="shared-prefix: number of system prompts"
    )
    g.add_argument(
        "--shared-prefix-len", type=int, default=512, help="shared-prefix: tokens per system prompt"
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer (HF folder or id) to cut prompts to exact token lengths; needs transformers",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos/min_tokens (for servers that reject them)",
    )
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")

    g = parser.add_argument_group("traffic")
    g.add_argument(
        "--request-rate",
        type=_float_list,
        default=[math.inf],
        help="requests/s with Poisson arrivals, or inf (all at once); a comma list sweeps",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival intervals: 1 = Poisson, <1 burstier, >1 steadier",
    )
    g.add_argument(
        "--max-concurrency",
        type=_conc_list,
        default=[None],
        help="cap on requests in flight; a comma list (e.g. 1,4,16) sweeps and writes a list",
    )
    g.add_argument(
        "--skip-initial-test",
        action="store_true",
        help="skip the single uncounted request that checks the endpoint before the run",
    )

    g = parser.add_argument_group("output")
    g.add_argument("--metric-percentiles", default="99", help="percentiles printed, e.g. 50,90,99")
    g.add_argument("--result-json", default=None, help="write the result (a list for a sweep) to this file")
    g.add_argument("--label", default=None, help="name of this run in the result file and in plots")
    g.add_argument("--disable-tqdm", action="store_true")


# ---------------------------------------------------------------------------------------------- requests


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0  # the server's usage.prompt_tokens
    output_len: int = 0  # the server's usage.completion_tokens (chunks counted if it sent no usage)
    expected_output_len: int = 0
    usage_reported: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0  # perf_counter
    end_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    generated_text: str = ""
    finish_reason: str | None = None
    error: str = ""


def _api_url(base_url: str, endpoint: str) -> str:
    """``endpoint`` (completions, chat or models) under the server's /v1, with or without it in the base."""
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + {"completions": "/completions", "chat": "/chat/completions", "models": "/models"}[endpoint]


def build_payload(
    req: datasets.SampleRequest, cfg: argparse.Namespace, max_tokens: int | None = None
) -> dict:
    n = req.output_len if max_tokens is None else max_tokens
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": n,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "completions":
        body["prompt"] = req.completion_prompt()
    else:
        body["messages"] = req.chat_messages()
    if cfg.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = n
    if cfg.extra_body:
        body.update(cfg.extra_body)
    return body


def bench_session(request_timeout: float) -> Any:
    """The client session of a run: no cap on connections (``--max-concurrency`` is the cap), each
    request bounded by ``request_timeout`` seconds."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=request_timeout, connect=min(request_timeout, 60.0))
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)


async def send_request(
    client: Any, url: str, body: dict, headers: dict, chat: bool, expected_output_len: int = 0
) -> RequestResult:
    """One streamed request on ``client`` (an ``aiohttp.ClientSession``); never raises (errors land in
    ``result.error``)."""
    import aiohttp

    res = RequestResult(expected_output_len=expected_output_len)
    res.start_time = time.perf_counter()
    done = False
    try:
        async with client.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode("utf-8", "replace")
                res.error = f"HTTP {resp.status}: {text[:300]}"
                return res
            pending = b""
            async for piece in resp.content.iter_any():
                # Lines by hand: aiohttp's line reader refuses lines over 64 KiB (a chunk of logprobs).
                *lines, pending = (pending + piece).split(b"\n")
                for line in lines:
                    if _take_line(res, line.strip(), chat):
                        done = True
                        break
                if done:
                    break
        res.end_time = time.perf_counter()
        res.latency = res.end_time - res.start_time
        if res.error:
            return res
        if not done:
            res.error = "stream ended before data: [DONE]"
            return res
        if not res.usage_reported:
            res.output_len = len(res.chunk_times)
        if not res.chunk_times:
            res.ttft = res.latency
        res.success = True
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:  # refused, reset, bad JSON
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    finally:
        if not res.end_time:
            res.end_time = time.perf_counter()
    return res


def _take_line(res: RequestResult, line: bytes, chat: bool) -> bool:
    """Fold one SSE line into ``res``; True once the stream is over (``[DONE]``, or an error event)."""
    if not line.startswith(b"data:"):
        return False  # blank separators, SSE comments, event names
    data = line[5:].strip()
    if data == b"[DONE]":
        return True
    obj = json.loads(data)
    if obj.get("error"):
        err = obj["error"]
        res.error = "stream error: " + str(err.get("message", err) if isinstance(err, dict) else err)
        return True
    now = time.perf_counter()
    for choice in obj.get("choices") or ():
        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        if text:
            if res.chunk_times:
                res.itl.append(now - res.chunk_times[-1])
            else:
                res.ttft = now - res.start_time
            res.chunk_times.append(now)
            res.generated_text += text
        if choice.get("finish_reason"):
            res.finish_reason = choice["finish_reason"]
    usage = obj.get("usage")
    if usage:
        res.prompt_len = int(usage.get("prompt_tokens") or 0)
        res.output_len = int(usage.get("completion_tokens") or 0)
        res.usage_reported = True
    return False


# ---------------------------------------------------------------------------------------------- metrics


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    v = sorted(values)
    k = (len(v) - 1) * p / 100.0
    f = math.floor(k)
    c = min(f + 1, len(v) - 1)
    return v[f] + (v[c] - v[f]) * (k - f)


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def calculate_metrics(
    results: list[RequestResult], duration: float, percentiles: list[float]
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    series_s = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    m: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    # Peaks: tokens streamed (chunks) in any one-second bucket since the start; requests in flight at once.
    if results:
        t0 = min(r.start_time for r in results)
        buckets: dict[int, int] = {}
        for r in ok:
            for t in r.chunk_times:
                buckets[int(t - t0)] = buckets.get(int(t - t0), 0) + 1
        m["max_output_tokens_per_s"] = float(max(buckets.values(), default=0))
        events = sorted(
            [(r.start_time, 1) for r in results] + [(max(r.end_time, r.start_time), -1) for r in results]
        )  # ends sort before starts
        level = peak = 0
        for _, step in events:
            level += step
            peak = max(peak, level)
        m["max_concurrent_requests"] = float(peak)
    else:
        m["max_output_tokens_per_s"] = m["max_concurrent_requests"] = 0.0
    for key, values in series_s.items():
        ms = [x * 1000.0 for x in values]
        m[f"mean_{key}_ms"] = statistics.fmean(ms) if ms else 0.0
        m[f"median_{key}_ms"] = statistics.median(ms) if ms else 0.0
        m[f"std_{key}_ms"] = statistics.pstdev(ms) if ms else 0.0
        for p in sorted(set(STORED_PERCENTILES) | set(percentiles)):
            m[f"p{_pword(p)}_{key}_ms"] = percentile(ms, p)
    return m


def format_report(m: dict[str, Any], percentiles: list[float]) -> str:
    """The report, line for line in the shape of vLLM's `bench serve`."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(("{:<40} {:<10" + fmt + "}").format(label, value))

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if m.get("max_concurrency") is not None:
        row("Maximum request concurrency:", m["max_concurrency"])
    if m.get("request_rate") not in (None, "inf") and m.get("request_rate") != math.inf:
        row("Request rate configured (RPS):", float(m["request_rate"]), ".2f")
    row("Benchmark duration (s):", m["duration"], ".2f")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", m["max_concurrent_requests"], ".2f")
    row("Total Token throughput (tok/s):", m["total_token_throughput"], ".2f")
    for key, name, header in METRICS:
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", m[f"mean_{key}_ms"], ".2f")
        row(f"Median {name} (ms):", m[f"median_{key}_ms"], ".2f")
        for p in percentiles:
            row(f"P{_pword(p)} {name} (ms):", m[f"p{_pword(p)}_{key}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- running


async def _arrivals(requests: list, rate: float, burstiness: float, rng: random.Random):
    """Yield requests with gamma-distributed gaps (Poisson when burstiness == 1); inf = no gaps."""
    for i, req in enumerate(requests):
        if i and rate != math.inf:
            await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))
        yield req


async def run_once(
    cfg: argparse.Namespace,
    client: Any,
    url: str,
    headers: dict,
    requests: list,
    rate: float,
    max_conc: int | None,
) -> tuple[dict[str, Any], list[RequestResult]]:
    chat = cfg.endpoint == "chat"
    sem = asyncio.Semaphore(max_conc) if max_conc else None
    pbar = None
    if not cfg.disable_tqdm:
        from tqdm.auto import tqdm

        pbar = tqdm(total=len(requests), file=sys.stderr)

    async def one(req: datasets.SampleRequest) -> RequestResult:
        body = build_payload(req, cfg)
        if sem is None:
            r = await send_request(client, url, body, headers, chat, req.output_len)
        else:
            async with sem:
                r = await send_request(client, url, body, headers, chat, req.output_len)
        if pbar is not None:
            pbar.update(1)
        return r

    rng = random.Random(cfg.seed)
    start = time.perf_counter()
    tasks = [asyncio.create_task(one(req)) async for req in _arrivals(requests, rate, cfg.burstiness, rng)]
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()
    return calculate_metrics(results, duration, cfg.percentiles), results


async def _resolve_model(client: Any, base_url: str, headers: dict) -> str:
    url = _api_url(base_url, "models")
    async with client.get(url, headers=headers) as resp:
        resp.raise_for_status()
        data = (await resp.json()).get("data") or []
    if not data:
        raise RuntimeError(f"{url} lists no models; pass --model")
    return data[0]["id"]


async def _wait_ready(client: Any, base_url: str, headers: dict, timeout: float) -> None:
    """Wait until the server accepts connections (any HTTP answer counts)."""
    import aiohttp

    deadline = time.monotonic() + max(timeout, 0.0)
    url = _api_url(base_url, "models")
    announced = False
    while True:
        try:
            async with client.get(url, headers=headers):
                return
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError):
            if time.monotonic() >= deadline:
                raise
            if not announced:
                print(f"Waiting up to {timeout:.0f} s for {base_url} ...", file=sys.stderr)
                announced = True
            await asyncio.sleep(0.5)


def load_requests(cfg: argparse.Namespace) -> list[datasets.SampleRequest]:
    tokenizer = None
    if cfg.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    if cfg.dataset == "random":
        return datasets.random_dataset(
            cfg.num_prompts, cfg.input_len, cfg.output_len, cfg.seed, cfg.random_range_ratio, tokenizer
        )
    if cfg.dataset == "shared-prefix":
        return datasets.shared_prefix_dataset(
            cfg.num_prompts,
            cfg.input_len,
            cfg.output_len,
            cfg.shared_prefix_groups,
            cfg.shared_prefix_len,
            cfg.seed,
            tokenizer,
        )
    if os.path.exists(cfg.dataset):
        return datasets.jsonl_dataset(cfg.dataset, cfg.num_prompts, cfg.output_len)
    raise ValueError(f"--dataset {cfg.dataset!r}: expected random, shared-prefix or an existing .jsonl file")


async def main_async(cfg: argparse.Namespace) -> int:
    base_url = cfg.base_url or f"http://{cfg.host}:{cfg.port}"
    url = _api_url(base_url, cfg.endpoint)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    requests = load_requests(cfg)
    chat = cfg.endpoint == "chat"
    async with bench_session(cfg.request_timeout) as client:
        try:
            await _wait_ready(client, base_url, headers, cfg.ready_check_timeout)
            if cfg.model is None:
                cfg.model = await _resolve_model(client, base_url, headers)
        except Exception as e:
            print(f"error: {base_url} is not answering: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        if not cfg.skip_initial_test:
            print("Starting initial single prompt test run...", file=sys.stderr)
            first = requests[0]
            r = await send_request(
                client, url, build_payload(first, cfg, max_tokens=min(first.output_len, 16)), headers, chat
            )
            if not r.success:
                print(f"error: initial test run failed: {r.error}", file=sys.stderr)
                return 1
            print("Initial test run completed. Starting main benchmark run...", file=sys.stderr)

        runs: list[dict[str, Any]] = []
        for rate in cfg.request_rate:
            for conc in cfg.max_concurrency:
                print(f"Traffic request rate: {rate}", file=sys.stderr)
                print(
                    f"Burstiness factor: {cfg.burstiness}"
                    + (" (Poisson process)" if cfg.burstiness == 1.0 else ""),
                    file=sys.stderr,
                )
                print(f"Maximum request concurrency: {conc}", file=sys.stderr)
                metrics, results = await run_once(cfg, client, url, headers, requests, rate, conc)
                record = {
                    "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
                    "label": cfg.label,
                    "backend": "openai-chat" if chat else "openai",
                    "endpoint": cfg.endpoint,
                    "base_url": base_url,
                    "model_id": cfg.model,
                    "tokenizer_id": cfg.tokenizer,
                    "dataset": cfg.dataset,
                    "num_prompts": len(requests),
                    "input_len": cfg.input_len,
                    "output_len": cfg.output_len,
                    "request_rate": "inf" if rate == math.inf else rate,
                    "burstiness": cfg.burstiness,
                    "max_concurrency": conc,
                    **metrics,
                    "input_lens": [r.prompt_len for r in results],
                    "output_lens": [r.output_len for r in results],
                    "expected_output_lens": [r.expected_output_len for r in results],
                    "ttfts": [r.ttft for r in results],
                    "itls": [r.itl for r in results],
                    "errors": [r.error for r in results],
                    "usage_reported": all(r.usage_reported for r in results if r.success),
                }
                print(format_report(record, cfg.percentiles), flush=True)
                errors = [r.error for r in results if r.error]
                if errors:
                    kinds: dict[str, int] = {}
                    for e in errors:
                        kinds[e[:120]] = kinds.get(e[:120], 0) + 1
                    for e, n in sorted(kinds.items(), key=lambda kv: -kv[1])[:5]:
                        print(f"  {n} failed: {e}", file=sys.stderr)
                short = [r for r in results if r.success and r.output_len != r.expected_output_len]
                if short:
                    print(
                        f"warning: {len(short)} requests generated a different number of tokens than asked "
                        "(server ignored ignore_eos/min_tokens?)",
                        file=sys.stderr,
                    )
                runs.append(record)
                if len(cfg.request_rate) * len(cfg.max_concurrency) > 1:
                    await asyncio.sleep(1.0)  # let the server drain between sweep points

    if cfg.result_json:
        payload: Any = runs[0] if len(runs) == 1 else runs
        os.makedirs(os.path.dirname(os.path.abspath(cfg.result_json)), exist_ok=True)
        with open(cfg.result_json, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        args.percentiles = [float(p) for p in str(args.metric_percentiles).split(",") if p.strip()]
        if args.extra_body and isinstance(args.extra_body, str):
            args.extra_body = json.loads(args.extra_body)
        if args.num_prompts < 1:
            raise ValueError("--num-prompts must be >= 1")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(main_async(args))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
