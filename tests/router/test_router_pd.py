"""--strategy pd end to end: the router on 127.0.0.1 in front of stand-in prefill and decode engines
(pagedserve/testing/fake_openai.py) that record the bodies they receive (router/pd.py, router/proxy.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest
from pagedserve.router.proxy import RouterApp, RouterConfig

from pagedserve.testing.fake_openai import FakeOpenAI, wait_router_polled
from pagedserve.testing.prometheus_text import metric_value
from pagedserve.testing.server_thread import ServerThread

SYSTEM = "You are the assistant of tenant {t}. Follow the house rules: be brief, be kind, cite sources. " * 3
PREFILL_ASKS = {"do_remote_decode": True, "do_remote_prefill": False}


def kv_params(name: str) -> dict:
    """What a prefill engine answers: where the decode engine pulls its blocks from (vLLM's NIXL shape)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [3, 4, 5],
        "remote_engine_id": name,
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
    }


def chat(t: int = 0, u: int = 0, **extra) -> dict:
    messages = [
        {"role": "system", "content": SYSTEM.format(t=t)},
        {"role": "user", "content": f"user {u} asks question {u * 7}"},
    ]
    return {"model": "m", "messages": messages, **extra}


def completion(t: int = 0, **extra) -> dict:
    return {"model": "m", "prompt": SYSTEM.format(t=t) + " Answer:", **extra}


class PDFleet:
    """Prefill engines p0.., decode engines d0.., and the router in front of them."""

    def __init__(self, tokenizer: str, prefill: int = 1, decode: int = 1, **cfg) -> None:
        self.prefills = [
            ServerThread(FakeOpenAI(name=f"p{i}", kv_transfer_params=kv_params(f"p{i}"))).start()
            for i in range(prefill)
        ]
        self.decodes = [ServerThread(FakeOpenAI(name=f"d{i}")).start() for i in range(decode)]
        config = RouterConfig(
            strategy="pd",
            backends=[d.url for d in self.decodes],
            prefill_backends=[p.url for p in self.prefills],
            tokenizer=tokenizer,
            model_name="m",
            health_interval=cfg.pop("health_interval", 0.2),
            health_timeout=5.0,
            **cfg,
        )
        self.app = RouterApp(config)
        self.router = ServerThread(self.app).start()
        self.client = httpx.Client(base_url=self.router.url, timeout=30)
        wait_router_polled(self.app, [d.url for d in self.decodes])
        assert self.app.prefill is not None
        prefill_pool = SimpleNamespace(balancer=self.app.prefill.balancer)  # what wait_router_polled reads
        wait_router_polled(prefill_pool, [p.url for p in self.prefills])

    @property
    def p0(self) -> FakeOpenAI:
        return self.prefills[0].app

    @property
    def d0(self) -> FakeOpenAI:
        return self.decodes[0].app

    def decoded(self) -> list[dict]:
        """The bodies the decode engines received, parsed, in no particular order between engines."""
        return [json.loads(r["body"]) for d in self.decodes for r in d.app.received]

    def prefilled(self) -> list[dict]:
        return [json.loads(r["body"]) for p in self.prefills for r in p.app.received]

    def metrics(self) -> str:
        return self.client.get("/metrics").text

    def close(self) -> None:
        self.client.close()
        self.router.stop()
        for server in self.prefills + self.decodes:
            server.stop()


@pytest.fixture()
def pd_fleet(tiny_tokenizer):
    fleets: list[PDFleet] = []

    def make(**kw) -> PDFleet:
        f = PDFleet(tiny_tokenizer, **kw)
        fleets.append(f)
        return f

    yield make
    for f in fleets:
        f.close()


def wait_metric(f: PDFleet, name: str, value: float, timeout: float = 10, **labels) -> None:
    """Until a metric reads ``value``: a request is counted done after its answer's last byte is sent."""
    deadline = time.monotonic() + timeout
    while metric_value(m := f.metrics(), name, **labels) != value and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric_value(m, name, **labels) == value, m


def post_raw(f: PDFleet, path: str, request: dict) -> tuple[bytes, httpx.Response]:
    raw = json.dumps(request, indent=1).encode()  # spaces and newlines: the decode body must keep them
    return raw, f.client.post(path, content=raw, headers={"content-type": "application/json"})


def test_chat_is_prefilled_then_decoded_with_the_prefills_kv_params(pd_fleet):
    f = pd_fleet()
    request = chat(max_completion_tokens=50, temperature=0.5, stream=False, n=1)
    raw, r = post_raw(f, "/v1/chat/completions", request)
    assert r.status_code == 200, r.text
    assert r.headers["x-backend"] == "d0" and r.json()["backend"] == "d0"

    (prefill,) = f.prefilled()
    one_token = {"max_tokens": 1, "max_completion_tokens": 1}
    assert prefill == request | {"kv_transfer_params": PREFILL_ASKS} | one_token
    (received,) = f.d0.received
    # The client's bytes as they came, the prefill's kv_transfer_params added at the end.
    assert received["body"].encode().startswith(raw.rstrip()[:-1].rstrip())
    assert json.loads(received["body"]) == request | {"kv_transfer_params": kv_params("p0")}

    m = f.metrics()
    assert metric_value(m, "pagedserve_router_pd_requests_total") == 1
    assert metric_value(m, "pagedserve_router_pd_fallbacks_total") == 0
    assert metric_value(m, "pagedserve_router_pd_prefill_seconds_count") == 1
    wait_metric(f, "pagedserve_router_requests_total", 1, backend=f.decodes[0].url, status="200")
    wait_metric(f, "pagedserve_router_in_flight_requests", 0)


def test_a_streamed_completion_is_prefilled_unstreamed_and_decoded_as_a_stream(pd_fleet):
    f = pd_fleet()
    f.d0.tokens, f.d0.token_delay = 4, 0.2
    request = completion(stream=True, stream_options={"include_usage": True}, max_tokens=8, ignore_eos=True,
                         min_tokens=8)
    arrivals = []
    with f.client.stream("POST", "/v1/completions", json=request) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream") and r.headers["x-backend"] == "d0"
        for line in r.iter_lines():
            if line:
                arrivals.append((time.monotonic(), line))
    lines = [line for _, line in arrivals]
    assert lines[-1] == "data: [DONE]" and len(lines) == 8 + 2  # 8 tokens, usage, [DONE]
    assert arrivals[-1][0] - arrivals[0][0] > 1.0  # passed through as generated, not buffered

    (prefill,) = f.prefilled()
    expected = request | {"kv_transfer_params": PREFILL_ASKS, "max_tokens": 1, "stream": False, "n": 1}
    del expected["stream_options"], expected["min_tokens"]  # min_tokens 8 > max_tokens 1 would be a 400
    assert prefill == expected  # a completion has no max_completion_tokens to set
    assert f.decoded() == [request | {"kv_transfer_params": kv_params("p0")}]


def test_shared_prefixes_meet_on_one_prefill_engine_and_backends_show_roles(pd_fleet):
    f = pd_fleet(prefill=2, decode=2)
    homes: dict[int, set[str]] = {}
    for u in range(3):
        for t in range(4):
            assert f.client.post("/v1/chat/completions", json=chat(t, u)).status_code == 200
    for p in f.prefills:
        for r in p.app.received:
            tenant = re.search(r"tenant (\d+)", json.loads(r["body"])["messages"][0]["content"])
            homes.setdefault(int(tenant[1]), set()).add(p.app.name)
    assert len(homes) == 4 and all(len(names) == 1 for names in homes.values()), homes
    m = f.metrics()
    assert metric_value(m, "pagedserve_router_routing_decisions_total", reason="prefix_hit") == 8
    assert metric_value(m, "pagedserve_router_ready_prefill_backends") == 2
    assert metric_value(m, "pagedserve_router_ready_backends") == 2
    roles = {b["url"]: b["role"] for b in f.client.get("/backends").json()}
    assert roles == {**{p.url: "prefill" for p in f.prefills}, **{d.url: "decode" for d in f.decodes}}
    health = f.client.get("/health").json()
    assert health["ready_backends"] == 2 and health["ready_prefill_backends"] == 2


def assert_ran_colocated(f: PDFleet, request: dict, reason: str, count: int = 1) -> None:
    r = f.client.post("/v1/chat/completions", json=request)
    assert r.status_code == 200, r.text
    assert r.headers["x-backend"] == "d0"
    assert f.decoded()[-1] == request  # the original body, no kv_transfer_params
    m = f.metrics()
    assert metric_value(m, "pagedserve_router_pd_fallbacks_total", reason=reason) == count, m
    assert metric_value(m, "pagedserve_router_pd_fallbacks_total") == count
    assert metric_value(m, "pagedserve_router_pd_requests_total") == count


def test_a_prefill_engine_that_is_down_means_a_colocated_run(pd_fleet):
    f = pd_fleet(health_interval=30)  # the router learns of the loss from the request, not a health check
    prefill_url = f.prefills[0].url
    f.prefills[0].stop()
    assert_ran_colocated(f, chat(0, 0), "prefill_unreachable")
    # The refused prefill engine left its ring: the next request has none to try.
    assert prefill_url not in f.app.prefill.balancer.ready_urls()
    r = f.client.post("/v1/chat/completions", json=chat(0, 1))
    assert r.status_code == 200 and "kv_transfer_params" not in f.decoded()[-1]
    assert metric_value(f.metrics(), "pagedserve_router_pd_fallbacks_total", reason="no_prefill_backend") == 1
    backends = {b["url"]: b for b in f.client.get("/backends").json()}
    assert backends[prefill_url]["ready"] is False and backends[prefill_url]["role"] == "prefill"


def test_a_prefill_5xx_means_a_colocated_run(pd_fleet):
    f = pd_fleet()
    f.p0.error_status = 500
    assert_ran_colocated(f, chat(0, 0, max_tokens=20), "prefill_error")
    assert len(f.p0.received) == 1  # tried once, not retried


def test_a_prefill_answer_without_kv_params_means_a_colocated_run(pd_fleet):
    f = pd_fleet()
    f.p0.kv_transfer_params = None  # the engine could not hold the KV: "kv_transfer_params": null
    assert_ran_colocated(f, chat(0, 0), "no_kv_params")


def test_a_prefill_429_means_a_colocated_run(pd_fleet):
    """The prefill engine is busy, the request is fine: not the client's error."""
    f = pd_fleet()
    f.p0.error_status = 429
    assert_ran_colocated(f, chat(0, 0), "prefill_error")


def test_a_slow_prefill_step_times_out_into_a_colocated_run(pd_fleet):
    f = pd_fleet(prefill_timeout=0.3)
    f.p0.first_delay = 3.0
    started = time.monotonic()
    assert_ran_colocated(f, chat(0, 0), "prefill_error")
    assert time.monotonic() - started < 2.5  # not waiting for the prefill engine


def test_a_prefill_4xx_is_the_answer(pd_fleet):
    f = pd_fleet()
    f.p0.error_status = 400
    r = f.client.post("/v1/chat/completions", json=chat(0, 0))
    assert r.status_code == 400
    assert r.headers["x-backend"] == "p0" and r.json()["error"]["message"] == "told to fail"
    assert f.decoded() == []  # a decode engine would refuse it too
    m = f.metrics()
    assert metric_value(m, "pagedserve_router_pd_requests_total") == 1
    assert metric_value(m, "pagedserve_router_pd_fallbacks_total") == 0
    wait_metric(f, "pagedserve_router_requests_total", 1, backend=f.prefills[0].url, status="400")
    wait_metric(f, "pagedserve_router_in_flight_requests", 0)


@pytest.mark.parametrize(
    ("path", "request_body"),
    [
        ("/v1/chat/completions", chat(0, 0, n=2)),
        ("/v1/completions", completion(best_of=3)),
        ("/v1/completions", completion(echo=True)),
        ("/v1/completions", completion(prompt_logprobs=1)),
        ("/v1/completions", completion(prompt=["first prompt", "second prompt"])),
        ("/v1/chat/completions", chat(0, 0, kv_transfer_params={"do_remote_prefill": True})),
    ],
    ids=["n", "best_of", "echo", "prompt_logprobs", "several_prompts", "own_kv_transfer_params"],
)
def test_requests_pd_does_not_fit_go_straight_to_decode(pd_fleet, path, request_body):
    f = pd_fleet()
    r = f.client.post(path, json=request_body)
    assert r.status_code == 200 and r.headers["x-backend"] == "d0"
    assert f.prefilled() == []
    assert f.decoded() == [request_body]
    assert metric_value(f.metrics(), "pagedserve_router_pd_requests_total") == 0


def test_one_prompt_in_a_list_or_as_token_ids_is_disaggregated(pd_fleet):
    f = pd_fleet()
    for prompt in (["one prompt " * 20], list(range(40)), [list(range(40))]):
        assert f.client.post("/v1/completions", json=completion(prompt=prompt)).status_code == 200
        assert f.decoded()[-1] == completion(prompt=prompt) | {"kv_transfer_params": kv_params("p0")}
    assert metric_value(f.metrics(), "pagedserve_router_pd_requests_total") == 3


def test_other_routes_skip_the_prefill_step(pd_fleet):
    f = pd_fleet()
    r = f.client.post("/v1/embeddings", json={"model": "m", "input": "hello"})
    assert r.headers["x-backend"] == "d0"  # the decode engine's own answer (the fake serves no embeddings)
    assert f.client.get("/v1/models").json()["data"][0]["id"] == "d0"
    assert f.prefilled() == [] and metric_value(f.metrics(), "pagedserve_router_pd_requests_total") == 0


def test_a_client_leaving_during_the_prefill_step_stops_it(pd_fleet, raw_post):
    f = pd_fleet()
    f.p0.first_delay = 2.0
    client = raw_post(f.router.url, "/v1/chat/completions", chat(0, 0))
    deadline = time.monotonic() + 10
    while not f.p0.received and time.monotonic() < deadline:
        time.sleep(0.02)
    client.close()
    wait_metric(f, "pagedserve_router_requests_total", 1, status="client_disconnect")
    wait_metric(f, "pagedserve_router_in_flight_requests", 0)
    assert f.decoded() == []


def run_router(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pagedserve.router", "--port", "0", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_pd_without_prefill_engines_is_a_startup_error():
    result = run_router("--strategy", "pd", "--backend", "http://127.0.0.1:1")
    assert result.returncode == 2, result.stderr
    assert "--strategy pd needs the prefill engines" in result.stderr
    result = run_router("--prefill-backend", "http://127.0.0.1:1", "--backend", "http://127.0.0.1:2")
    assert result.returncode == 2 and "need --strategy pd" in result.stderr
    with pytest.raises(ValueError, match="--strategy pd needs"):
        RouterApp(RouterConfig(strategy="pd", backends=["http://127.0.0.1:1"]))


def test_prefill_backends_flag_takes_a_comma_separated_list():
    import argparse

    from pagedserve.router.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    pools = ["--backend", "http://d:8000", "--prefill-backends", "http://p1:8000,http://p2:8000"]
    args = parser.parse_args(
        ["--strategy", "pd", *pools, "--prefill-backend", "http://p3:8000", "--prefill-timeout", "30"]
    )
    config = config_from_args(args)
    config.validate()
    assert config.prefill_backends == ["http://p1:8000", "http://p2:8000", "http://p3:8000"]
    assert config.prefill_timeout == 30 and config.backends == ["http://d:8000"]
