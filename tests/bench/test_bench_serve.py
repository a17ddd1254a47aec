"""`pagedserve bench serve` end to end: against the stand-in server, and against the real engine server."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from pagedserve.benchmarks import serve

from pagedserve.testing.bench_helpers import bench_args, standin


def run_serve(capsys, argv: list[str]) -> tuple[int, str]:
    """Run `bench serve` in this process; the report (stdout) comes back, stderr stays in ``LAST_ERR``."""
    rc = serve.run(bench_args(serve, [*argv, "--disable-tqdm"]))
    captured = capsys.readouterr()
    LAST_ERR[:] = [captured.err]
    return rc, captured.out


LAST_ERR = [""]


def report_value(report: str, label: str) -> float:
    m = re.search(rf"^{re.escape(label)}\s+(\S+)", report, re.M)
    assert m, f"{label!r} missing from the report:\n{report}"
    return float(m.group(1))


def check_ordered(run: dict) -> None:
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert 0 <= run[f"median_{key}_ms"] <= run[f"p90_{key}_ms"] <= run[f"p99_{key}_ms"], key
    assert run["median_ttft_ms"] <= run["median_e2el_ms"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_against_standin(standin_server, capsys, tmp_path, endpoint):
    out = tmp_path / "r.json"
    rc, report = run_serve(
        capsys,
        ["--base-url", standin_server, "--endpoint", endpoint, "--num-prompts", "12", "--input-len", "20",
         "--output-len", "10", "--max-concurrency", "4", "--result-json", str(out), "--metric-percentiles",
         "50,99"],
    )  # fmt: skip
    assert rc == 0
    stats = httpx.get(standin_server + "/_stats").json()  # what the server counted
    run = json.loads(out.read_text())
    assert run["completed"] == 12 and run["failed"] == 0
    # The server also counted the initial test run (the first prompt, min(10, 16) tokens), which the
    # benchmark leaves out.
    assert stats["requests"] == 13
    assert run["total_output_tokens"] == 120 == stats["completion_tokens"] - 10
    assert run["total_input_tokens"] == stats["prompt_tokens"] - run["input_lens"][0]
    assert run["output_lens"] == [10] * 12
    assert report_value(report, "Total generated tokens:") == 120
    assert report_value(report, "Successful requests:") == 12
    assert report_value(report, "Failed requests:") == 0
    assert report_value(report, "Maximum request concurrency:") == 4
    assert report_value(report, "Peak concurrent requests:") <= 4
    assert report_value(report, "P50 TTFT (ms):") <= report_value(report, "P99 TTFT (ms):")
    check_ordered(run)
    assert run["model_id"] == "standin-model"  # taken from /v1/models
    assert run["usage_reported"] is True


def test_sweep_writes_a_list_and_poisson_rate(standin_server, capsys, tmp_path):
    out = tmp_path / "sweep.json"
    rc, report = run_serve(
        capsys,
        ["--base-url", standin_server, "--num-prompts", "6", "--input-len", "8", "--output-len", "5",
         "--max-concurrency", "1,3", "--request-rate", "50", "--dataset", "shared-prefix",
         "--shared-prefix-groups", "2", "--shared-prefix-len", "30", "--result-json", str(out),
         "--skip-initial-test"],
    )  # fmt: skip
    assert rc == 0
    runs = json.loads(out.read_text())
    assert isinstance(runs, list) and [r["max_concurrency"] for r in runs] == [1, 3]
    assert all(r["completed"] == 6 and r["total_output_tokens"] == 30 for r in runs)
    assert all(r["request_rate"] == 50 for r in runs)
    assert report.count("Serving Benchmark Result") == 2
    assert report.count("Request rate configured (RPS):") == 2
    # the 30-word shared prefix + the 8-word question, as the stand-in counts words
    assert set(runs[0]["input_lens"]) == {30 + 8}


def test_failures_counted_when_the_server_dies_mid_run(capsys, tmp_path):
    out = tmp_path / "r.json"
    with standin(tmp_path / "standin.log", "--token-delay", "0.01", "--die-after", "4") as fake:
        rc, report = run_serve(
            capsys,
            ["--base-url", fake.url, "--num-prompts", "10", "--input-len", "5", "--output-len", "8",
             "--max-concurrency", "2", "--skip-initial-test", "--result-json", str(out)],
        )  # fmt: skip
        fake.process.wait(timeout=10)
        assert fake.process.returncode != 0  # it really died
    assert rc == 0  # the run still ends with a report
    run = json.loads(out.read_text())
    assert run["completed"] + run["failed"] == 10
    assert 2 <= run["completed"] <= 4 and run["failed"] >= 6
    assert report_value(report, "Failed requests:") == run["failed"]
    assert report_value(report, "Successful requests:") == run["completed"]
    assert run["total_output_tokens"] == 8 * run["completed"]
    errors = [e for e in run["errors"] if e]
    assert len(errors) == run["failed"]
    assert any("Connect" in e for e in errors)  # requests sent after it died
    assert "Serving Benchmark Result" in report


def test_api_key_and_unreachable_server(capsys, monkeypatch, tmp_path):
    with standin(tmp_path / "standin.log", "--api-key", "sekret") as fake:
        base = fake.url
        monkeypatch.setenv("OPENAI_API_KEY", "sekret")
        rc, report = run_serve(capsys, ["--base-url", base, "--num-prompts", "2", "--output-len", "3"])
        assert rc == 0 and report_value(report, "Successful requests:") == 2
        rc, _ = run_serve(capsys, ["--base-url", base, "--num-prompts", "2", "--api-key", "wrong"])
        assert rc == 1  # the initial test run fails with 401 and stops the benchmark
        assert "initial test run failed: HTTP 401" in LAST_ERR[0]
        rc, report = run_serve(
            capsys, ["--base-url", base, "--num-prompts", "2", "--api-key", "wrong", "--skip-initial-test"]
        )
        assert rc == 0 and report_value(report, "Failed requests:") == 2
    rc, _ = run_serve(capsys, ["--base-url", base, "--num-prompts", "1", "--ready-check-timeout", "0.3"])
    assert rc == 1 and "is not answering" in LAST_ERR[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_against_the_real_server(real_server, capsys, tmp_path):
    def counters() -> dict[str, float]:
        resp = httpx.get(real_server + "/metrics", timeout=10)
        assert resp.status_code == 200
        out: dict[str, float] = {}
        for line in resp.text.splitlines():
            for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
                if line.startswith(name):
                    out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    before = counters()
    out = tmp_path / "real.json"
    rc, report = run_serve(
        capsys,
        ["--base-url", real_server, "--num-prompts", "4", "--input-len", "24", "--output-len", "8",
         "--max-concurrency", "2", "--skip-initial-test", "--result-json", str(out)],
    )  # fmt: skip
    assert rc == 0, report
    after = counters()
    run = json.loads(out.read_text())
    assert run["completed"] == 4 and run["failed"] == 0
    assert run["usage_reported"] is True
    assert run["output_lens"] == [8, 8, 8, 8]  # ignore_eos/min_tokens honoured, counted by usage
    assert run["total_output_tokens"] == 32 == report_value(report, "Total generated tokens:")
    assert all(n >= 20 for n in run["input_lens"])  # ~24 words of common English, as tokenized
    assert report_value(report, "Total input tokens:") == sum(run["input_lens"])
    # the server's own counters agree with the report
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 32
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == run["total_input_tokens"]
    check_ordered(run)

    rc, report = run_serve(
        capsys,
        ["--base-url", real_server, "--endpoint", "chat", "--num-prompts", "2", "--input-len", "10",
         "--output-len", "6", "--skip-initial-test"],
    )  # fmt: skip
    assert rc == 0 and report_value(report, "Total generated tokens:") == 12
    assert report_value(report, "Failed requests:") == 0
