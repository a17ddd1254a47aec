"""Scale from zero in the operator: what it renders (router flags and Role, the HPA's floor) and the pure
scale-down decision (operator/idle.py)."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from pagedserve.common.resource import LAST_REQUEST_ANNOTATION
from pagedserve.operator import render
from pagedserve.operator.idle import activity_interval, last_activity, scale_down_due
from pagedserve.operator.rbac import RULES
from pagedserve.operator.spec import parse_spec

UTC = datetime.timezone.utc
NOW = datetime.datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def md(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pagedserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "m1", "namespace": "ml", "uid": "u1"},
        "spec": {"model": "embedded", "resources": {"gpus": 0}, **spec},
    }


def child(children: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [c for c in children if c["kind"] == kind and c["metadata"]["name"] == name]
    return found


def test_routers_hold_and_wake_only_with_scale_from_zero() -> None:
    on = render(md(scaleFromZero={"scaleDownDelaySeconds": 120, "maxHeldRequests": 50}))
    args = child(on, "Deployment", "m1-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags["--scale-from-zero"] == "m1"
    assert flags["--max-held-requests"] == "50"
    assert flags["--held-request-timeout"] == "300"
    assert flags["--activity-interval"] == "30"  # a quarter of the delay, at most 30 s
    rules = child(on, "Role", "m1-router")["rules"]
    assert rules[1:] == [
        {"apiGroups": ["pagedserve.io"], "resources": ["modeldeployments"], "verbs": ["patch"],
         "resourceNames": ["m1"]},
        {"apiGroups": ["pagedserve.io"], "resources": ["modeldeployments/scale"], "verbs": ["get", "patch"],
         "resourceNames": ["m1"]},
    ]  # fmt: skip
    off = render(md())
    args = child(off, "Deployment", "m1-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--scale-from-zero" not in args and "--max-held-requests" not in args
    assert len(child(off, "Role", "m1-router")["rules"]) == 1
    # RBAC lets the operator grant only what it holds: every rule of the router's Role is in its own.
    for rule in rules:
        assert any(
            set(rule["resources"]) <= set(mine["resources"]) and set(rule["verbs"]) <= set(mine["verbs"])
            for mine in RULES
            if mine["apiGroups"] == rule["apiGroups"]
        ), rule


def test_the_hpa_keeps_one_replica_and_leaves_zero_to_the_routers() -> None:
    children = render(md(replicas=0, autoscaling={"minReplicas": 0, "maxReplicas": 4}, scaleFromZero={}))
    hpa = child(children, "HorizontalPodAutoscaler", "m1")
    assert hpa["spec"]["minReplicas"] == 1 and hpa["spec"]["maxReplicas"] == 4
    assert child(children, "Deployment", "m1-engine")["spec"]["replicas"] == 0


def meta(last: str | None = None, created: str | None = "2026-03-01T11:00:00Z") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if created:
        out["creationTimestamp"] = created
    if last:
        out["annotations"] = {LAST_REQUEST_ANNOTATION: last}
    return out


@pytest.mark.parametrize(
    ("spec", "metadata", "due"),
    [
        # idle for 10 min with a 5 min delay: down
        ({"scaleFromZero": {"scaleDownDelaySeconds": 300}}, meta("2026-03-01T11:50:00.000000Z"), True),
        # a request 2 min ago: stays
        ({"scaleFromZero": {"scaleDownDelaySeconds": 300}}, meta("2026-03-01T11:58:00.123456Z"), False),
        # exactly the delay: down
        ({"scaleFromZero": {"scaleDownDelaySeconds": 300}}, meta("2026-03-01T11:55:00Z"), True),
        # no request ever: counted from the creation (an hour ago)
        ({"scaleFromZero": {"scaleDownDelaySeconds": 300}}, meta(), True),
        ({"scaleFromZero": {"scaleDownDelaySeconds": 7200}}, meta(), False),
        # a garbled annotation falls back to the creation time
        ({"scaleFromZero": {"scaleDownDelaySeconds": 300}}, meta("yesterday"), True),
        # no time known at all: never guess idle
        ({"scaleFromZero": {"scaleDownDelaySeconds": 300}}, meta(created=None), False),
        # already at 0, or scale-from-zero off: nothing to do
        ({"replicas": 0, "scaleFromZero": {"scaleDownDelaySeconds": 300}}, meta(), False),
        ({}, meta(), False),
    ],
)
def test_scale_down_decision(spec: dict[str, Any], metadata: dict[str, Any], due: bool) -> None:
    assert scale_down_due(parse_spec({"model": "m", **spec}), metadata, NOW) is due


def test_last_activity_prefers_the_annotation() -> None:
    when = last_activity(meta("2026-03-01T11:58:00.5Z"))
    assert when == datetime.datetime(2026, 3, 1, 11, 58, 0, 500000, tzinfo=UTC)


def test_activity_interval_stays_well_below_the_delay() -> None:
    assert [activity_interval(d) for d in (1, 4, 20, 120, 600, 86400)] == [1, 1, 5, 30, 30, 30]
