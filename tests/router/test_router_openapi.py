"""The router's /openapi.json, fuzzed with schemathesis: the router (its own process) in front of the fake
OpenAI backend (its own process), every documented operation with valid and invalid data."""

from __future__ import annotations

import httpx

from pagedserve.testing.openapi_fuzz import fuzz_openapi
from pagedserve.testing.processes import fake_openai_process, router_process

API_KEY = "router-key-123"


def test_schemathesis_fuzz_no_server_errors(tmp_path, tiny_tokenizer) -> None:
    """Never a 5xx, and every response's status, content type and body as the schema documents them."""
    backend = fake_openai_process(tmp_path / "fake.log", "--name", "fake")
    router = router_process(
        tmp_path / "router.log", [backend.url], "--tokenizer", tiny_tokenizer, "--api-key", API_KEY,
        "--health-interval", "0.2", "--log-level", "warning",
    )  # fmt: skip
    with backend, router:
        backend.wait_ready(30)
        router.wait_ready(60)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        seen = fuzz_openapi(router.url, headers=headers, timeout=30)
        assert {
            "POST /v1/chat/completions",
            "POST /v1/completions",
            "POST /v1/{path}",
            "GET /backends",
        } <= set(seen)
        # Still serving, and the fuzz reached the replica.
        r = httpx.post(f"{router.url}/v1/completions", json={"prompt": "hi"}, headers=headers, timeout=10)
        assert r.status_code == 200 and r.json()["backend"] == "fake"
        assert httpx.get(f"{backend.url}/_stats", timeout=10).json()["requests"] > 1
    assert "Traceback" not in router.log_text(), router.log_tail()
