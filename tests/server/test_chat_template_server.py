"""Issue 14 item 2 on a real `pagedserve serve --trust-request-chat-template`: a template that takes
seconds renders off the event loop (/health keeps answering) and ends with a 400 at its deadline."""

from __future__ import annotations

import threading

import httpx
import pytest

from pagedserve.testing.processes import serve_process

pytestmark = pytest.mark.slow

# Two nested loops of 15,000: 7.4 s of the event loop in issue 14's measurement, far beyond the bound.
SLOW_TEMPLATE = "{% for i in range(15000) %}{% for j in range(15000) %}{% endfor %}{% endfor %}"


def test_slow_request_template_keeps_health_answering_and_ends_in_a_400(tmp_path) -> None:
    flags = ["--max-model-len", "256", "--trust-request-chat-template", "--chat-template-timeout", "3"]
    with serve_process(tmp_path / "server.log", *flags) as server:
        server.wait_ready(240)
        body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": SLOW_TEMPLATE}
        answer: dict[str, httpx.Response] = {}
        slow = threading.Thread(
            target=lambda: answer.update(
                r=httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
            )
        )
        slow.start()
        health = []
        while slow.is_alive():
            health.append(httpx.get(f"{server.url}/health", timeout=60).status_code)
        slow.join()
        assert len(health) > 1 and set(health) == {200}  # answered again and again during the render
        r = answer["r"]
        assert r.status_code == 400, r.text
        assert (
            r.json()["error"]["param"] == "chat_template"
            and "longer than 3 s" in r.json()["error"]["message"]
        )
