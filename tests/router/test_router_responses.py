"""The Responses API through the router (issue 40): a response is stored by the replica that made it,
so a request continuing it (previous_response_id) or reading it (GET /v1/responses/{id}) goes to that
replica, found by the instance in the response id (common/routing.py), even under round-robin."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pagedserve.common.routing import instance_of_response
from pagedserve.router.proxy import RouterApp, RouterConfig

from pagedserve.testing.server_thread import ServerThread
from pagedserve.testing.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture
def fleet(tmp_path: Any) -> Iterator[tuple[httpx.Client, list[ServerThread]]]:
    from pagedserve.server.api.app import ServerSettings, build_app

    from pagedserve.testing.api_fakes import FakeEngine
    from pagedserve.testing.fake_openai import wait_router_polled

    apps = [build_app(FakeEngine(max_model_len=512), ServerSettings()) for _ in range(3)]
    engines = [ServerThread(app).start() for app in apps]
    config = RouterConfig(backends=[e.url for e in engines], tokenizer=build_tiny_tokenizer(tmp_path / "tok"),
                          model_name="fake-model", strategy="round-robin", health_interval=0.2)  # fmt: skip
    router_app = RouterApp(config)
    router = ServerThread(router_app).start()
    wait_router_polled(router_app, [e.url for e in engines])
    with httpx.Client(base_url=router.url, timeout=30) as client:
        yield client, engines
    router.stop()
    for engine in engines:
        engine.stop()


def test_a_conversation_of_responses_stays_on_the_replica_that_stores_it(fleet: Any) -> None:
    client, engines = fleet
    first = client.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 4})
    assert first.status_code == 200, first.text
    ids = [first.json()["id"]]
    for turn in range(6):  # round-robin would send every other one elsewhere: a 404 there
        reply = client.post("/v1/responses", json={"input": f"And {turn}?", "max_output_tokens": 4,
                                                   "previous_response_id": ids[-1]})  # fmt: skip
        assert reply.status_code == 200, reply.text
        ids.append(reply.json()["id"])
    assert len({instance_of_response(i) for i in ids}) == 1
    for response_id in ids:
        assert client.get(f"/v1/responses/{response_id}").json()["id"] == response_id
    fresh = [client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2}).json()["id"]
             for _ in engines]  # fmt: skip
    assert len({instance_of_response(i) for i in fresh}) == len(engines)  # new ones are balanced as before
