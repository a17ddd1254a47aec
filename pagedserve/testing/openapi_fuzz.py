"""schemathesis over a live server's ``/openapi.json``: every operation, with schema-valid and invalid
data, checked for no 5xx and for responses (status, content type, body) as the schema documents them.

    seen = fuzz_openapi(router.url, headers={"Authorization": "Bearer KEY"})
    assert "POST /v1/completions" in seen

``prepare(case)`` may edit a generated case before it is sent (bound a generation's ``max_tokens``,
say). Returns how many requests each operation got. Deterministic (``derandomize``), no example database.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def fuzz_openapi(
    base_url: str,
    headers: dict[str, str] | None = None,
    prepare: Callable[[Any], None] | None = None,
    max_examples: int = 12,
    timeout: float = 60.0,
) -> dict[str, int]:
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

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
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
            max_examples=max_examples,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        def run(case) -> None:
            if prepare is not None:
                prepare(case)
            response = case.call(base_url=base_url, headers=headers, timeout=timeout)
            seen[operation.label] = seen.get(operation.label, 0) + 1
            case.validate_response(response, checks=checks)

        run()

    for result in schema.get_all_operations():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                fuzz(result.ok(), mode)
            except Unsatisfiable:  # no invalid input exists (an operation without parameters or body)
                if mode != GenerationMode.NEGATIVE:
                    raise
    return seen
