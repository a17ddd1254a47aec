"""`pagedserve operator`: the command line reaches kopf with the right scope and options."""

from __future__ import annotations

import argparse
from typing import Any

import kopf
import pytest
from pagedserve.operator import handlers, main


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    async def operator(**kwargs: Any) -> None:
        seen.update(kwargs)

    monkeypatch.setattr(kopf, "operator", operator)
    monkeypatch.setattr(kopf, "configure", lambda **_: None)  # no global logging changes in tests
    monkeypatch.setattr(handlers, "STATE", handlers._State())
    return seen


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedserve operator")
    main.add_arguments(parser)
    return parser.parse_args(argv)


def test_all_namespaces_by_default(captured: dict[str, Any]) -> None:
    assert main.run(parse()) == 0
    assert captured["clusterwide"] is True and list(captured["namespaces"]) == []
    assert captured["standalone"] is True and captured["liveness_endpoint"] is None


def test_namespaces_and_options(captured: dict[str, Any]) -> None:
    args = parse(
        "--namespace", "ml", "-n", "team-*", "--resync-seconds", "5", "--default-image", "reg/engine:2",
        "--default-cpu-image", "reg/engine:2-cpu",
        "--liveness", "http://0.0.0.0:8080/healthz", "--peering", "pagedserve",
    )  # fmt: skip
    assert main.run(args) == 0
    assert captured["clusterwide"] is False and captured["namespaces"] == ["ml", "team-*"]
    assert captured["standalone"] is False and captured["peering_name"] == "pagedserve"
    assert captured["liveness_endpoint"] == "http://0.0.0.0:8080/healthz"
    assert handlers.STATE.resync_seconds == 5
    assert handlers.STATE.options.default_image == "reg/engine:2"
    assert handlers.STATE.options.default_cpu_image == "reg/engine:2-cpu"


def test_policy_flags(captured: dict[str, Any]) -> None:
    from pagedserve.operator.policy import Policy

    assert main.run(parse()) == 0
    assert handlers.STATE.options.policy == Policy()  # refuse secret env, any image
    args = parse(
        "--allow-secret-env", "--allowed-image-prefix", "reg/ml/", "--allowed-image-prefix", "ghcr.io/"
    )
    assert main.run(args) == 0
    assert handlers.STATE.options.policy == Policy(
        allow_secret_env=True, allowed_image_prefixes=("reg/ml/", "ghcr.io/")
    )
