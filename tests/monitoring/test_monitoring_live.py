"""Dashboards and alerts against live processes: Debian's Prometheus (127.0.0.1, 1 s scrapes, a temporary
storage dir) scrapes a live `pagedserve serve` (the embedded model, CPU) and a live `pagedserve router`
in front of it, under a short, bounded load. Then every PromQL expression of every dashboard panel and
every alert must parse, and every panel's query (and every variable's selector) must return a series.

Grafana's variables are substituted as Grafana would with "All" selected (`.*`), and `$__rate_interval`
with a window that fits a short run (1m at a 1 s scrape interval).

The LoRA panels' metrics (`vllm:lora_requests_info`, `pagedserve:lora_requests_total`) come from a fake
engine with adapters (pagedserve/testing/fake_openai.py), scraped as a second target of the engine job:
the engine here serves no adapters.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pagedserve.testing.helm import CHART, find_tool, one, render

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # ~40 s: a real Prometheus scraping real servers

MISSING = [
    m for m in ("pagedserve.server.api.cli", "pagedserve.router.cli") if importlib.util.find_spec(m) is None
]
SUBSTITUTIONS = {"namespace": ".*", "model_name": ".*", "modeldeployment": ".*", "__rate_interval": "1m"}
LIFETIME_S = 300  # every process started here is killed after this long, whatever happens to the test
STARTUP_S = 240  # the first start may convert the embedded model (about 30 s on 2 cores)


def substitute(expr: str) -> str:
    def repl(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in SUBSTITUTIONS:
            raise AssertionError(f"unknown dashboard variable ${name} in {expr!r}")
        return SUBSTITUTIONS[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, expr)


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) for every target of every panel."""
    queries = []
    for path in sorted((CHART / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                queries.append((path.stem, panel["title"], target["expr"]))
    return queries


def variable_selectors() -> list[tuple[str, str, str]]:
    """(dashboard, variable, series selector) of every label_values(selector, label) variable."""
    found = []
    for path in sorted((CHART / "dashboards").glob("*.json")):
        for var in json.loads(path.read_text())["templating"]["list"]:
            if var["type"] != "query":
                continue
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
            assert match, f"{path.stem}: variable {var['name']}: unexpected query {query!r}"
            found.append((path.stem, var["name"], match.group(1)))
    return found


def alert_expressions() -> list[tuple[str, str]]:
    rule = one(
        render({"monitoring": {"prometheusRule": {"enabled": True}}}, include_crds=False), "PrometheusRule"
    )
    return [(r["alert"], r["expr"]) for g in rule["spec"]["groups"] for r in g["rules"]]


def drive_load(base: str, model: str, seconds: float) -> dict[int, int]:
    """A short mixed load through the router: chat and completions, streamed or not, a shared system
    prompt (prefix-cache hits), stop strings and length limits (finish reasons), one bad request (a 4xx
    answer). Returns the count of responses by HTTP status."""
    system = "You are a terse assistant. Answer in one short sentence. " * 4
    questions = ["What is the capital of France?", "Name a prime number.", "What colour is the sky?",
                 "Say hello.", "What is two plus two?", "Name a fruit."]  # fmt: skip
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def record(status: int) -> None:
        with lock:
            statuses[status] = statuses.get(status, 0) + 1

    def worker(k: int) -> None:
        with httpx.Client(base_url=base, timeout=60) as client:
            i = 0
            while time.monotonic() < stop_at:
                q = questions[(k + i) % len(questions)]
                messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
                if i % 3 == 0:
                    body = {"model": model, "max_tokens": 8, "stream": True, "messages": messages}
                    with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        for _ in r.iter_lines():
                            pass
                        record(r.status_code)
                elif i % 3 == 1:
                    body = {"model": model, "max_tokens": 12, "stop": ["."], "messages": messages}
                    record(client.post("/v1/chat/completions", json=body).status_code)
                else:
                    body = {"model": model, "prompt": system + q, "max_tokens": 6, "temperature": 0}
                    record(client.post("/v1/completions", json=body).status_code)
                i += 1

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    with httpx.Client(base_url=base, timeout=60) as client:
        # A request the engine refuses (max_tokens must be >= 1): a 4xx passed through the router.
        record(
            client.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": -1}).status_code
        )
    for t in threads:
        t.join(timeout=seconds + 120)
    return statuses


@pytest.fixture(scope="module")
def prometheus() -> Iterator[str]:
    from pagedserve.testing.fake_openai import FakeOpenAI
    from pagedserve.testing.net import free_port
    from pagedserve.testing.processes import ServerProcess, router_process, serve_process
    from pagedserve.testing.server_thread import ServerThread

    if MISSING:
        pytest.skip(f"not built yet: {', '.join(MISSING)}")
    prom = find_tool("prometheus")
    if prom is None:
        pytest.skip("prometheus missing: run `make tools`")
    with tempfile.TemporaryDirectory(prefix="pagedserve-monitoring-") as tmp:
        tmpdir = Path(tmp)
        # Each under `timeout`, so that none outlives LIFETIME_S whatever happens to the test.
        engine = serve_process(
            tmpdir / "engine.log", "--max-num-seqs", "4", "--max-model-len", "512", "--disable-log-requests",
            lifetime_s=LIFETIME_S,
        )  # fmt: skip
        router = router_process(
            tmpdir / "router.log", [engine.url], "--health-interval", "0.5", lifetime_s=LIFETIME_S
        )
        # Adapters: a fake engine, started (and stopped) with the other processes below.
        lora = FakeOpenAI(
            name="lora-engine", enable_lora=True, adapters={"sql": "/adapters/sql"}, max_loras=2
        )
        lora_engine = ServerThread(lora, port=free_port())
        engine_targets = [f"127.0.0.1:{engine.port}", f"127.0.0.1:{lora_engine.port}"]
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {"job_name": "engine", "static_configs": [{"targets": engine_targets}]},
                {"job_name": "router", "static_configs": [{"targets": [f"127.0.0.1:{router.port}"]}]},
            ],
        }
        (tmpdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom_port = free_port()
        prometheus = ServerProcess(
            argv=[prom, f"--config.file={tmpdir / 'prometheus.yml'}",
                  f"--storage.tsdb.path={tmpdir / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                  "--storage.tsdb.retention.time=1h", "--log.level=warn"],
            log_path=tmpdir / "prometheus.log", port=prom_port, ready_path="/-/ready", lifetime_s=LIFETIME_S,
        )  # fmt: skip
        procs = {"engine": engine, "router": router, "prometheus": prometheus}
        with contextlib.ExitStack() as running:  # stopped in reverse order, whatever happens
            try:
                for proc in procs.values():
                    running.enter_context(proc)
                running.enter_context(lora_engine)
                prometheus.wait_ready(60)
                engine.wait_ready(STARTUP_S)
                router.wait_ready(60)

                model = httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"][0]["id"]
                statuses = drive_load(router.url, model, seconds=20)
                assert statuses.get(200, 0) >= 10, statuses
                for i in range(4):  # requests for an adapter: pagedserve:lora_requests_total{lora_name="sql"}
                    body = {"model": "sql", "prompt": f"hello {i}", "max_tokens": 2}
                    assert httpx.post(f"{lora_engine.url}/v1/completions", json=body).status_code == 200
                for proc in procs.values():
                    proc.check_alive()
                time.sleep(3)  # a few more scrapes after the last request
                yield prometheus.url
            except BaseException:
                for name, proc in procs.items():
                    print(f"----- {name} log -----\n{proc.log_tail()}")
                raise


def query(prom_url: str, expr: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{prom_url}/api/v1/query", params={"query": expr}, timeout=30)
    body = response.json()
    assert body["status"] == "success", f"{expr!r}: {body.get('errorType')}: {body.get('error')}"
    return body["data"]["result"]


def test_both_targets_are_scraped(prometheus: str) -> None:
    up = {r["metric"]["job"]: r["value"][1] for r in query(prometheus, "up")}
    assert up == {"engine": "1", "router": "1"}


def test_every_panel_query_returns_series(prometheus: str) -> None:
    empty = []
    for dashboard, title, expr in dashboard_queries():
        if not query(prometheus, substitute(expr)):
            empty.append(f"{dashboard} / {title}: {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_every_variable_selector_matches_series(prometheus: str) -> None:
    for dashboard, name, selector in variable_selectors():
        response = httpx.get(
            f"{prometheus}/api/v1/series", params={"match[]": substitute(selector)}, timeout=30
        )
        body = response.json()
        assert body["status"] == "success", f"{dashboard} ${name}: {body}"
        assert body["data"], f"{dashboard} ${name}: no series for {selector}"


def test_every_alert_expression_parses(prometheus: str) -> None:
    for alert, expr in alert_expressions():
        response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=30).json()
        assert response["status"] == "success", f"{alert}: {response}"  # a parse error is a 400 "bad_data"


def test_finish_reasons_and_prefix_hits_show_up(prometheus: str) -> None:
    """The load exercised what the dashboards are for: cache hits, routing decisions, finish reasons."""
    hits = query(prometheus, "sum(vllm:prefix_cache_hits_total)")
    assert float(hits[0]["value"][1]) > 0
    reasons = query(prometheus, "sum by (finished_reason) (vllm:request_success_total) > 0")
    assert {r["metric"]["finished_reason"] for r in reasons} >= {"stop", "length"}
    decisions = query(prometheus, "sum by (reason) (pagedserve_router_routing_decisions_total) > 0")
    assert {r["metric"]["reason"] for r in decisions} & {"prefix_hit", "hash_ring"}
    statuses = query(prometheus, "sum by (status) (pagedserve_router_requests_total)")
    assert {r["metric"]["status"] for r in statuses} >= {"200"}
