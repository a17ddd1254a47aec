"""Pure parts of the benchmarks: datasets, metrics, the report's shape, HF token accounting, light imports."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from pagedserve.benchmarks import datasets, serve, throughput
from pagedserve.benchmarks.serve import RequestResult

from pagedserve.testing.bench_helpers import bench_args


def test_random_dataset_is_seeded_and_distinct():
    a = datasets.random_dataset(8, 50, 10, seed=3)
    b = datasets.random_dataset(8, 50, 10, seed=3)
    c = datasets.random_dataset(8, 50, 10, seed=4)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert all(len(r.prompt.split()) == 50 and r.output_len == 10 for r in a)
    assert len({r.prompt.split()[0] + r.prompt.split()[1] for r in a}) > 1  # no common prefix


def test_random_range_ratio():
    reqs = datasets.random_dataset(50, 100, 40, seed=0, range_ratio=0.5)
    ins = [len(r.prompt.split()) for r in reqs]
    outs = [r.output_len for r in reqs]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 5
    assert min(outs) >= 20 and max(outs) <= 60


def test_shared_prefix_dataset_groups():
    reqs = datasets.shared_prefix_dataset(24, 20, 8, num_groups=4, prefix_len=100, seed=1)
    assert len(reqs) == 24
    by_group: dict[int, set[str]] = {}
    for r in reqs:
        by_group.setdefault(r.group, set()).add(r.system)
    assert sorted(by_group) == [0, 1, 2, 3]
    assert all(len(s) == 1 for s in by_group.values())  # one system prompt per group
    assert len({next(iter(s)) for s in by_group.values()}) == 4
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # groups arrive interleaved
    r = reqs[0]
    assert r.completion_prompt().startswith(r.system) and r.completion_prompt().endswith(r.prompt)
    system, user = r.chat_messages()
    assert system == {"role": "system", "content": r.system} and user == {"role": "user", "content": r.prompt}


def test_jsonl_dataset(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(
        json.dumps({"prompt": "hello there", "output_len": 5})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        + "\n"
        + json.dumps({"prompt": "third"})
        + "\n"
    )
    reqs = datasets.jsonl_dataset(p, 2, output_len=7)
    assert [r.output_len for r in reqs] == [5, 7]
    assert reqs[1].chat_messages() == [{"role": "user", "content": "hi"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    with pytest.raises(ValueError, match="prompt"):
        datasets.jsonl_dataset(bad, None, 7)


def test_exact_lengths_with_a_tokenizer():
    class WordTokenizer:  # one token per word; decode joins with spaces
        def encode(self, text, add_special_tokens=False):
            return [hash(w) % 1000 for w in text.split()]

        def decode(self, ids):
            return " ".join("w" for _ in ids)

    reqs = datasets.random_dataset(3, 17, 4, tokenizer=WordTokenizer())
    assert [len(r.prompt.split()) for r in reqs] == [17, 17, 17]


def test_parse_range_and_token_prompts():
    assert datasets.parse_range("20:400") == (20, 400)
    assert datasets.parse_range("7") == (7, 7)
    for bad in ("0:5", "9:3", "1:2:3"):
        with pytest.raises(ValueError):
            datasets.parse_range(bad)
    work = datasets.random_token_prompts(64, (20, 400), (16, 256), 1000, special_ids=[0, 1, 2], seed=0)
    assert len(work) == 64
    assert all(20 <= len(ids) <= 400 and 16 <= n <= 256 for ids, n in work)
    assert not {0, 1, 2} & {t for ids, _ in work for t in ids}
    assert work == datasets.random_token_prompts(64, (20, 400), (16, 256), 1000, [0, 1, 2], seed=0)


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    vals = [5.0, 1.0, 9.0, 3.0, 7.5, 2.2]
    for p in (0, 10, 50, 90, 99, 100):
        assert serve.percentile(vals, p) == pytest.approx(float(np.percentile(vals, p)))
    assert serve.percentile([], 99) == 0.0


def _result(ttft, itls, out, prompt=10, start=0.0):
    chunks, t = [start + ttft], start + ttft
    for x in itls:
        t += x
        chunks.append(t)
    return RequestResult(
        success=True, prompt_len=prompt, output_len=out, ttft=ttft, latency=t - start, itl=list(itls),
        start_time=start, end_time=t, chunk_times=chunks, usage_reported=True,
    )  # fmt: skip


def test_metrics_and_report_shape():
    results = [
        _result(0.1, [0.02, 0.03, 0.02], 4, start=0.0),
        _result(0.3, [0.05, 0.01], 3, start=0.1),
        _result(0.2, [0.04] * 5, 6, start=0.2),
        RequestResult(success=False, error="ConnectError", start_time=0.3, end_time=0.31),
    ]
    m = serve.calculate_metrics(results, duration=2.0, percentiles=[99.0])
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 13
    assert m["output_throughput"] == pytest.approx(6.5)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx((70 / 3 + 60 / 2 + 200 / 5) / 3)
    assert m["max_concurrent_requests"] == 3.0  # the first ends (0.17 s) before the last starts (0.3 s)
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert m[f"median_{key}_ms"] <= m[f"p90_{key}_ms"] <= m[f"p99_{key}_ms"]
    m.update(max_concurrency=4, request_rate=2.5)
    report = serve.format_report(m, [50.0, 99.0])
    lines = report.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    for heading in (
        "Successful requests:",
        "Failed requests:",
        "Maximum request concurrency:",
        "Request rate configured (RPS):",
        "Benchmark duration (s):",
        "Total input tokens:",
        "Total generated tokens:",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Peak output token throughput (tok/s):",
        "Peak concurrent requests:",
        "Total Token throughput (tok/s):",
        "---------------Time to First Token----------------",
        "-----Time per Output Token (excl. 1st token)------",
        "---------------Inter-token Latency----------------",
        "----------------End-to-end Latency----------------",
        "Mean TTFT (ms):",
        "Median TPOT (ms):",
        "P99 ITL (ms):",
        "P50 E2EL (ms):",
    ):
        assert any(line.startswith(heading) for line in lines), heading
    assert "Successful requests:                     3" in report
    no_limits = serve.format_report({**m, "max_concurrency": None, "request_rate": "inf"}, [99.0])
    assert "Maximum request concurrency" not in no_limits and "Request rate configured" not in no_limits


def test_payload_and_sweep_arguments():
    args = bench_args(serve, ["--max-concurrency", "1,4,16", "--request-rate", "inf,2.5", "--model", "m"])
    assert args.max_concurrency == [1, 4, 16] and args.request_rate == [math.inf, 2.5]
    args.extra_body = {"top_k": 5}
    req = datasets.SampleRequest(prompt="a b c", output_len=9, system="sys")
    body = serve.build_payload(req, args)
    assert body["prompt"] == "sys\n\na b c" and body["max_tokens"] == 9 and body["min_tokens"] == 9
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["top_k"] == 5
    args = bench_args(serve, ["--endpoint", "chat", "--no-ignore-eos"])
    args.extra_body = None
    body = serve.build_payload(req, args)
    assert body["messages"][0] == {"role": "system", "content": "sys"}
    assert "ignore_eos" not in body and "min_tokens" not in body
    assert serve._api_url("http://h:1/", "chat") == "http://h:1/v1/chat/completions"
    assert serve._api_url("http://h:1/v1", "completions") == "http://h:1/v1/completions"


def test_hf_token_accounting_counts_only_requested_tokens():
    work = [([1] * 10, 5), ([1] * 30, 20), ([1] * 7, 8), ([1] * 2, 3), ([1] * 4, 4)]
    assert throughput.hf_batches(work, 2) == [[0, 1], [2, 3], [4]]
    acct = throughput.hf_token_accounting(work, 2)
    assert acct["counted_output_tokens"] == 5 + 20 + 8 + 3 + 4
    assert acct["generated_tokens"] == 2 * 20 + 2 * 8 + 1 * 4
    assert acct["padded_prompt_tokens"] == 2 * 30 + 2 * 7 + 1 * 4


def test_bench_modules_import_light():
    code = (
        "import sys, pagedserve.benchmarks.serve, pagedserve.benchmarks.plot, "
        "pagedserve.benchmarks.throughput; "
        "heavy = [m for m in ('torch', 'matplotlib', 'transformers', 'numpy') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    env = {**os.environ, "PYTHONSAFEPATH": "1"}  # ./operator must not shadow the stdlib module
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
