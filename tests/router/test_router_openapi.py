"""The router's /openapi.json, fuzzed with schemathesis: the router (its own process) in front of the fake
OpenAI backend (its own process), every documented operation with valid and invalid data."""

from __future__ import annotations

import httpx

from pagedserve.testing.processes import fake_openai_process, router_process

API_KEY = "router-key-123"


def test_schemathesis_fuzz_no_server_errors(tmp_path, tiny_tokenizer) -> None:
    """Never a 5xx, and every response's status, content type and body as the schema documents them."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    backend = fake_openai_process(tmp_path / "fake.log", "--name", "fake")
    router = router_process(
        tmp_path / "router.log", [backend.url], "--tokenizer", tiny_tokenizer, "--api-key", API_KEY,
        "--health-interval", "0.2", "--log-level", "warning",
    )  # fmt: skip
    with backend, router:
        backend.wait_ready(30)
        router.wait_ready(60)
        schema = schemathesis.openapi.from_url(f"{router.url}/openapi.json")
        headers = {"Authorization": f"Bearer {API_KEY}"}
        checks = [
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ]
        seen: dict[str, int] = {}

        def fuzz(operation, mode) -> None:
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=12,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            def run(case) -> None:
                response = case.call(base_url=router.url, headers=headers, timeout=30)
                seen[operation.label] = seen.get(operation.label, 0) + 1
                case.validate_response(response, checks=checks)

            run()

        for result in schema.get_all_operations():
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                try:
                    fuzz(result.ok(), mode)
                except Unsatisfiable:  # no invalid input exists (an operation without parameters or body)
                    assert mode == GenerationMode.NEGATIVE
        assert {
            "POST /v1/chat/completions",
            "POST /v1/completions",
            "POST /v1/{path}",
            "GET /backends",
        } <= set(seen)
        # Still serving, and the fuzz reached the replica.
        r = httpx.post(
            f"{router.url}/v1/completions", json={"prompt": "hello"}, headers=headers, timeout=10
        )
        assert r.status_code == 200 and r.json()["backend"] == "fake"
        assert httpx.get(f"{backend.url}/_stats", timeout=10).json()["requests"] > 1
    assert "Traceback" not in router.log_text(), router.log_tail()
