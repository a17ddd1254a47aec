"""Issue 14 item 6 on a real `pagedserve serve` process: SIGTERM during a long stream fails readiness at
once, the stream ends (finished, or with an error event) and the process exits within the grace period."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from pagedserve.testing.processes import serve_process

pytestmark = pytest.mark.slow

GRACE_S = 5
SLACK_S = 15  # the engine thread's last step and the interpreter's exit on two shared cores


def test_sigterm_during_a_long_stream_stops_within_the_grace_period(tmp_path) -> None:
    flags = ["--max-model-len", "1024", "--shutdown-grace-period", str(GRACE_S)]
    with serve_process(tmp_path / "server.log", *flags) as server:
        server.wait_ready(240)
        body = {"prompt": "Count:", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{server.url}/v1/completions", json=body) as r,
        ):
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            assert json.loads(next(lines)[len("data: ") :])["choices"]
            server.process.send_signal(signal.SIGTERM)
            health = http.get(f"{server.url}/health")
            assert health.status_code == 503, health.text  # readiness fails at once
            refused = http.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert refused.status_code == 503  # the router retries it elsewhere
            events = [line[len("data: ") :] for line in lines]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        finished = "choices" in last and last["choices"][-1]["finish_reason"] is not None
        assert finished or "stopped the request" in last["error"]["message"], last
        assert server.process.wait(timeout=GRACE_S + SLACK_S) == 0, server.log_tail()
